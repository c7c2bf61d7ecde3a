// Bit-exact mmcv.imnormalize: img.astype(float32); optional BGR<->RGB swap; cv2.subtract with the
// mean in float32; cv2.multiply by 1/std. How OpenCV multiplies a float32 image by a double scalar
// is the product mode: up to 5.0 it widens the product to double and rounds once to float32
// (kWiden); 5.1 rounds the scalar to float32 and multiplies in float32 (kF32). Which one the
// installed cv2 does is calibrated at first use (kernels/ops.py). One pass: read the input once,
// write once.
//
// Built with -ffp-contract=off: a fused multiply-add anywhere would change the last bit.
#pragma once

#include "simd.h"

namespace loongkit::LK_ISA {

struct NormParams {
    float mean[3];     // saturate_cast<float>(double mean): what cv2.subtract uses for a float32 image
    double stdinv[3];  // 1 / float64(std), computed in Python exactly as mmcv does
    float stdinv_f[3]; // the same rounded to float32 (the kF32 product's scalar)
    bool f32 = false;  // product mode kF32 (else kWiden)
};

// One output value in each product mode.
template <bool kF32>
static inline float norm1(float c, float m, double k, float kf) {
    if constexpr (kF32) return (c - m) * kf;
    return static_cast<float>(static_cast<double>(c - m) * k);
}

// One row of pixel-contiguous input (3 channels, adjacent). Templated so that the loop body has no
// branches and the compiler can vectorize the stride-3 groups.
template <typename T, bool kSwap, bool kF32>
static inline void normalize_row(const T* __restrict__ src, float* __restrict__ dst, std::ptrdiff_t width,
                                 const NormParams& p) {
    const float m0 = p.mean[0], m1 = p.mean[1], m2 = p.mean[2];
    const double k0 = p.stdinv[0], k1 = p.stdinv[1], k2 = p.stdinv[2];
    const float f0 = p.stdinv_f[0], f1 = p.stdinv_f[1], f2 = p.stdinv_f[2];
    for (std::ptrdiff_t i = 0; i < width; ++i) {
        const float c0 = static_cast<float>(src[3 * i + (kSwap ? 2 : 0)]);
        const float c1 = static_cast<float>(src[3 * i + 1]);
        const float c2 = static_cast<float>(src[3 * i + (kSwap ? 0 : 2)]);
        dst[3 * i + 0] = norm1<kF32>(c0, m0, k0, f0);
        dst[3 * i + 1] = norm1<kF32>(c1, m1, k1, f1);
        dst[3 * i + 2] = norm1<kF32>(c2, m2, k2, f2);
    }
}

// In place on float32 (mmcv.imnormalize_): same arithmetic, source and destination are one buffer,
// so no __restrict__; each pixel is read whole before it is written.
template <bool kSwap, bool kF32>
static inline void normalize_row_inplace(float* row, std::ptrdiff_t width, const NormParams& p) {
    const float m0 = p.mean[0], m1 = p.mean[1], m2 = p.mean[2];
    const double k0 = p.stdinv[0], k1 = p.stdinv[1], k2 = p.stdinv[2];
    const float f0 = p.stdinv_f[0], f1 = p.stdinv_f[1], f2 = p.stdinv_f[2];
    for (std::ptrdiff_t i = 0; i < width; ++i) {
        const float c0 = row[3 * i + (kSwap ? 2 : 0)];
        const float c1 = row[3 * i + 1];
        const float c2 = row[3 * i + (kSwap ? 0 : 2)];
        row[3 * i + 0] = norm1<kF32>(c0, m0, k0, f0);
        row[3 * i + 1] = norm1<kF32>(c1, m1, k1, f1);
        row[3 * i + 2] = norm1<kF32>(c2, m2, k2, f2);
    }
}

// Any byte strides (crops, flips, transposed views): gather one pixel at a time.
template <typename T, bool kF32>
static inline void normalize_row_strided(const char* src, std::ptrdiff_t sx, std::ptrdiff_t sc, float* dst,
                                         std::ptrdiff_t width, bool swap, const NormParams& p) {
    const int a = swap ? 2 : 0, b = swap ? 0 : 2;
    for (std::ptrdiff_t i = 0; i < width; ++i, src += sx, dst += 3) {
        const float c0 = static_cast<float>(*reinterpret_cast<const T*>(src + a * sc));
        const float c1 = static_cast<float>(*reinterpret_cast<const T*>(src + sc));
        const float c2 = static_cast<float>(*reinterpret_cast<const T*>(src + b * sc));
        dst[0] = norm1<kF32>(c0, p.mean[0], p.stdinv[0], p.stdinv_f[0]);
        dst[1] = norm1<kF32>(c1, p.mean[1], p.stdinv[1], p.stdinv_f[1]);
        dst[2] = norm1<kF32>(c2, p.mean[2], p.stdinv[2], p.stdinv_f[2]);
    }
}

// SIMD: the row is processed as a flat run of values in blocks of 3 vectors (kBlock pixels) with
// the per-channel mean and 1/std laid out as 3-periodic vectors, so nothing is deinterleaved. Each
// lane does the scalar sequence: float32 subtract, widen to double, double multiply, one rounding
// to float32 (vsubps / vcvtps2pd / vmulpd / vcvtpd2ps are the same IEEE operations as their scalar
// forms, under the same MXCSR); in product mode kF32, float32 subtract and float32 multiply.
//
// uint8 input has a faster exact route (split): the product without leaving float32,
// d * (khi + klo) with the rounding error of d * khi recovered by a fused multiply-subtract, then
// rounded once. That is the correctly rounded product up to ~2^-47, not OpenCV's
// double-then-float rounding, so it may differ in rare near-tie cases; it is used only after
// norm_split_exact() has run all 256 values of every channel through both routes (the whole
// uint8 input domain) and found them identical, bit for bit, for this call's mean and std.
#if defined(LOONGKIT_AVX512)
// uint8 input only: for float32 input the compiler's own AVX-512 vectorization of the scalar loops
// was measured faster once the image no longer fits in cache (and equal or ~20% slower in cache).
constexpr std::ptrdiff_t kBlock = 16;   // pixels per block: 48 values, three 16-lane vectors
constexpr bool kFloatBlocks = false;
constexpr bool kFloatSwapMargin = false;  // unused: no float blocks here

struct NormVec {
    __m512 mean[3];
    __m512d k[6];
    __m512 khi[3], klo[3];  // float32 split of 1/std: khi = (float)k, klo = (float)(k - khi)
    __m512 kf[3];           // 1/std rounded to float32 (product mode kF32)
    bool split = false;     // uint8 input may take the split route (set by the caller)
};

static inline __m512 norm_vec_f32(__m512 x, __m512 m, __m512 kf) { return _mm512_mul_ps(_mm512_sub_ps(x, m), kf); }

static inline __m512 norm_vec_exact(__m512 x, __m512 m, __m512d ka, __m512d kb) {
    const __m512 d = _mm512_sub_ps(x, m);
    const __m256 lo = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(d)), ka));
    const __m256 hi = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(d, 1)), kb));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

