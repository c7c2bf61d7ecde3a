// Bit-exact mmcv.imnormalize: img.astype(float32); optional BGR<->RGB swap; cv2.subtract with the
// mean in float32; cv2.multiply by 1/std in float64 (OpenCV widens a float32 * double-scalar
// product to double and rounds once to float32). One pass: read the input once, write once.
//
// Built with -ffp-contract=off: a fused multiply-add anywhere would change the last bit.
#pragma once

#include <cstddef>
#include <cstdint>

namespace loongkit {

struct NormParams {
    float mean[3];     // saturate_cast<float>(double mean): what cv2.subtract uses for a float32 image
    double stdinv[3];  // 1 / float64(std), computed in Python exactly as mmcv does
};

// One row of pixel-contiguous input (3 channels, adjacent). Templated so that the loop body has no
// branches and the compiler can vectorize the stride-3 groups.
template <typename T, bool kSwap>
static inline void normalize_row(const T* __restrict__ src, float* __restrict__ dst, std::ptrdiff_t width,
                                 const NormParams& p) {
    const float m0 = p.mean[0], m1 = p.mean[1], m2 = p.mean[2];
    const double k0 = p.stdinv[0], k1 = p.stdinv[1], k2 = p.stdinv[2];
    for (std::ptrdiff_t i = 0; i < width; ++i) {
        const float c0 = static_cast<float>(src[3 * i + (kSwap ? 2 : 0)]);
        const float c1 = static_cast<float>(src[3 * i + 1]);
        const float c2 = static_cast<float>(src[3 * i + (kSwap ? 0 : 2)]);
        dst[3 * i + 0] = static_cast<float>(static_cast<double>(c0 - m0) * k0);
        dst[3 * i + 1] = static_cast<float>(static_cast<double>(c1 - m1) * k1);
        dst[3 * i + 2] = static_cast<float>(static_cast<double>(c2 - m2) * k2);
    }
}

// In place on float32 (mmcv.imnormalize_): same arithmetic, source and destination are one buffer,
// so no __restrict__; each pixel is read whole before it is written.
template <bool kSwap>
static inline void normalize_row_inplace(float* row, std::ptrdiff_t width, const NormParams& p) {
    const float m0 = p.mean[0], m1 = p.mean[1], m2 = p.mean[2];
    const double k0 = p.stdinv[0], k1 = p.stdinv[1], k2 = p.stdinv[2];
    for (std::ptrdiff_t i = 0; i < width; ++i) {
        const float c0 = row[3 * i + (kSwap ? 2 : 0)];
        const float c1 = row[3 * i + 1];
        const float c2 = row[3 * i + (kSwap ? 0 : 2)];
        row[3 * i + 0] = static_cast<float>(static_cast<double>(c0 - m0) * k0);
        row[3 * i + 1] = static_cast<float>(static_cast<double>(c1 - m1) * k1);
        row[3 * i + 2] = static_cast<float>(static_cast<double>(c2 - m2) * k2);
    }
}

// Any byte strides (crops, flips, transposed views): gather one pixel at a time.
template <typename T>
static inline void normalize_row_strided(const char* src, std::ptrdiff_t sx, std::ptrdiff_t sc, float* dst,
                                         std::ptrdiff_t width, bool swap, const NormParams& p) {
    const int a = swap ? 2 : 0, b = swap ? 0 : 2;
    for (std::ptrdiff_t i = 0; i < width; ++i, src += sx, dst += 3) {
        const float c0 = static_cast<float>(*reinterpret_cast<const T*>(src + a * sc));
        const float c1 = static_cast<float>(*reinterpret_cast<const T*>(src + sc));
        const float c2 = static_cast<float>(*reinterpret_cast<const T*>(src + b * sc));
        dst[0] = static_cast<float>(static_cast<double>(c0 - p.mean[0]) * p.stdinv[0]);
        dst[1] = static_cast<float>(static_cast<double>(c1 - p.mean[1]) * p.stdinv[1]);
        dst[2] = static_cast<float>(static_cast<double>(c2 - p.mean[2]) * p.stdinv[2]);
    }
}

}  // namespace loongkit
