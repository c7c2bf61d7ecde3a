// Every loongkit-ops CPU kernel, compiled for AVX2 + FMA (x86-64-v3), into
// loongkit::avx2 (see loongkit/kernel_isa_begin.h); the library picks this build at run time.
#define LK_ISA avx2
#include <loongkit/kernel_isa_begin.h>

#include "bev_pool.cpp"
#include "daf.cpp"
#include "dice.cpp"
#include "msda.cpp"
#include "voxelize.cpp"

#include <loongkit/kernel_isa_end.h>

#include "functions.h"