static inline __m512 norm_vec_split(__m512 x, __m512 m, __m512 khi, __m512 klo) {
    const __m512 d = _mm512_sub_ps(x, m);
    const __m512 p = _mm512_mul_ps(d, khi);
    const __m512 e = _mm512_fmsub_ps(d, khi, p);  // exact: d * khi - p
    return _mm512_add_ps(p, _mm512_fmadd_ps(d, klo, e));
}

// to_rgb: output value v takes input v + 2, v, v - 2 for v % 3 = 0, 1, 2. Lane masks per vector K.
template <int K>
constexpr __mmask16 kPlus = K == 0 ? 0x9249 : (K == 1 ? 0x4924 : 0x2492);
template <int K>
constexpr __mmask16 kMinus = K == 0 ? 0x4924 : (K == 1 ? 0x2492 : 0x9249);

template <bool kSwap, int K>
static inline __m512 load_vec(const std::uint8_t* p) {
    __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * K));
    if (kSwap) {  // masked lanes are not read: every byte touched lies inside the block
        x = _mm_mask_loadu_epi8(x, kPlus<K>, p + 16 * K + 2);
        x = _mm_mask_loadu_epi8(x, kMinus<K>, p + 16 * K - 2);
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x));
}

static inline void store_vec(float* o, __m512 x) { _mm512_storeu_ps(o, x); }

static inline NormVec norm_vec(const NormParams& p) {
    alignas(64) float m[48], hi[48], lo[48], kf[48];
    alignas(64) double k[48];
    for (int v = 0; v < 48; ++v) {
        m[v] = p.mean[v % 3];
        k[v] = p.stdinv[v % 3];
        kf[v] = p.stdinv_f[v % 3];
        hi[v] = static_cast<float>(k[v]);
        lo[v] = static_cast<float>(k[v] - static_cast<double>(hi[v]));
    }
    NormVec n;
    for (int i = 0; i < 3; ++i) {
        n.mean[i] = _mm512_load_ps(m + 16 * i);
        n.khi[i] = _mm512_load_ps(hi + 16 * i);
        n.klo[i] = _mm512_load_ps(lo + 16 * i);
        n.kf[i] = _mm512_load_ps(kf + 16 * i);
    }
    for (int i = 0; i < 6; ++i) n.k[i] = _mm512_load_pd(k + 8 * i);
    return n;
}
#elif defined(LOONGKIT_AVX2)
constexpr std::ptrdiff_t kBlock = 8;    // pixels per block: 24 values, three 8-lane vectors
constexpr bool kFloatBlocks = true;      // ~1.3-1.6x faster than the compiler's AVX2 loops
constexpr bool kFloatSwapMargin = true;  // float to_rgb loads read 2 values either side of a block

