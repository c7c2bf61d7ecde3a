// Bit-exact mmdet PhotoMetricDistortion pixel arithmetic, fused into one pass per image.
//
// Upstream (per image): astype(float32); += delta; *= alpha (contrast first); cv2.cvtColor
// BGR2HSV (float); s *= sat, clip to [0, 1]; h += hue, wrap into [0, 360]; cv2.cvtColor HSV2BGR;
// *= alpha (contrast last); channel permutation. Every step is float32 arithmetic; "off" steps are
// passed as neutral values (x + 0, x * 1), which are exact identities for the values that reach
// them (the Python side sends float inputs holding -0, inf or NaN to upstream).
//
// OpenCV's float HSV conversions run a SIMD body and a scalar loop with different formulas
// (division in float vs double, truncating vs flooring sector selection, explicit or
// compiler-contracted fused multiply-adds). Up to 5.0 the SIMD body takes the first
// (width / lanes) * lanes pixels of each row and the scalar loop the rest; from 5.1 a row of at
// least one vector is all SIMD body (its last vector overlaps the one before), a shorter row all scalar.
// Both are reproduced operation by operation; which lane count, which contractions and which row
// ending the installed OpenCV build uses on this CPU is a runtime HsvMode, chosen by calibrating
// against cv2 itself (kernels/ops.py). The file is compiled with -ffp-contract=off, so the
// only fused operations are the std::fma calls below.
#pragma once

#include "simd.h"

