// AVX2 helpers shared by the kernels: moving 8 interleaved 3-channel pixels in and out of three
// 8-lane vectors (one per channel).
//
// The kernels are compiled once per instruction set (isa_<isa>.cpp, generated; see loongkit/kernel_isa_begin.h)
// and the library runs the best build the CPU supports: LOONGKIT_AVX2 is defined in the AVX2 and
// AVX-512 builds (AVX2 and FMA: the HSV path needs fused multiply-adds as instructions, not libm
// calls), LOONGKIT_AVX512 (F/BW/DQ/VL, the 512-bit forms) in the AVX-512 build. The baseline build
// (older x86, other architectures) uses the scalar code, which computes the same bits.
#pragma once

#include <loongkit/kernel.h>

#if LK_ISA_TARGETED
#define LOONGKIT_AVX2 1
#if LK_ISA_LEVEL >= 2
#define LOONGKIT_AVX512 1  // imnormalize uses 16-lane vectors (masked loads, fewer instructions)
#endif

namespace loongkit::LK_ISA::simd {

// Byte shuffle that picks channel c of pixels 0..3 from the low lane (bytes p[0..15]) and of
// pixels 4..7 from the high lane (bytes p[8..23]), zero-extended to 32 bits.
static inline __m256i u8_channel_mask(int c) {
    alignas(32) std::int8_t m[32];
    for (int q = 0; q < 8; ++q) {
        const int byte = q < 4 ? 3 * q + c : 3 * q + c - 8;
        m[4 * q] = static_cast<std::int8_t>(byte);
        m[4 * q + 1] = m[4 * q + 2] = m[4 * q + 3] = static_cast<std::int8_t>(0x80);
    }
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(m));
}

struct U8Deinterleave {
    __m256i mask[3];
};

static inline const U8Deinterleave& u8_deinterleave() {
    static const U8Deinterleave d{{u8_channel_mask(0), u8_channel_mask(1), u8_channel_mask(2)}};
    return d;
}

// 8 pixels (24 bytes, none read beyond them) -> channel vectors as float.
static inline void load3(const std::uint8_t* p, const U8Deinterleave& d, __m256& c0, __m256& c1, __m256& c2) {
    const __m256i y = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)), 1);
    c0 = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(y, d.mask[0]));
    c1 = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(y, d.mask[1]));
    c2 = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(y, d.mask[2]));
}

// 8 float pixels (24 floats) -> channel vectors (OpenCV's v_load_deinterleave for v_float32x8).
static inline void load3(const float* p, const U8Deinterleave&, __m256& c0, __m256& c1, __m256& c2) {
    const __m256 x0 = _mm256_loadu_ps(p), x1 = _mm256_loadu_ps(p + 8), x2 = _mm256_loadu_ps(p + 16);
    const __m256 lo = _mm256_permute2f128_ps(x0, x2, 0x20);  // pixels 0, 1, (2), 5, 6, (7)
    const __m256 hi = _mm256_permute2f128_ps(x0, x2, 0x31);
    const __m256 b = _mm256_blend_ps(_mm256_blend_ps(lo, hi, 0x24), x1, 0x92);
    const __m256 g = _mm256_blend_ps(_mm256_blend_ps(hi, lo, 0x92), x1, 0x24);
    const __m256 r = _mm256_blend_ps(_mm256_blend_ps(x1, lo, 0x24), hi, 0x92);
    c0 = _mm256_shuffle_ps(b, b, 0x6c);
    c1 = _mm256_shuffle_ps(g, g, 0xb1);
    c2 = _mm256_shuffle_ps(r, r, 0xc6);
}

