// Deformable aggregation (Sparse4D / SparseDrive `deformable_aggregation`) on the CPU.
//
// out[b, a, c] = sum over points p, cameras k, levels l of
//                weights[b, a, p, k, l, c / (C/G)] * bilinear(feat of camera k level l, loc[b, a, p, k])[c]
// mc_ms_feat [bs, NF, C] holds every (camera, level) map row-major from scale_start_index[k, l];
// spatial_shape [cams, L, 2] is (H, W). Pixel coordinate of u on an axis of size S is u*S - 0.5
// and corners outside the map read zero (align_corners=False, zero padding).
//
// inside_only: the upstream CUDA kernel's rule, a sample whose x or y is not strictly inside (0, 1)
// (NaN included) contributes nothing at all. Without it the maths is grid_sample's (every corner
// checked on its own), which is what DeformableFeatureAggregation computes without the CUDA op.
//
// Forward: one task per (batch, anchor), writing its own output row only; channel loops per group
// are unit stride (`omp simd`).
// Backward: grad_feat is a scatter shared by all anchors, but channels are independent, so a task
// owns (batch, channel chunk): the chunks are the weight groups (split further when bs*G alone
// leaves threads idle). No atomics, no private copies of the features. The per-sample scalars
// (dot products for grad_weights and grad_loc) are partial over a chunk; they go to a small
// [bs, chunks, samples, L, 3] buffer and are summed in chunk order afterwards (deterministic for a
// thread count).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "bilinear.h"
#include "kernels.h"

namespace loongkit::LK_ISA {
namespace {

struct DafDims {
    int64_t bs, NF, C, A, P, K, L, G;
};


template <typename T>
inline bool strictly_inside(T x, T y) {
    return x > T(0) && x < T(1) && y > T(0) && y < T(1);  // false for NaN
}

DafDims check_daf(const View& feat, const View& shapes, const View& starts, const View& loc,
              const View& w) {
    LK_CHECK(feat.dim() == 3 && feat.is_contiguous(), "mc_ms_feat must be contiguous [bs, num_feat, C]");
    LK_CHECK(loc.dim() == 5 && loc.size(4) == 2 && loc.is_contiguous(), "bad sampling_location");
    LK_CHECK(w.dim() == 6 && w.is_contiguous(), "bad weights");
    LK_CHECK(loc.scalar_type() == feat.scalar_type() && w.scalar_type() == feat.scalar_type(), "dtypes differ");
    DafDims d{feat.size(0), feat.size(1), feat.size(2), loc.size(1), loc.size(2), loc.size(3), w.size(4), w.size(5)};
    LK_CHECK(loc.size(0) == d.bs, "sampling_location batch");
    LK_CHECK(w.size(0) == d.bs && w.size(1) == d.A && w.size(2) == d.P && w.size(3) == d.K, "weights shape");
    LK_CHECK(d.G > 0 && d.C % d.G == 0, "channels must split evenly into the weight groups");
    LK_CHECK(shapes.scalar_type() == lk::kLong && shapes.is_contiguous() && shapes.dim() == 3 &&
                    shapes.size(0) == d.K && shapes.size(1) == d.L && shapes.size(2) == 2,
                "spatial_shape must be int64 [cams, levels, 2]");
    LK_CHECK(starts.scalar_type() == lk::kLong && starts.is_contiguous() && starts.numel() == d.K * d.L,
                "scale_start_index must be int64 [cams, levels]");
    const int64_t* s = shapes.data_ptr<int64_t>();
    const int64_t* st = starts.data_ptr<int64_t>();
    for (int64_t i = 0; i < d.K * d.L; ++i) {
        LK_CHECK(s[2 * i] >= 0 && s[2 * i + 1] >= 0 && st[i] >= 0 && st[i] + s[2 * i] * s[2 * i + 1] <= d.NF,
                    "map ", i, " lies outside mc_ms_feat");
    }
    return d;
}

template <typename T>
void forward_impl(const DafDims& d, const T* __restrict feat, const int64_t* shapes, const int64_t* starts,
                  const T* __restrict loc, const T* __restrict wts, bool inside_only, T* __restrict out) {
    const int64_t C = d.C, gd = d.C / d.G;
    const std::vector<T> zero(static_cast<size_t>(C), T(0));
    lk::parallel_for(0, d.bs * d.A, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
        const T* fb = feat + (i / d.A) * d.NF * C;
        T* __restrict o = out + i * C;
        std::fill(o, o + C, T(0));
        for (int64_t pk = 0; pk < d.P * d.K; ++pk) {
            const int64_t s = i * d.P * d.K + pk, k = pk % d.K;
            const T x = loc[2 * s], y = loc[2 * s + 1];
            if (inside_only && !strictly_inside(x, y)) continue;
            for (int64_t l = 0; l < d.L; ++l) {
                const int64_t kl = k * d.L + l;
                const Corners<T> cs = corners<T>(x, y, shapes[2 * kl], shapes[2 * kl + 1]);
                if (!cs.any) continue;
                const T* fm = fb + starts[kl] * C;
                const T* v[4];
                for (int q = 0; q < 4; ++q) v[q] = cs.off[q] >= 0 ? fm + cs.off[q] * C : zero.data();
                const T* wl = wts + (s * d.L + l) * d.G;
                for (int64_t g = 0; g < d.G; ++g) {
                    const T a = wl[g];
                    const T w0 = a * cs.w[0], w1 = a * cs.w[1], w2 = a * cs.w[2], w3 = a * cs.w[3];
                    const T* __restrict v0 = v[0] + g * gd;
                    const T* __restrict v1 = v[1] + g * gd;
                    const T* __restrict v2 = v[2] + g * gd;
                    const T* __restrict v3 = v[3] + g * gd;
                    T* __restrict og = o + g * gd;
#pragma omp simd
                    for (int64_t c = 0; c < gd; ++c) og[c] += w0 * v0[c] + w1 * v1[c] + w2 * v2[c] + w3 * v3[c];
                }
            }
        }
    }
    });
}

