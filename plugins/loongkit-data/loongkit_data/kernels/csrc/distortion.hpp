// Bit-exact mmdet PhotoMetricDistortion pixel arithmetic, fused into one pass per image.
//
// Upstream (per image): astype(float32); += delta; *= alpha (contrast first); cv2.cvtColor
// BGR2HSV (float); s *= sat, clip to [0, 1]; h += hue, wrap into [0, 360]; cv2.cvtColor HSV2BGR;
// *= alpha (contrast last); channel permutation. Every step is float32 arithmetic; "off" steps are
// passed as neutral values (x + 0, x * 1), which are exact identities for the values that reach
// them (the Python side sends float inputs holding -0, inf or NaN to upstream).
//
// OpenCV's float HSV conversions run a SIMD body over the first (width / lanes) * lanes pixels of
// each row and a scalar loop over the rest, with different formulas (division in float vs double,
// truncating vs flooring sector selection, explicit or compiler-contracted fused multiply-adds).
// Both are reproduced operation by operation; which lane count and which contractions the
// installed OpenCV build uses on this CPU is a runtime HsvMode, chosen by calibrating against
// cv2 itself (see loongkit_data/distortion.py). The file is compiled with -ffp-contract=off, so the
// only fused operations are the std::fma calls below.
#pragma once

#include <pybind11/pybind11.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>

namespace loongkit {

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

// One row: src pixels are 3 adjacent values of T (row-contiguous), dst is float32 contiguous.
template <typename T, bool kFma, bool kSimdContract, bool kTailContract>
static void distort_row(const T* __restrict__ src, float* __restrict__ dst, std::ptrdiff_t width, int lanes,
                        const DistortParams& params) {
    const DistortParams p = params;  // a local copy: dst cannot alias it, so the loop vectorizes
    const std::ptrdiff_t nsimd = lanes > 0 ? (width / lanes) * lanes : 0;
    const float d = p.delta, a0 = p.alpha_pre, a1 = p.alpha_post;
    for (std::ptrdiff_t i = 0; i < nsimd; ++i) {
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
    if (p.perm[0] != 0 || p.perm[1] != 1 || p.perm[2] != 2) permute_row(dst, width, p.perm);
}

using RowFn = void (*)(const void*, float*, std::ptrdiff_t, int, const DistortParams&);

template <typename T, bool A, bool B, bool C>
static void row_thunk(const void* s, float* d, std::ptrdiff_t w, int lanes, const DistortParams& p) {
    distort_row<T, A, B, C>(static_cast<const T*>(s), d, w, lanes, p);
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

void register_distortion(pybind11::module_& m);

}  // namespace loongkit
