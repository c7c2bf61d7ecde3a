// Every loongkit-ops CPU kernel, compiled for AVX-512 F/CD/BW/DQ/VL (x86-64-v4), into
// loongkit::avx512 (see loongkit/kernel_isa_begin.h); the library picks this build at run time.
#define LK_ISA avx512
#include <loongkit/kernel_isa_begin.h>

#include "bev_pool.cpp"
#include "daf.cpp"
#include "dice.cpp"
#include "msda.cpp"
#include "voxelize.cpp"

#include <loongkit/kernel_isa_end.h>

#include "functions.h"
