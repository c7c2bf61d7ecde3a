// Every loongkit-ops CPU kernel, compiled for the x86-64 baseline (SSE2; the only build on other
// architectures), into loongkit::baseline (see loongkit/kernel_isa_begin.h); the library picks this build at run time.
#define LK_ISA baseline
#include <loongkit/kernel_isa_begin.h>

#include "bev_pool.cpp"
#include "daf.cpp"
#include "dice.cpp"
#include "msda.cpp"
#include "voxelize.cpp"

#include <loongkit/kernel_isa_end.h>

#include "functions.h"

#include <loongkit/kernel_main.h>  // the C entry points, once per library
