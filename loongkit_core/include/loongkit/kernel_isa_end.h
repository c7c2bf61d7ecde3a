// loongkit/kernel_isa_end.h: closes the region opened by kernel_isa_begin.h.
#if LK_ISA_TARGETED
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
