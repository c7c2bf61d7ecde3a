// loongkit/kernel_isa_begin.h: opens the instruction-set region of one isa_<isa>.cpp (a translation
// unit loongkit_core.kernelbuild generates as below, or a hand-written one).
//
//   #define LK_ISA avx512              // or avx2, baseline
//   #include <loongkit/kernel_isa_begin.h>
//   #include "my_kernels.cpp"          // namespace mylib::LK_ISA { ... }
//   #include <loongkit/kernel_isa_end.h>
//   LK_TABLE_BEGIN ... LK_TABLE_END    // the function table (baseline code)
//
// Everything defined between begin and end is compiled for that ISA (GCC target pragma): keep it
// free of namespace-scope objects with dynamic initialisation (they would run at load time on any
// CPU) and reach it only through the table. Standard headers must come before (loongkit/kernel.h
// includes them), so their templates stay baseline code. GCC does not update __AVX2__ & co. under
// a target pragma in C++: test LK_ISA_LEVEL (0 baseline, 1 avx2, 2 avx512) instead.
//
// avx2   = x86-64-v3's vector part: AVX, AVX2, FMA, BMI1/2, POPCNT (Haswell, Zen, Hygon Dhyana)
// avx512 = avx2 + AVX-512 F, CD, BW, DQ, VL (x86-64-v4: Skylake-SP and later, Zen 4)
// The CPU checks in kernel_main.h test exactly these features.
#include <loongkit/kernel.h>

#ifndef LK_ISA
#error "define LK_ISA (baseline, avx2 or avx512) before including loongkit/kernel_isa_begin.h"
#endif
#ifdef LK_ISA_LEVEL
#error "loongkit/kernel_isa_begin.h: one ISA region per translation unit"
#endif

#define LK_ISA_baseline 0
#define LK_ISA_avx2 1
#define LK_ISA_avx512 2
#define LK_ISA_LEVEL LK_CAT(LK_ISA_, LK_ISA)

#if defined(__x86_64__) && (LK_ISA_LEVEL == 1 || LK_ISA_LEVEL == 2)
#define LK_ISA_TARGETED 1
#if defined(__clang__)
#if LK_ISA_LEVEL == 2
#pragma clang attribute push(__attribute__((target("avx,avx2,fma,bmi,bmi2,popcnt,avx512f,avx512cd,avx512bw,avx512dq,avx512vl"))), apply_to = function)
#else
#pragma clang attribute push(__attribute__((target("avx,avx2,fma,bmi,bmi2,popcnt"))), apply_to = function)
#endif
#else
#pragma GCC push_options
#if LK_ISA_LEVEL == 2
#pragma GCC target("avx,avx2,fma,bmi,bmi2,popcnt,avx512f,avx512cd,avx512bw,avx512dq,avx512vl")
#else
#pragma GCC target("avx,avx2,fma,bmi,bmi2,popcnt")
#endif
#endif
#else
// Baseline, and every region on other architectures (their tables are reported unsupported).
#define LK_ISA_TARGETED 0
#endif