template <typename T>
void backward_impl(const DafDims& d, const T* __restrict feat, const int64_t* shapes, const int64_t* starts,
                   const T* __restrict loc, const T* __restrict wts, bool inside_only, const T* __restrict gout,
                   T* __restrict gfeat, T* __restrict gloc, T* __restrict gw) {
    const int64_t C = d.C, gd = d.C / d.G, samples = d.A * d.P * d.K;
    // Split each group into `sub` chunks while batch*groups alone leaves threads idle.
    const int64_t threads = std::max<int64_t>(1, lk::num_threads());
    int64_t sub = 1;
    while (d.bs * d.G * sub < threads && gd % (2 * sub) == 0 && gd / (2 * sub) >= 8) sub *= 2;
    const int64_t chunks = d.G * sub, cw = gd / sub;
    // part[b][chunk][sample][l] = (grad_out . sample, d/dx, d/dy) over the chunk's channels.
    std::vector<T> part(static_cast<size_t>(d.bs * chunks * samples * d.L * 3));
    lk::parallel_for(0, d.bs * chunks, 1, [&](int64_t begin, int64_t end) {
    // Corners outside the map read a zero row and scatter into a scratch row: one branch-free pass.
    std::vector<T> zero(static_cast<size_t>(cw), T(0)), dump(static_cast<size_t>(cw));
    for (int64_t t = begin; t < end; ++t) {
        const int64_t b = t / chunks, ch = t % chunks, g = ch / sub, c_lo = ch * cw;
        const T* fb = feat + b * d.NF * C + c_lo;
        T* gb = gfeat + b * d.NF * C + c_lo;
        T* pb = part.data() + t * samples * d.L * 3;
        for (int64_t si = 0; si < samples; ++si) {
            const int64_t s = b * samples + si, k = si % d.K, a = si / (d.P * d.K);
            const T x = loc[2 * s], y = loc[2 * s + 1];
            T* pe = pb + si * d.L * 3;
            if (inside_only && !strictly_inside(x, y)) {
                std::fill(pe, pe + d.L * 3, T(0));
                continue;
            }
            const T* __restrict go = gout + (b * d.A + a) * C + c_lo;
            for (int64_t l = 0; l < d.L; ++l, pe += 3) {
                const int64_t kl = k * d.L + l;
                const int64_t Hl = shapes[2 * kl], Wl = shapes[2 * kl + 1];
                const Corners<T> cs = corners<T>(x, y, Hl, Wl);
                if (!cs.any) {
                    pe[0] = pe[1] = pe[2] = T(0);
                    continue;
                }
                const T wg = wts[(s * d.L + l) * d.G + g];
                const T* vp[4];
                T* gp[4];
                for (int q = 0; q < 4; ++q) {
                    vp[q] = cs.off[q] >= 0 ? fb + (starts[kl] + cs.off[q]) * C : zero.data();
                    gp[q] = cs.off[q] >= 0 ? gb + (starts[kl] + cs.off[q]) * C : dump.data();
                }
                T sa, sw, sh;
                corners_backward<T>(cs, vp, gp, go, cw, wg, sa, sw, sh);
                pe[0] = sa;
                pe[1] = wg * static_cast<T>(Wl) * sw;
                pe[2] = wg * static_cast<T>(Hl) * sh;
            }
        }
    }
    });
    // Reduce the chunk partials in a fixed order.
    lk::parallel_for(0, d.bs * samples, 256, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
        const int64_t b = s / samples, si = s % samples;
        T dx = T(0), dy = T(0);
        T* gws = gw + s * d.L * d.G;
        std::fill(gws, gws + d.L * d.G, T(0));
        for (int64_t ch = 0; ch < chunks; ++ch) {
            const T* pe = part.data() + ((b * chunks + ch) * samples + si) * d.L * 3;
            for (int64_t l = 0; l < d.L; ++l) {
                gws[l * d.G + ch / sub] += pe[3 * l];
                dx += pe[3 * l + 1];
                dy += pe[3 * l + 2];
            }
        }
        gloc[2 * s] = dx;
        gloc[2 * s + 1] = dy;
    }
    });
}

}  // namespace