struct NormVec {
    __m256 mean[3];
    __m256d k[6];
    __m256 khi[3], klo[3];
    __m256 kf[3];
    __m256i swap[3];  // uint8 to_rgb: byte shuffle of a 16-byte load at 4K -> values 8K..8K+7 (int32)
    bool split = false;
};

static inline __m256 norm_vec_exact(__m256 x, __m256 m, __m256d ka, __m256d kb) {
    const __m256 d = _mm256_sub_ps(x, m);
    const __m128 lo = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(d)), ka));
    const __m128 hi = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(d, 1)), kb));
    return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

static inline __m256 norm_vec_f32(__m256 x, __m256 m, __m256 kf) { return _mm256_mul_ps(_mm256_sub_ps(x, m), kf); }

static inline __m256 norm_vec_split(__m256 x, __m256 m, __m256 khi, __m256 klo) {
    const __m256 d = _mm256_sub_ps(x, m);
    const __m256 p = _mm256_mul_ps(d, khi);
    const __m256 e = _mm256_fmsub_ps(d, khi, p);
    return _mm256_add_ps(p, _mm256_fmadd_ps(d, klo, e));
}

template <bool kSwap, int K>
static inline __m256 load_vec(const std::uint8_t* p, const NormVec& n) {
    if (kSwap) {  // the block's 24 bytes only: 16-byte loads at 0, 4, 8
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4 * K));
        return _mm256_cvtepi32_ps(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(x), n.swap[K]));
    }
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * K))));
}

template <bool kSwap, int K>
static inline __m256 load_vec(const float* p, const NormVec&) {
    const __m256 c = _mm256_loadu_ps(p + 8 * K);
    if (!kSwap) return c;
    constexpr int plus = K == 0 ? 0x49 : (K == 1 ? 0x92 : 0x24);
    constexpr int minus = K == 0 ? 0x24 : (K == 1 ? 0x49 : 0x92);
    const __m256 b = _mm256_blend_ps(c, _mm256_loadu_ps(p + 8 * K + 2), plus);
    return _mm256_blend_ps(b, _mm256_loadu_ps(p + 8 * K - 2), minus);
}

static inline void store_vec(float* o, __m256 x) { _mm256_storeu_ps(o, x); }

static inline NormVec norm_vec(const NormParams& p) {
    alignas(32) float m[24], hi[24], lo[24], kf[24];
    alignas(32) double k[24];
    alignas(32) std::int8_t sh[3][32];
    for (int v = 0; v < 24; ++v) {
        m[v] = p.mean[v % 3];
        k[v] = p.stdinv[v % 3];
        kf[v] = p.stdinv_f[v % 3];
        hi[v] = static_cast<float>(k[v]);
        lo[v] = static_cast<float>(k[v] - static_cast<double>(hi[v]));
        const int kk = v / 8, q = v % 8;
        const int delta = v % 3 == 0 ? 2 : (v % 3 == 2 ? -2 : 0);
        sh[kk][4 * q] = static_cast<std::int8_t>(4 * kk + q + delta);
        sh[kk][4 * q + 1] = sh[kk][4 * q + 2] = sh[kk][4 * q + 3] = static_cast<std::int8_t>(0x80);
    }
    NormVec n;
    for (int i = 0; i < 3; ++i) {
        n.mean[i] = _mm256_load_ps(m + 8 * i);
        n.khi[i] = _mm256_load_ps(hi + 8 * i);
        n.klo[i] = _mm256_load_ps(lo + 8 * i);
        n.kf[i] = _mm256_load_ps(kf + 8 * i);
        n.swap[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(sh[i]));
    }
    for (int i = 0; i < 6; ++i) n.k[i] = _mm256_load_pd(k + 4 * i);
    return n;
}
#endif

#if defined(LOONGKIT_AVX2)
#if defined(LOONGKIT_AVX512)
#define LK_LOAD(K) load_vec<kSwap, K>(s)
#else
#define LK_LOAD(K) load_vec<kSwap, K>(s, n)
#endif
// Pixels [i0, i1) of a row, i1 - i0 a multiple of kBlock. src may equal dst (in place): a block's
// loads all happen before its stores, and values read outside the block (AVX2 float to_rgb) are
// in lanes the blend discards or in the next, not yet written, block.
enum class Route { kWiden, kSplit, kF32 };

