// Bilinear sampling with grid_sample's conventions (align_corners=False, zero padding), shared by the
// deformable attention (msda.cpp) and deformable aggregation (daf.cpp) kernels: the pixel coordinate of
// a location u in [0, 1] on an axis of size S is u*S - 0.5; corners outside the map read zero.
#pragma once

#include <cmath>
#include <cstdint>

namespace loongkit::LK_ISA {

// The four corners of one sample: offsets of valid corners (-1 if outside) and their weights.
template <typename T>
struct Corners {
    int64_t off[4];  // pixel index within the map, or -1
    T w[4];          // (top-left, top-right, bottom-left, bottom-right)
    T lh, lw;        // fractional parts, for the location gradient
    bool any;
};

template <typename T>
inline Corners<T> corners(T x, T y, int64_t Hl, int64_t Wl) {
    Corners<T> c;
    const T w_im = x * static_cast<T>(Wl) - T(0.5);
    const T h_im = y * static_cast<T>(Hl) - T(0.5);
    // Outside (-2, S+1) no corner can be valid; the negated test also rejects NaN before the casts.
    if (!(h_im > T(-2) && w_im > T(-2) && h_im < static_cast<T>(Hl + 1) && w_im < static_cast<T>(Wl + 1))) {
        c.any = false;
        return c;
    }
    const T hf = std::floor(h_im), wf = std::floor(w_im);
    const int64_t h0 = static_cast<int64_t>(hf), w0 = static_cast<int64_t>(wf);
    const int64_t h1 = h0 + 1, w1 = w0 + 1;
    c.lh = h_im - hf;
    c.lw = w_im - wf;
    const T hh = T(1) - c.lh, hw = T(1) - c.lw;
    const bool vh0 = h0 >= 0 && h0 < Hl, vh1 = h1 >= 0 && h1 < Hl;
    const bool vw0 = w0 >= 0 && w0 < Wl, vw1 = w1 >= 0 && w1 < Wl;
    c.off[0] = (vh0 && vw0) ? h0 * Wl + w0 : -1;
    c.off[1] = (vh0 && vw1) ? h0 * Wl + w1 : -1;
    c.off[2] = (vh1 && vw0) ? h1 * Wl + w0 : -1;
    c.off[3] = (vh1 && vw1) ? h1 * Wl + w1 : -1;
    c.w[0] = hh * hw;
    c.w[1] = hh * c.lw;
    c.w[2] = c.lh * hw;
    c.w[3] = c.lh * c.lw;
    c.any = c.off[0] >= 0 || c.off[1] >= 0 || c.off[2] >= 0 || c.off[3] >= 0;
    return c;
}

// Backward of one sample over n channels: accumulates a * w[q] * grad into the four corner rows gp[q]
// and returns grad . sample (sa) and grad . d(sample)/d(w_im), d(sample)/d(h_im) (sw, sh). Invalid
// corners point at a zero row (vp) and a discarded scratch row (gp): valid corners are distinct pixels,
// so only the scratch row can repeat, and the loop is safe to vectorise.
template <typename T>
inline void corners_backward(const Corners<T>& cs, const T* const vp[4], T* const gp[4], const T* go, int64_t n,
                             T a, T& sa, T& sw, T& sh) {
    const T* __restrict v0 = vp[0];
    const T* __restrict v1 = vp[1];
    const T* __restrict v2 = vp[2];
    const T* __restrict v3 = vp[3];
    T* g0 = gp[0];
    T* g1 = gp[1];
    T* g2 = gp[2];
    T* g3 = gp[3];
    const T hh = T(1) - cs.lh, hw = T(1) - cs.lw;
    const T w0 = cs.w[0], w1 = cs.w[1], w2 = cs.w[2], w3 = cs.w[3];
    const T aw0 = a * w0, aw1 = a * w1, aw2 = a * w2, aw3 = a * w3;
    T ra = T(0), rw = T(0), rh = T(0);
#pragma omp simd reduction(+ : ra, rw, rh)
    for (int64_t c = 0; c < n; ++c) {
        const T gc = go[c];
        const T x0 = v0[c], x1 = v1[c], x2 = v2[c], x3 = v3[c];
        ra += gc * (w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3);
        rw += gc * (hh * (x1 - x0) + cs.lh * (x3 - x2));
        rh += gc * (hw * (x2 - x0) + cs.lw * (x3 - x1));
        g0[c] += aw0 * gc;
        g1[c] += aw1 * gc;
        g2[c] += aw2 * gc;
        g3[c] += aw3 * gc;
    }
    sa = ra;
    sw = rw;
    sh = rh;
}

}  // namespace loongkit::LK_ISA
