// Multi-scale deformable attention on the CPU (forward and backward).
//
// Threads: at::parallel_for (compiled with -fopenmp, it is torch's OpenMP parallel region: the same
// libgomp, which the loader shares by soname, and torch.set_num_threads applies); inner loops are
// `omp simd`.
//
// Semantics: bilinear sampling with zero padding and align_corners=False, i.e. the pixel coordinate
// of a location u in [0, 1] on an axis of size S is u*S - 0.5 (grid_sample's convention with
// grid = 2u - 1). Every one of the four corners is checked on its own, exactly like grid_sample, so
// the gradient of a location whose sample straddles the border matches the pytorch path.
//
// Layout: value [bs, K, heads, C] -> one (key, head) row is C contiguous elements, so every inner
// loop runs over C with unit stride (vectorised by the compiler, `omp simd`).
//
// Forward: one task per (batch, query, head); each writes only its own output row: no races.
// Backward: grad_value is a scatter (many queries sample the same pixels). Atomics on CPU floats are
// CAS loops (slow, and the summation order would change run to run), so the work is split by
// ownership instead: a task owns one (batch, head) slice of grad_value and a contiguous range of
// queries. When bs*heads alone gives every thread a task, tasks write straight into grad_value; when
// not, queries are split S ways and each split accumulates into a private [K, C] buffer that is
// reduced in split order afterwards. Either way the result is deterministic for a thread count,
// and the extra memory (S-1 copies of value at most) is bounded below.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "bilinear.h"
#include "kernels.h"

namespace loongkit {
namespace {

struct Dims {
    int64_t bs, K, H, C, Lq, L, P;
};

using loongkit::Corners;
using loongkit::corners;
using loongkit::corners_backward;

Dims check(const at::Tensor& value, const at::Tensor& shapes, const at::Tensor& starts, const at::Tensor& loc,
           const at::Tensor& attn) {
    TORCH_CHECK(value.dim() == 4 && value.is_contiguous(), "value must be contiguous [bs, K, heads, C]");
    TORCH_CHECK(loc.dim() == 6 && loc.size(5) == 2 && loc.is_contiguous(), "bad sampling_locations");
    TORCH_CHECK(attn.dim() == 5 && attn.is_contiguous(), "bad attention_weights");
    TORCH_CHECK(loc.scalar_type() == value.scalar_type() && attn.scalar_type() == value.scalar_type(),
                "dtypes differ");
    Dims d{value.size(0), value.size(1), value.size(2), value.size(3), loc.size(1), loc.size(3), loc.size(4)};
    TORCH_CHECK(loc.size(0) == d.bs && loc.size(2) == d.H, "sampling_locations shape");
    TORCH_CHECK(attn.size(0) == d.bs && attn.size(1) == d.Lq && attn.size(2) == d.H && attn.size(3) == d.L &&
                    attn.size(4) == d.P, "attention_weights shape");
    TORCH_CHECK(shapes.scalar_type() == at::kLong && shapes.is_contiguous() && shapes.dim() == 2 &&
                    shapes.size(0) == d.L && shapes.size(1) == 2, "spatial_shapes must be int64 [L, 2]");
    TORCH_CHECK(starts.scalar_type() == at::kLong && starts.is_contiguous() && starts.numel() == d.L,
                "level_start_index must be int64 [L]");
    const int64_t* s = shapes.data_ptr<int64_t>();
    const int64_t* st = starts.data_ptr<int64_t>();
    for (int64_t l = 0; l < d.L; ++l) {
        TORCH_CHECK(s[2 * l] >= 0 && s[2 * l + 1] >= 0 && st[l] >= 0 && st[l] + s[2 * l] * s[2 * l + 1] <= d.K,
                    "level ", l, " lies outside value");
    }
    return d;
}

template <typename T>
void forward_impl(const Dims& d, const T* __restrict value, const int64_t* shapes, const int64_t* starts,
                  const T* __restrict loc, const T* __restrict attn, T* __restrict out) {
    const int64_t tasks = d.bs * d.Lq * d.H, C = d.C, rowstride = d.H * d.C;
    const std::vector<T> zero(static_cast<size_t>(C), T(0));  // stands in for corners outside the map
    at::parallel_for(0, tasks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / (d.Lq * d.H), h = i % d.H;
        const T* vb = value + b * d.K * rowstride + h * C;
        const T* li = loc + i * d.L * d.P * 2;
        const T* ai = attn + i * d.L * d.P;
        T* __restrict o = out + i * C;
        std::fill(o, o + C, T(0));
        for (int64_t l = 0; l < d.L; ++l) {
            const int64_t Hl = shapes[2 * l], Wl = shapes[2 * l + 1];
            const T* vl = vb + starts[l] * rowstride;
            for (int64_t p = 0; p < d.P; ++p) {
                const int64_t lp = l * d.P + p;
                const Corners<T> cs = corners<T>(li[2 * lp], li[2 * lp + 1], Hl, Wl);
                if (!cs.any) continue;
                const T a = ai[lp];
                // One branch-free pass over C for the four corners (an invalid one reads zeros).
                const T* __restrict v0 = cs.off[0] >= 0 ? vl + cs.off[0] * rowstride : zero.data();
                const T* __restrict v1 = cs.off[1] >= 0 ? vl + cs.off[1] * rowstride : zero.data();
                const T* __restrict v2 = cs.off[2] >= 0 ? vl + cs.off[2] * rowstride : zero.data();
                const T* __restrict v3 = cs.off[3] >= 0 ? vl + cs.off[3] * rowstride : zero.data();
                const T w0 = a * cs.w[0], w1 = a * cs.w[1], w2 = a * cs.w[2], w3 = a * cs.w[3];
#pragma omp simd
                for (int64_t c = 0; c < C; ++c) o[c] += w0 * v0[c] + w1 * v1[c] + w2 * v2[c] + w3 * v3[c];
            }
        }
    }
    });
}