// Channel vectors -> 8 interleaved float pixels (OpenCV's v_store_interleave, inverse of load3).
static inline void store3(float* p, __m256 c0, __m256 c1, __m256 c2) {
    const __m256 b = _mm256_shuffle_ps(c0, c0, 0x6c);
    const __m256 g = _mm256_shuffle_ps(c1, c1, 0xb1);
    const __m256 r = _mm256_shuffle_ps(c2, c2, 0xc6);
    const __m256 p0 = _mm256_blend_ps(_mm256_blend_ps(b, g, 0x92), r, 0x24);
    const __m256 p1 = _mm256_blend_ps(_mm256_blend_ps(g, r, 0x92), b, 0x24);
    const __m256 p2 = _mm256_blend_ps(_mm256_blend_ps(r, b, 0x92), g, 0x24);
    _mm256_storeu_ps(p, _mm256_permute2f128_ps(p0, p1, 0x20));
    _mm256_storeu_ps(p + 8, p2);
    _mm256_storeu_ps(p + 16, _mm256_permute2f128_ps(p0, p1, 0x31));
}

#ifdef LOONGKIT_AVX512
// 16 pixels (48 values, as three 16-lane float vectors v[0..2]) <-> three channel vectors.
struct Planar16 {
    __m512i in_lo[3], in_hi[3];    // channel c: permutex2var(v0, in_lo, v1), then lanes from v2
    __mmask16 in_mask[3];
    __m512i out_lo[3], out_hi[3];  // output vector j: permutex2var(cA, out_lo, cB), lanes from cC
    __mmask16 out_mask[3];
};

static inline const Planar16& planar16() {
    static const Planar16 t = [] {
        Planar16 r{};
        alignas(64) std::int32_t lo[16], hi[16];
        for (int c = 0; c < 3; ++c) {
            unsigned m = 0;
            for (int q = 0; q < 16; ++q) {
                const int v = 3 * q + c;  // interleaved index of pixel q, channel c
                lo[q] = v < 32 ? v : 0;
                hi[q] = v < 32 ? 0 : v - 32;
                if (v >= 32) m |= 1u << q;
            }
            r.in_lo[c] = _mm512_load_si512(lo);
            r.in_hi[c] = _mm512_load_si512(hi);
            r.in_mask[c] = static_cast<__mmask16>(m);
        }
        // Output vector j holds values 16j..16j+15; value v is pixel v / 3 of channel v % 3. Pairs
        // (c0, c1) via permutex2var (index + 16 selects c1), channel 2 patched in by the mask.
        for (int j = 0; j < 3; ++j) {
            unsigned m = 0;
            for (int t = 0; t < 16; ++t) {
                const int v = 16 * j + t, q = v / 3, c = v % 3;
                lo[t] = c == 0 ? q : (c == 1 ? q + 16 : 0);
                hi[t] = c == 2 ? q : 0;
                if (c == 2) m |= 1u << t;
            }
            r.out_lo[j] = _mm512_load_si512(lo);
            r.out_hi[j] = _mm512_load_si512(hi);
            r.out_mask[j] = static_cast<__mmask16>(m);
        }
        return r;
    }();
    return t;
}

static inline void load3x16(const std::uint8_t* p, const Planar16& t, __m512 c[3]) {
    __m512 v[3];
    for (int k = 0; k < 3; ++k)
        v[k] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * k))));
    for (int k = 0; k < 3; ++k)
        c[k] = _mm512_mask_permutexvar_ps(_mm512_permutex2var_ps(v[0], t.in_lo[k], v[1]), t.in_mask[k], t.in_hi[k], v[2]);
}

static inline void load3x16(const float* p, const Planar16& t, __m512 c[3]) {
    const __m512 v0 = _mm512_loadu_ps(p), v1 = _mm512_loadu_ps(p + 16), v2 = _mm512_loadu_ps(p + 32);
    for (int k = 0; k < 3; ++k)
        c[k] = _mm512_mask_permutexvar_ps(_mm512_permutex2var_ps(v0, t.in_lo[k], v1), t.in_mask[k], t.in_hi[k], v2);
}

static inline void store3x16(float* p, const Planar16& t, __m512 c0, __m512 c1, __m512 c2) {
    for (int j = 0; j < 3; ++j)
        _mm512_storeu_ps(p + 16 * j, _mm512_mask_permutexvar_ps(_mm512_permutex2var_ps(c0, t.out_lo[j], c1),
                                                                t.out_mask[j], t.out_hi[j], c2));
}
#endif

}  // namespace loongkit::LK_ISA::simd
#endif