namespace loongkit::LK_ISA {

struct DistortParams {
    float delta;      // brightness (0 when off)
    float alpha_pre;  // contrast before HSV (1 when off)
    float sat;        // saturation factor (1 when off)
    bool clip_sat;    // clip saturation into [0, 1] after scaling
    float hue;        // hue shift in degrees (0 when off)
    float alpha_post; // contrast after HSV (1 when off)
    int perm[3];      // output channel c takes channel perm[c]
};

struct HsvMode {
    int lanes;          // pixels per SIMD iteration (4 SSE, 8 AVX2, 16 AVX-512)
    bool simd_fma;      // v_muladd is a fused multiply-add
    bool simd_contract; // v_sub(1, v_mul(s, h)) contracted into one fused op by the compiler
    bool tail_contract; // the scalar tail's a*b + c contracted likewise
    bool overlap;       // a row of >= lanes pixels is all SIMD body (OpenCV 5.1's overlapping last vector)
};

static inline float fmin_sse(float a, float b) { return a < b ? a : b; }  // _mm_min_ps(a, b)
static inline float fmax_sse(float a, float b) { return a > b ? a : b; }  // _mm_max_ps(a, b)
static inline std::uint32_t bits(float x) { std::uint32_t u; std::memcpy(&u, &x, 4); return u; }
static inline float from_bits(std::uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
static inline std::uint32_t mask(bool c) { return c ? 0xffffffffu : 0u; }

// RGB2HSV_f::process (SIMD body); r, g, b are the red, green, blue values.
template <bool kFma>
static inline void rgb2hsv_simd(float r, float g, float b, float& h, float& s, float& v) {
    const float hscale = 360.f * (1.f / 360.f);
    const float mn = fmin_sse(fmin_sse(r, g), b);
    const float mx = fmax_sse(fmax_sse(r, g), b);
    const float diff = mx - mn;
    s = diff / (std::fabs(mx) + FLT_EPSILON);
    const bool req = r == mx, geq = g == mx;
    const float hh = req ? g - b : (geq ? b - r : r - g);
    const float res = req ? (g < b ? 360.f : 0.f) : (geq ? 120.f : 240.f);
    const float rev = 60.f / (diff + FLT_EPSILON);
    h = (kFma ? std::fma(hh, rev, res) : hh * rev + res) * hscale;
    v = mx;
}

// RGB2HSV_f scalar loop (row tails): 60/diff in double, flooring added 360 for negative hue.
template <bool kContract>
static inline void rgb2hsv_tail(float r, float g, float b, float& h, float& s, float& v) {
    const float hscale = 360.f * (1.f / 360.f);
    float vmax = r, vmin = r;
    if (vmax < g) vmax = g;
    if (vmax < b) vmax = b;
    if (vmin > g) vmin = g;
    if (vmin > b) vmin = b;
    float diff = vmax - vmin;
    s = diff / static_cast<float>(std::fabs(vmax) + FLT_EPSILON);
    diff = static_cast<float>(60. / static_cast<double>(diff + FLT_EPSILON));
    float hh;
    if (vmax == r)
        hh = (g - b) * diff;
    else if (vmax == g)
        hh = kContract ? std::fma(b - r, diff, 120.f) : (b - r) * diff + 120.f;
    else
        hh = kContract ? std::fma(r - g, diff, 240.f) : (r - g) * diff + 240.f;
    if (hh < 0) hh += 360.f;
    h = hh * hscale;
    v = vmax;
}

// HSV2RGB_simd: truncating sector selection, table picked with and/or masks.
template <bool kContract>
static inline void hsv2rgb_simd(float h, float s, float v, float& b, float& g, float& r) {
    const float hscale = 6.f / 360.f;
    h = h * hscale;
    const float pre = static_cast<float>(static_cast<std::int32_t>(h));
    h = h - pre;
    const float tab0 = v;
    const float tab1 = v * (1.f - s);
    const float tab2 = v * (kContract ? std::fma(-s, h, 1.f) : 1.f - s * h);
    const float oneh = 1.f - h;
    const float tab3 = v * (kContract ? std::fma(-s, oneh, 1.f) : 1.f - s * oneh);
    float sector = static_cast<float>(static_cast<std::int32_t>(pre * (1.0f / 6.0f)));
    sector = kContract ? std::fma(-sector, 6.f, pre) : pre - sector * 6.f;
    const std::uint32_t t0 = bits(tab0), t1 = bits(tab1), t2 = bits(tab2), t3 = bits(tab3);
    b = from_bits((t1 & mask(sector < 2.f)) | (t3 & mask(sector == 2.f)) | (t0 & mask(sector == 3.f)) |
                  (t0 & mask(sector == 4.f)) | (t2 & mask(sector > 4.f)));
    g = from_bits((t3 & mask(sector < 1.f)) | (t0 & mask(sector == 1.f)) | (t0 & mask(sector == 2.f)) |
                  (t2 & mask(sector == 3.f)) | (t1 & mask(sector > 3.f)));
    r = from_bits((t0 & mask(sector < 1.f)) | (t2 & mask(sector == 1.f)) | (t1 & mask(sector == 2.f)) |
                  (t1 & mask(sector == 3.f)) | (t3 & mask(sector == 4.f)) | (t0 & mask(sector > 4.f)));
}

// HSV2RGB_native (row tails): fmod and flooring sector selection, s == 0 shortcut.
template <bool kContract>
static inline void hsv2rgb_tail(float h, float s, float v, float& b, float& g, float& r) {
    const float hscale = 6.f / 360.f;
    if (s == 0) {
        b = g = r = v;
        return;
    }
    static const int sector_data[][3] = {{1, 3, 0}, {1, 0, 2}, {3, 0, 1}, {0, 2, 1}, {0, 1, 3}, {2, 1, 0}};
    float tab[4];
    h *= hscale;
    h = std::fmod(h, 6.f);
    int sector = static_cast<int>(std::floor(h));
    h -= static_cast<float>(sector);
    if (static_cast<unsigned>(sector) >= 6u) {
        sector = 0;
        h = 0.f;
    }
    tab[0] = v;
    tab[1] = v * (1.f - s);
    tab[2] = v * (kContract ? std::fma(-s, h, 1.f) : 1.f - s * h);
    const float oneh = 1.f - h;
    tab[3] = v * (kContract ? std::fma(-s, oneh, 1.f) : 1.f - s * oneh);
    b = tab[sector_data[sector][0]];
    g = tab[sector_data[sector][1]];
    r = tab[sector_data[sector][2]];
}

// The numpy steps between the two conversions (float32, in upstream's order).
static inline void adjust_hsv(float& h, float& s, const DistortParams& p) {
    s = s * p.sat;
    // numpy's clip(0, 1) for finite values (never -0 here); bounds of +-inf when off keep the loop
    // branch-free (std::fmin/fmax would not vectorize: they carry NaN rules).
    const float lo = p.clip_sat ? 0.f : -INFINITY, hi = p.clip_sat ? 1.f : INFINITY;
    s = s < lo ? lo : s;
    s = s > hi ? hi : s;
    h = h + p.hue;
    if (h > 360.f) h -= 360.f;
    if (h < 0.f) h += 360.f;
}

// The channel swap runs over the finished row while it is still in L1: a runtime permutation inside
// the main loop would stop it from vectorizing.
static inline void permute_row(float* o, std::ptrdiff_t width, const int perm[3]) {
    const int p0 = perm[0], p1 = perm[1], p2 = perm[2];
    for (std::ptrdiff_t i = 0; i < width; ++i, o += 3) {
        const float c[3] = {o[0], o[1], o[2]};
        o[0] = c[p0];
        o[1] = c[p1];
        o[2] = c[p2];
    }
}

#ifdef LOONGKIT_AVX2
// 8 pixels of the SIMD-body formulas at once: rgb2hsv_simd, adjust_hsv and hsv2rgb_simd with every
// scalar operation replaced by its 8-lane form, in the same order (IEEE add/sub/mul/div and
// cvttps2dq are lane-wise identical to the scalar instructions; the ternaries become blends of
// values the scalar code would also have computed; fused operations exactly where the scalar code
// calls std::fma). Pixels are independent, so this holds for any of OpenCV's lane counts: it only
// decides how many pixels of a row take these formulas (nsimd below).
struct DistortVec {
    __m256 delta, a0, a1, sat, lo, hi, hue;
    const simd::U8Deinterleave* u8;
};

static inline DistortVec distort_vec(const DistortParams& p) {
    DistortVec v;
    v.delta = _mm256_set1_ps(p.delta);
    v.a0 = _mm256_set1_ps(p.alpha_pre);
    v.a1 = _mm256_set1_ps(p.alpha_post);
    v.sat = _mm256_set1_ps(p.sat);
    v.lo = _mm256_set1_ps(p.clip_sat ? 0.f : -INFINITY);
    v.hi = _mm256_set1_ps(p.clip_sat ? 1.f : INFINITY);
    v.hue = _mm256_set1_ps(p.hue);
    v.u8 = &simd::u8_deinterleave();
    return v;
}

template <bool kFma, bool kContract>
static inline void distort8(__m256& b, __m256& g, __m256& r, const DistortVec& dv) {
    const __m256 one = _mm256_set1_ps(1.f), c360 = _mm256_set1_ps(360.f), eps = _mm256_set1_ps(FLT_EPSILON);
    b = _mm256_mul_ps(_mm256_add_ps(b, dv.delta), dv.a0);
    g = _mm256_mul_ps(_mm256_add_ps(g, dv.delta), dv.a0);
    r = _mm256_mul_ps(_mm256_add_ps(r, dv.delta), dv.a0);
    // rgb2hsv_simd
    const __m256 mn = _mm256_min_ps(_mm256_min_ps(r, g), b);
    const __m256 mx = _mm256_max_ps(_mm256_max_ps(r, g), b);
    const __m256 diff = _mm256_sub_ps(mx, mn);
    const __m256 absmx = _mm256_andnot_ps(_mm256_set1_ps(-0.f), mx);
    __m256 s = _mm256_div_ps(diff, _mm256_add_ps(absmx, eps));
    const __m256 req = _mm256_cmp_ps(r, mx, _CMP_EQ_OQ), geq = _mm256_cmp_ps(g, mx, _CMP_EQ_OQ);
    const __m256 hh = _mm256_blendv_ps(_mm256_blendv_ps(_mm256_sub_ps(r, g), _mm256_sub_ps(b, r), geq),
                                       _mm256_sub_ps(g, b), req);
    const __m256 res = _mm256_blendv_ps(
        _mm256_blendv_ps(_mm256_set1_ps(240.f), _mm256_set1_ps(120.f), geq),
        _mm256_and_ps(_mm256_cmp_ps(g, b, _CMP_LT_OQ), c360), req);
    const __m256 rev = _mm256_div_ps(_mm256_set1_ps(60.f), _mm256_add_ps(diff, eps));
    const __m256 hsc = _mm256_set1_ps(360.f * (1.f / 360.f));
    __m256 h = _mm256_mul_ps(kFma ? _mm256_fmadd_ps(hh, rev, res) : _mm256_add_ps(_mm256_mul_ps(hh, rev), res), hsc);
    const __m256 v = mx;
    // adjust_hsv
    s = _mm256_mul_ps(s, dv.sat);
    s = _mm256_max_ps(dv.lo, s);  // s < lo ? lo : s
    s = _mm256_min_ps(dv.hi, s);  // s > hi ? hi : s
    h = _mm256_add_ps(h, dv.hue);
    h = _mm256_blendv_ps(h, _mm256_sub_ps(h, c360), _mm256_cmp_ps(h, c360, _CMP_GT_OQ));
    h = _mm256_blendv_ps(h, _mm256_add_ps(h, c360), _mm256_cmp_ps(h, _mm256_setzero_ps(), _CMP_LT_OQ));
    // hsv2rgb_simd
    h = _mm256_mul_ps(h, _mm256_set1_ps(6.f / 360.f));
    const __m256 pre = _mm256_cvtepi32_ps(_mm256_cvttps_epi32(h));
    h = _mm256_sub_ps(h, pre);
    const __m256 tab0 = v;
    const __m256 tab1 = _mm256_mul_ps(v, _mm256_sub_ps(one, s));
    const __m256 tab2 = _mm256_mul_ps(v, kContract ? _mm256_fnmadd_ps(s, h, one) : _mm256_sub_ps(one, _mm256_mul_ps(s, h)));
    const __m256 oneh = _mm256_sub_ps(one, h);
    const __m256 tab3 =
        _mm256_mul_ps(v, kContract ? _mm256_fnmadd_ps(s, oneh, one) : _mm256_sub_ps(one, _mm256_mul_ps(s, oneh)));
    __m256 sector = _mm256_cvtepi32_ps(_mm256_cvttps_epi32(_mm256_mul_ps(pre, _mm256_set1_ps(1.0f / 6.0f))));
    const __m256 six = _mm256_set1_ps(6.f);
    sector = kContract ? _mm256_fnmadd_ps(sector, six, pre) : _mm256_sub_ps(pre, _mm256_mul_ps(sector, six));
    auto eq = [&](float k) { return _mm256_cmp_ps(sector, _mm256_set1_ps(k), _CMP_EQ_OQ); };
    auto lt = [&](float k) { return _mm256_cmp_ps(sector, _mm256_set1_ps(k), _CMP_LT_OQ); };
    auto gt = [&](float k) { return _mm256_cmp_ps(sector, _mm256_set1_ps(k), _CMP_GT_OQ); };
    auto sel = [](__m256 t, __m256 m) { return _mm256_and_ps(t, m); };
    const __m256 e1 = eq(1.f), e2 = eq(2.f), e3 = eq(3.f), e4 = eq(4.f);
    b = _mm256_or_ps(_mm256_or_ps(_mm256_or_ps(sel(tab1, lt(2.f)), sel(tab3, e2)), _mm256_or_ps(sel(tab0, e3), sel(tab0, e4))),
                     sel(tab2, gt(4.f)));
    g = _mm256_or_ps(_mm256_or_ps(_mm256_or_ps(sel(tab3, lt(1.f)), sel(tab0, e1)), _mm256_or_ps(sel(tab0, e2), sel(tab2, e3))),
                     sel(tab1, gt(3.f)));
    r = _mm256_or_ps(_mm256_or_ps(_mm256_or_ps(sel(tab0, lt(1.f)), sel(tab2, e1)), _mm256_or_ps(sel(tab1, e2), sel(tab1, e3))),
                     _mm256_or_ps(sel(tab3, e4), sel(tab0, gt(4.f))));
    b = _mm256_mul_ps(b, dv.a1);
    g = _mm256_mul_ps(g, dv.a1);
    r = _mm256_mul_ps(r, dv.a1);
}

#ifdef LOONGKIT_AVX512
// The same in 16 lanes; blends of the 8-lane form become mask moves (the sector masks are
// disjoint, so "or of and-masked values" equals one masked move per sector, 0 when none holds).
template <bool kFma, bool kContract>
static inline void distort16(__m512& b, __m512& g, __m512& r, const DistortVec& dv) {
    const __m512 one = _mm512_set1_ps(1.f), c360 = _mm512_set1_ps(360.f), eps = _mm512_set1_ps(FLT_EPSILON);
    const __m512 delta = _mm512_broadcast_f32x8(dv.delta), a0 = _mm512_broadcast_f32x8(dv.a0);
    b = _mm512_mul_ps(_mm512_add_ps(b, delta), a0);
    g = _mm512_mul_ps(_mm512_add_ps(g, delta), a0);
    r = _mm512_mul_ps(_mm512_add_ps(r, delta), a0);
    const __m512 mn = _mm512_min_ps(_mm512_min_ps(r, g), b);
    const __m512 mx = _mm512_max_ps(_mm512_max_ps(r, g), b);
    const __m512 diff = _mm512_sub_ps(mx, mn);
    __m512 s = _mm512_div_ps(diff, _mm512_add_ps(_mm512_abs_ps(mx), eps));
    const __mmask16 req = _mm512_cmp_ps_mask(r, mx, _CMP_EQ_OQ), geq = _mm512_cmp_ps_mask(g, mx, _CMP_EQ_OQ);
    const __m512 hh = _mm512_mask_blend_ps(req, _mm512_mask_blend_ps(geq, _mm512_sub_ps(r, g), _mm512_sub_ps(b, r)),
                                           _mm512_sub_ps(g, b));
    const __m512 res = _mm512_mask_blend_ps(
        req, _mm512_mask_blend_ps(geq, _mm512_set1_ps(240.f), _mm512_set1_ps(120.f)),
        _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(g, b, _CMP_LT_OQ), c360));
    const __m512 rev = _mm512_div_ps(_mm512_set1_ps(60.f), _mm512_add_ps(diff, eps));
    const __m512 hsc = _mm512_set1_ps(360.f * (1.f / 360.f));
    __m512 h = _mm512_mul_ps(kFma ? _mm512_fmadd_ps(hh, rev, res) : _mm512_add_ps(_mm512_mul_ps(hh, rev), res), hsc);
    const __m512 v = mx;
    s = _mm512_mul_ps(s, _mm512_broadcast_f32x8(dv.sat));
    s = _mm512_max_ps(_mm512_broadcast_f32x8(dv.lo), s);
    s = _mm512_min_ps(_mm512_broadcast_f32x8(dv.hi), s);
    h = _mm512_add_ps(h, _mm512_broadcast_f32x8(dv.hue));
    h = _mm512_mask_sub_ps(h, _mm512_cmp_ps_mask(h, c360, _CMP_GT_OQ), h, c360);
    h = _mm512_mask_add_ps(h, _mm512_cmp_ps_mask(h, _mm512_setzero_ps(), _CMP_LT_OQ), h, c360);
    h = _mm512_mul_ps(h, _mm512_set1_ps(6.f / 360.f));
    const __m512 pre = _mm512_cvtepi32_ps(_mm512_cvttps_epi32(h));
    h = _mm512_sub_ps(h, pre);
    const __m512 tab0 = v;
    const __m512 tab1 = _mm512_mul_ps(v, _mm512_sub_ps(one, s));
    const __m512 tab2 = _mm512_mul_ps(v, kContract ? _mm512_fnmadd_ps(s, h, one) : _mm512_sub_ps(one, _mm512_mul_ps(s, h)));
    const __m512 oneh = _mm512_sub_ps(one, h);
    const __m512 tab3 =
        _mm512_mul_ps(v, kContract ? _mm512_fnmadd_ps(s, oneh, one) : _mm512_sub_ps(one, _mm512_mul_ps(s, oneh)));
    __m512 sector = _mm512_cvtepi32_ps(_mm512_cvttps_epi32(_mm512_mul_ps(pre, _mm512_set1_ps(1.0f / 6.0f))));
    const __m512 six = _mm512_set1_ps(6.f);
    sector = kContract ? _mm512_fnmadd_ps(sector, six, pre) : _mm512_sub_ps(pre, _mm512_mul_ps(sector, six));
    auto cmp = [&](float k, int op) { return _mm512_cmp_ps_mask(sector, _mm512_set1_ps(k), op); };
    const __mmask16 l1 = cmp(1.f, _CMP_LT_OQ), l2 = cmp(2.f, _CMP_LT_OQ), e1 = cmp(1.f, _CMP_EQ_OQ),
                    e2 = cmp(2.f, _CMP_EQ_OQ), e3 = cmp(3.f, _CMP_EQ_OQ), e4 = cmp(4.f, _CMP_EQ_OQ),
                    g3 = cmp(3.f, _CMP_GT_OQ), g4 = cmp(4.f, _CMP_GT_OQ);
    b = _mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_maskz_mov_ps(l2, tab1), e2, tab3),
                                              static_cast<__mmask16>(e3 | e4), tab0), g4, tab2);
    g = _mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_maskz_mov_ps(l1, tab3),
                                                                 static_cast<__mmask16>(e1 | e2), tab0), e3, tab2),
                           g3, tab1);
    r = _mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_maskz_mov_ps(l1, tab0), e1, tab2),
                                                                 static_cast<__mmask16>(e2 | e3), tab1), e4, tab3),
                           g4, tab0);
    const __m512 a1 = _mm512_broadcast_f32x8(dv.a1);
    b = _mm512_mul_ps(b, a1);
    g = _mm512_mul_ps(g, a1);
    r = _mm512_mul_ps(r, a1);
}
#endif