template <typename T>
void backward_impl(const Dims& d, const T* __restrict value, const int64_t* shapes, const int64_t* starts,
                   const T* __restrict loc, const T* __restrict attn, const T* __restrict gout,
                   T* __restrict gvalue, T* __restrict gloc, T* __restrict gattn) {
    const int64_t C = d.C, rowstride = d.H * d.C, slices = d.bs * d.H;
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    int64_t splits = std::min<int64_t>(std::max<int64_t>(1, (threads + slices - 1) / slices), std::max<int64_t>(1, d.Lq));
    // Private buffers cost (splits - 1) x value; cap them at 1 GiB beyond value itself.
    const int64_t value_bytes = std::max<int64_t>(1, d.bs * d.K * rowstride * static_cast<int64_t>(sizeof(T)));
    splits = std::max<int64_t>(1, std::min<int64_t>(splits, 1 + (int64_t(1) << 30) / value_bytes));
    std::vector<T> priv;
    if (splits > 1) priv.assign(static_cast<size_t>(slices * splits * d.K * C), T(0));
    const int64_t tasks = slices * splits;
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    // Corners outside the map read a zero row and scatter into a scratch row: one branch-free pass.
    std::vector<T> zero(static_cast<size_t>(C), T(0)), dump(static_cast<size_t>(C));
    for (int64_t t = begin; t < end; ++t) {
        const int64_t slice = t / splits, s = t % splits;
        const int64_t b = slice / d.H, h = slice % d.H;
        const int64_t q_lo = d.Lq * s / splits, q_hi = d.Lq * (s + 1) / splits;
        const T* vb = value + b * d.K * rowstride + h * C;
        // Where this task accumulates grad_value: the real slice (stride heads*C) or its private buffer.
        T* gb = splits > 1 ? priv.data() + t * d.K * C : gvalue + b * d.K * rowstride + h * C;
        const int64_t gstride = splits > 1 ? C : rowstride;
        for (int64_t q = q_lo; q < q_hi; ++q) {
            const int64_t i = (b * d.Lq + q) * d.H + h;
            const T* li = loc + i * d.L * d.P * 2;
            const T* ai = attn + i * d.L * d.P;
            const T* __restrict g = gout + i * C;
            T* gl = gloc + i * d.L * d.P * 2;
            T* ga = gattn + i * d.L * d.P;
            for (int64_t l = 0; l < d.L; ++l) {
                const int64_t Hl = shapes[2 * l], Wl = shapes[2 * l + 1];
                const T* vl = vb + starts[l] * rowstride;
                T* gvl = gb + starts[l] * gstride;
                for (int64_t p = 0; p < d.P; ++p) {
                    const int64_t lp = l * d.P + p;
                    const Corners<T> cs = corners<T>(li[2 * lp], li[2 * lp + 1], Hl, Wl);
                    if (!cs.any) {
                        gl[2 * lp] = gl[2 * lp + 1] = ga[lp] = T(0);
                        continue;
                    }
                    const T a = ai[lp];
                    const T* vp[4];
                    T* gp[4];
                    for (int k = 0; k < 4; ++k) {
                        vp[k] = cs.off[k] >= 0 ? vl + cs.off[k] * rowstride : zero.data();
                        gp[k] = cs.off[k] >= 0 ? gvl + cs.off[k] * gstride : dump.data();
                    }
                    T sa, sw, sh;
                    corners_backward<T>(cs, vp, gp, g, C, a, sa, sw, sh);
                    ga[lp] = sa;
                    gl[2 * lp] = a * static_cast<T>(Wl) * sw;
                    gl[2 * lp + 1] = a * static_cast<T>(Hl) * sh;
                }
            }
        }
    }
    });
    if (splits > 1) {
        // Fixed split order: the sum does not depend on which thread ran which split.
        const int64_t rows = d.bs * d.K * d.H;
        at::parallel_for(0, rows, 16, [&](int64_t r_begin, int64_t r_end) {
        for (int64_t r = r_begin; r < r_end; ++r) {
            const int64_t b = r / (d.K * d.H), k = (r / d.H) % d.K, h = r % d.H;
            T* __restrict dst = gvalue + r * C;
            for (int64_t s = 0; s < splits; ++s) {
                const T* __restrict src = priv.data() + (((b * d.H + h) * splits + s) * d.K + k) * C;
#pragma omp simd
                for (int64_t c = 0; c < C; ++c) dst[c] += src[c];
            }
        }
        });
    }
}

}  // namespace

