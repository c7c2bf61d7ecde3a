// Entry points of the loongkit-data CPU kernels (defined in kernels.cpp). Every function declared at
// the top level of the namespace below is in the library's table (what Python sees), and every *.cpp
// is compiled once per instruction set into loongkit::<isa>: loongkit_core.kernelbuild generates both.
//
// Interface: lk::View arrays (loongkit/kernel.h) handed over by loongkit_core.kernels. mmcv and mmdet
// hand numpy HWC images around, so the kernels take any strided numpy view directly (crops and
// flipped views included, which torch.from_numpy refuses for negative strides), the Python side
// allocates the output with numpy (same type and flags as upstream's result) and no tensor wrapping
// happens per call. The GIL is released while pixels are processed (ctypes does).
#pragma once

#include <loongkit/kernel.h>

namespace loongkit::LK_ISA {

using lk::View;

// imnormalize(src, dst, mean_f32[3], stdinv_f64[3], to_rgb, product, threads); src may be dst (imnormalize_);
// product: 0 widens (c - mean) * stdinv to double (OpenCV <= 5.0), 1 multiplies in float32 (5.1).
void imnormalize(const View& s, const View& d, const std::vector<double>& mean, const std::vector<double>& stdinv,
                 bool to_rgb, int64_t product, int64_t threads);

// imnormalize_split(mean_f32[3], stdinv_f64[3]) -> bool: whether uint8 input takes the float32-only
// product for these parameters (its exhaustive check passed); false in the baseline build.
bool imnormalize_split(const std::vector<double>& mean, const std::vector<double>& stdinv);

// distort(src, dst, delta, alpha_pre, sat, clip_sat, hue, alpha_post, perm, mode[5], threads) -> bool.
// False (dst untouched or partly written) when a float input is outside what the kernel reproduces.
bool distort(const View& s, const View& d, float delta, float alpha_pre, float sat, bool clip_sat, float hue,
             float alpha_post, const std::vector<int64_t>& perm, const std::vector<int64_t>& mode, int64_t threads);

}  // namespace loongkit::LK_ISA