// Pixels [0, n) of a row, n a multiple of 8: one read of the source, one write of the result,
// channel permutation included.
template <typename T, bool kFma, bool kContract>
static inline void distort_blocks(const T* src, float* dst, std::ptrdiff_t n, const DistortVec& dv,
                                  const int perm[3]) {
    std::ptrdiff_t i = 0;
#ifdef LOONGKIT_AVX512
    const simd::Planar16& t = simd::planar16();
    for (; i + 16 <= n; i += 16) {
        __m512 c[3];
        simd::load3x16(src + 3 * i, t, c);
        distort16<kFma, kContract>(c[0], c[1], c[2], dv);
        simd::store3x16(dst + 3 * i, t, c[perm[0]], c[perm[1]], c[perm[2]]);
    }
#endif
    for (; i < n; i += 8) {
        __m256 c[3];
        simd::load3(src + 3 * i, *dv.u8, c[0], c[1], c[2]);
        distort8<kFma, kContract>(c[0], c[1], c[2], dv);
        simd::store3(dst + 3 * i, c[perm[0]], c[perm[1]], c[perm[2]]);
    }
}
#endif

// One row: src pixels are 3 adjacent values of T (row-contiguous), dst is float32 contiguous.
template <typename T, bool kFma, bool kSimdContract, bool kTailContract>
static void distort_row(const T* __restrict__ src, float* __restrict__ dst, std::ptrdiff_t width, int lanes,
                        bool overlap, const DistortParams& params) {
    const DistortParams p = params;  // a local copy: dst cannot alias it, so the loop vectorizes
    // Pixels are independent: a pixel OpenCV computes twice (the overlap) gets the same value twice.
    const std::ptrdiff_t nsimd = lanes <= 0 || width < lanes ? 0 : (overlap ? width : (width / lanes) * lanes);
    const float d = p.delta, a0 = p.alpha_pre, a1 = p.alpha_post;
    std::ptrdiff_t i0 = 0;
#ifdef LOONGKIT_AVX2
    i0 = (nsimd / 8) * 8;
    if (i0 > 0) {
        distort_blocks<T, kFma, kSimdContract>(src, dst, i0, distort_vec(p), p.perm);
    }
#endif
    for (std::ptrdiff_t i = i0; i < nsimd; ++i) {
        const float b0 = (static_cast<float>(src[3 * i + 0]) + d) * a0;
        const float g0 = (static_cast<float>(src[3 * i + 1]) + d) * a0;
        const float r0 = (static_cast<float>(src[3 * i + 2]) + d) * a0;
        float h, s, v, b, g, r;
        rgb2hsv_simd<kFma>(r0, g0, b0, h, s, v);
        adjust_hsv(h, s, p);
        hsv2rgb_simd<kSimdContract>(h, s, v, b, g, r);
        dst[3 * i + 0] = b * a1;
        dst[3 * i + 1] = g * a1;
        dst[3 * i + 2] = r * a1;
    }
    for (std::ptrdiff_t i = nsimd; i < width; ++i) {
        const float b0 = (static_cast<float>(src[3 * i + 0]) + d) * a0;
        const float g0 = (static_cast<float>(src[3 * i + 1]) + d) * a0;
        const float r0 = (static_cast<float>(src[3 * i + 2]) + d) * a0;
        float h, s, v, b, g, r;
        rgb2hsv_tail<kTailContract>(r0, g0, b0, h, s, v);
        adjust_hsv(h, s, p);
        hsv2rgb_tail<kTailContract>(h, s, v, b, g, r);
        dst[3 * i + 0] = b * a1;
        dst[3 * i + 1] = g * a1;
        dst[3 * i + 2] = r * a1;
    }
    if (p.perm[0] != 0 || p.perm[1] != 1 || p.perm[2] != 2) permute_row(dst + 3 * i0, width - i0, p.perm);
}