void daf_forward(const View& mc_ms_feat, const View& spatial_shape, const View& scale_start,
                 const View& loc, const View& weights, bool inside_only, const View& out) {
    const DafDims d = check_daf(mc_ms_feat, spatial_shape, scale_start, loc, weights);
    LK_CHECK(out.is_contiguous() && out.numel() == d.bs * d.A * d.C && out.scalar_type() == mc_ms_feat.scalar_type(),
                "bad output");
    LK_DISPATCH_FLOATING_TYPES(mc_ms_feat.scalar_type(), "loongkit_daf_forward", [&] {
        forward_impl<scalar_t>(d, mc_ms_feat.data_ptr<scalar_t>(), spatial_shape.data_ptr<int64_t>(),
                               scale_start.data_ptr<int64_t>(), loc.data_ptr<scalar_t>(), weights.data_ptr<scalar_t>(),
                               inside_only, out.data_ptr<scalar_t>());
    });
}

void daf_backward(const View& mc_ms_feat, const View& spatial_shape, const View& scale_start,
                  const View& loc, const View& weights, bool inside_only, const View& grad_out,
                  const View& grad_feat, const View& grad_loc, const View& grad_weights) {
    const DafDims d = check_daf(mc_ms_feat, spatial_shape, scale_start, loc, weights);
    const auto dtype = mc_ms_feat.scalar_type();
    LK_CHECK(grad_out.is_contiguous() && grad_out.numel() == d.bs * d.A * d.C && grad_out.scalar_type() == dtype,
                "bad grad_output");
    LK_CHECK(grad_feat.is_contiguous() && grad_feat.sizes() == mc_ms_feat.sizes() && grad_feat.scalar_type() == dtype,
                "bad grad_mc_ms_feat");
    LK_CHECK(grad_loc.is_contiguous() && grad_loc.sizes() == loc.sizes() && grad_loc.scalar_type() == dtype,
                "bad grad_sampling_location");
    LK_CHECK(grad_weights.is_contiguous() && grad_weights.sizes() == weights.sizes() &&
                    grad_weights.scalar_type() == dtype, "bad grad_weights");
    LK_DISPATCH_FLOATING_TYPES(dtype, "loongkit_daf_backward", [&] {
        backward_impl<scalar_t>(d, mc_ms_feat.data_ptr<scalar_t>(), spatial_shape.data_ptr<int64_t>(),
                                scale_start.data_ptr<int64_t>(), loc.data_ptr<scalar_t>(),
                                weights.data_ptr<scalar_t>(), inside_only, grad_out.data_ptr<scalar_t>(),
                                grad_feat.data_ptr<scalar_t>(), grad_loc.data_ptr<scalar_t>(),
                                grad_weights.data_ptr<scalar_t>());
    });
}

}  // namespace loongkit::LK_ISA