void msda_forward(const at::Tensor& value, const at::Tensor& spatial_shapes, const at::Tensor& level_start,
                  const at::Tensor& loc, const at::Tensor& attn, at::Tensor& out) {
    const Dims d = check(value, spatial_shapes, level_start, loc, attn);
    TORCH_CHECK(out.is_contiguous() && out.numel() == d.bs * d.Lq * d.H * d.C &&
                    out.scalar_type() == value.scalar_type(), "bad output");
    AT_DISPATCH_FLOATING_TYPES(value.scalar_type(), "loongkit_msda_forward", [&] {
        forward_impl<scalar_t>(d, value.data_ptr<scalar_t>(), spatial_shapes.data_ptr<int64_t>(),
                               level_start.data_ptr<int64_t>(), loc.data_ptr<scalar_t>(), attn.data_ptr<scalar_t>(),
                               out.data_ptr<scalar_t>());
    });
}

void msda_backward(const at::Tensor& value, const at::Tensor& spatial_shapes, const at::Tensor& level_start,
                   const at::Tensor& loc, const at::Tensor& attn, const at::Tensor& grad_out,
                   at::Tensor& grad_value, at::Tensor& grad_loc, at::Tensor& grad_attn) {
    const Dims d = check(value, spatial_shapes, level_start, loc, attn);
    TORCH_CHECK(grad_out.is_contiguous() && grad_out.numel() == d.bs * d.Lq * d.H * d.C &&
                    grad_out.scalar_type() == value.scalar_type(), "bad grad_output");
    TORCH_CHECK(grad_value.is_contiguous() && grad_value.sizes() == value.sizes() &&
                    grad_value.scalar_type() == value.scalar_type(), "bad grad_value");
    TORCH_CHECK(grad_loc.is_contiguous() && grad_loc.sizes() == loc.sizes() &&
                    grad_loc.scalar_type() == value.scalar_type(), "bad grad_loc");
    TORCH_CHECK(grad_attn.is_contiguous() && grad_attn.sizes() == attn.sizes() &&
                    grad_attn.scalar_type() == value.scalar_type(), "bad grad_attn");
    AT_DISPATCH_FLOATING_TYPES(value.scalar_type(), "loongkit_msda_backward", [&] {
        backward_impl<scalar_t>(d, value.data_ptr<scalar_t>(), spatial_shapes.data_ptr<int64_t>(),
                                level_start.data_ptr<int64_t>(), loc.data_ptr<scalar_t>(), attn.data_ptr<scalar_t>(),
                                grad_out.data_ptr<scalar_t>(), grad_value.data_ptr<scalar_t>(),
                                grad_loc.data_ptr<scalar_t>(), grad_attn.data_ptr<scalar_t>());
    });
}

}  // namespace loongkit