using RowFn = void (*)(const void*, float*, std::ptrdiff_t, int, bool, const DistortParams&);

template <typename T, bool A, bool B, bool C>
static void row_thunk(const void* s, float* d, std::ptrdiff_t w, int lanes, bool overlap, const DistortParams& p) {
    distort_row<T, A, B, C>(static_cast<const T*>(s), d, w, lanes, overlap, p);
}

template <typename T>
static RowFn pick_row(const HsvMode& m) {
    const int k = (m.simd_fma ? 4 : 0) | (m.simd_contract ? 2 : 0) | (m.tail_contract ? 1 : 0);
    switch (k) {
        case 0: return row_thunk<T, false, false, false>;
        case 1: return row_thunk<T, false, false, true>;
        case 2: return row_thunk<T, false, true, false>;
        case 3: return row_thunk<T, false, true, true>;
        case 4: return row_thunk<T, true, false, false>;
        case 5: return row_thunk<T, true, false, true>;
        case 6: return row_thunk<T, true, true, false>;
        default: return row_thunk<T, true, true, true>;
    }
}

// Float inputs holding -0, inf, NaN or huge values would break the neutral-step identities or
// OpenCV's NaN-order semantics: the caller sends those images to upstream.
static inline bool float_row_plain(const float* src, std::ptrdiff_t n) {
    bool ok = true;
    for (std::ptrdiff_t i = 0; i < n; ++i) {
        const float x = src[i];
        ok &= (std::fabs(x) < 1e30f) & !(x == 0.f && std::signbit(x));
    }
    return ok;
}

}  // namespace loongkit::LK_ISA