template <typename T, bool kSwap, Route R>
static inline void normalize_blocks(const T* src, float* dst, std::ptrdiff_t i0, std::ptrdiff_t i1,
                                    const NormVec& n) {
    constexpr std::ptrdiff_t L = kBlock;  // values per vector
    for (std::ptrdiff_t i = i0; i < i1; i += kBlock) {
        const T* s = src + 3 * i;
        const auto x0 = LK_LOAD(0), x1 = LK_LOAD(1), x2 = LK_LOAD(2);
        float* o = dst + 3 * i;
        if constexpr (R == Route::kF32) {
            store_vec(o, norm_vec_f32(x0, n.mean[0], n.kf[0]));
            store_vec(o + L, norm_vec_f32(x1, n.mean[1], n.kf[1]));
            store_vec(o + 2 * L, norm_vec_f32(x2, n.mean[2], n.kf[2]));
        } else if constexpr (R == Route::kSplit) {
            store_vec(o, norm_vec_split(x0, n.mean[0], n.khi[0], n.klo[0]));
            store_vec(o + L, norm_vec_split(x1, n.mean[1], n.khi[1], n.klo[1]));
            store_vec(o + 2 * L, norm_vec_split(x2, n.mean[2], n.khi[2], n.klo[2]));
        } else {
            store_vec(o, norm_vec_exact(x0, n.mean[0], n.k[0], n.k[1]));
            store_vec(o + L, norm_vec_exact(x1, n.mean[1], n.k[2], n.k[3]));
            store_vec(o + 2 * L, norm_vec_exact(x2, n.mean[2], n.k[4], n.k[5]));
        }
    }
}
#undef LK_LOAD

// The exhaustive check: 256 grey pixels (value i in all three channels) through both routes.
static inline bool norm_split_exact(const NormVec& n) {
    static_assert(256 % kBlock == 0);
    alignas(64) std::uint8_t grey[256 * 3];
    alignas(64) float a[256 * 3], b[256 * 3];
    for (int i = 0; i < 256 * 3; ++i) grey[i] = static_cast<std::uint8_t>(i / 3);
    normalize_blocks<std::uint8_t, false, Route::kWiden>(grey, a, 0, 256, n);
    normalize_blocks<std::uint8_t, false, Route::kSplit>(grey, b, 0, 256, n);
    return std::memcmp(a, b, sizeof(a)) == 0;
}
#else
struct NormVec {
    bool split = false;
};
static inline NormVec norm_vec(const NormParams&) { return {}; }
#endif

// A pixel-contiguous row, out of place (src != dst) or in place (float32, src == dst).
template <typename T, bool kSwap, bool kF32>
static inline void normalize_row_fast(const T* src, float* dst, std::ptrdiff_t width, const NormParams& p,
                                      [[maybe_unused]] const NormVec& n) {
    std::ptrdiff_t i0 = 0, i1 = 0;
#ifdef LOONGKIT_AVX2
    // Margin: start at pixel 1 (done first, before the first block reads it) and end one early.
    constexpr bool margin = kFloatSwapMargin && kSwap && sizeof(T) == 4;
    i0 = margin ? 1 : 0;
    const std::ptrdiff_t avail = width - i0 - (margin ? 1 : 0);
    i1 = avail >= kBlock ? i0 + (avail / kBlock) * kBlock : i0;
    if (sizeof(T) == 4 && !kFloatBlocks) i1 = i0;  // all scalar (compiler-vectorized)
#endif
    const bool inplace = static_cast<const void*>(src) == static_cast<const void*>(dst);
    auto scalar = [&](std::ptrdiff_t a, std::ptrdiff_t b) {
        if (a >= b) return;
        if constexpr (sizeof(T) == 4) {
            if (inplace) return normalize_row_inplace<kSwap, kF32>(dst + 3 * a, b - a, p);
        }
        normalize_row<T, kSwap, kF32>(src + 3 * a, dst + 3 * a, b - a, p);
    };
    if (i1 == i0) return scalar(0, width);
    scalar(0, i0);
#ifdef LOONGKIT_AVX2
    if constexpr (sizeof(T) == 1 || kFloatBlocks) {
        if constexpr (kF32)
            normalize_blocks<T, kSwap, Route::kF32>(src, dst, i0, i1, n);
        else if (sizeof(T) == 1 && n.split)
            normalize_blocks<T, kSwap, Route::kSplit>(src, dst, i0, i1, n);
        else
            normalize_blocks<T, kSwap, Route::kWiden>(src, dst, i0, i1, n);
    }
#endif
    scalar(i1, width);
}

}  // namespace loongkit::LK_ISA
