// BEV pooling (BEVFusion `bev_pool`) on the CPU: per-voxel sums of point features.
//
// feats [N, C], coords [N, 4] int64 as (x, y, z, batch); the sum of every point's features in voxel
// (b, z, x, y) is written to a channel-last buffer out [B, Z, X, Y, C] (the caller permutes it to
// BEVFusion's [B, C, Z, X, Y]: channel-last keeps each point's C values one contiguous row, where
// the channel-first layout would scatter them Z*X*Y apart). Points whose coordinates fall outside
// the grid contribute nothing (BEVFusion filters them before the call; here they are simply dropped).
//
// No sort and no atomics: points are bucketed by voxel range (one bucket per thread) with a
// counting pass, and each bucket's owner adds its points in increasing point order. Every voxel's
// sum is therefore taken in point order, whatever the thread count: deterministic. The backward is a
// gather of the voxel's gradient row (grad_out given channel-last too).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace loongkit {
namespace {

struct Grid {
    int64_t B, Z, X, Y;
    int64_t voxel(const int64_t* c) const {
        const int64_t x = c[0], y = c[1], z = c[2], b = c[3];
        if (x < 0 || x >= X || y < 0 || y >= Y || z < 0 || z >= Z || b < 0 || b >= B) return -1;
        return ((b * Z + z) * X + x) * Y + y;
    }
};

void check(const at::Tensor& feats, const at::Tensor& coords) {
    TORCH_CHECK(feats.dim() == 2 && feats.is_contiguous(), "feats must be contiguous [N, C]");
    TORCH_CHECK(coords.dim() == 2 && coords.size(1) == 4 && coords.size(0) == feats.size(0) &&
                    coords.scalar_type() == at::kLong && coords.is_contiguous(),
                "coords must be contiguous int64 [N, 4]");
}

// Voxel index of every point (-1: dropped) and the points of each of `buckets` voxel ranges, in
// point order: order[start[k]:start[k+1]].
void bucket(const int64_t* coords, int64_t n, const Grid& g, int64_t buckets, std::vector<int64_t>& vox,
            std::vector<int64_t>& start, std::vector<int64_t>& order) {
    const int64_t V = g.B * g.Z * g.X * g.Y;
    vox.resize(static_cast<size_t>(n));
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(buckets * 4, (n + 4095) / 4096));
    std::vector<int64_t> count(static_cast<size_t>(chunks * buckets), 0);
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ch = begin; ch < end; ++ch) {
        int64_t* cnt = count.data() + ch * buckets;
        for (int64_t i = n * ch / chunks; i < n * (ch + 1) / chunks; ++i) {
            const int64_t v = g.voxel(coords + 4 * i);
            vox[i] = v;
            if (v >= 0) ++cnt[v * buckets / V];
        }
    }
    });
    // Offsets in (bucket, chunk) order: within a bucket, chunks (and so points) stay in order.
    std::vector<int64_t> offset(static_cast<size_t>(chunks * buckets));
    start.assign(static_cast<size_t>(buckets + 1), 0);
    int64_t total = 0;
    for (int64_t k = 0; k < buckets; ++k) {
        start[k] = total;
        for (int64_t ch = 0; ch < chunks; ++ch) {
            offset[ch * buckets + k] = total;
            total += count[ch * buckets + k];
        }
    }
    start[buckets] = total;
    order.resize(static_cast<size_t>(total));
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ch = begin; ch < end; ++ch) {
        int64_t* off = offset.data() + ch * buckets;
        for (int64_t i = n * ch / chunks; i < n * (ch + 1) / chunks; ++i) {
            const int64_t v = vox[i];
            if (v >= 0) order[off[v * buckets / V]++] = i;
        }
    }
    });
}

template <typename T>
void forward_impl(const T* __restrict feats, const int64_t* coords, int64_t n, int64_t C, const Grid& g,
                  T* __restrict out) {
    const int64_t V = g.B * g.Z * g.X * g.Y;
    const int64_t buckets = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), V));
    std::vector<int64_t> vox, start, order;
    bucket(coords, n, g, buckets, vox, start, order);
    at::parallel_for(0, buckets, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
        // This bucket's voxel range is zeroed and summed by this task only.
        const int64_t v_lo = (V * k + buckets - 1) / buckets, v_hi = (V * (k + 1) + buckets - 1) / buckets;
        std::fill(out + v_lo * C, out + v_hi * C, T(0));
        for (int64_t j = start[k]; j < start[k + 1]; ++j) {
            const int64_t i = order[j];
            const T* __restrict f = feats + i * C;
            T* __restrict o = out + vox[i] * C;
#pragma omp simd
            for (int64_t c = 0; c < C; ++c) o[c] += f[c];
        }
    }
    });
}

template <typename T>
void backward_impl(const T* __restrict gout, const int64_t* coords, int64_t n, int64_t C, const Grid& g,
                   T* __restrict gfeats) {
    at::parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
        const int64_t v = g.voxel(coords + 4 * i);
        T* __restrict d = gfeats + i * C;
        if (v < 0) {
            std::fill(d, d + C, T(0));
            continue;
        }
        const T* __restrict s = gout + v * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) d[c] = s[c];
    }
    });
}

}  // namespace

void bev_pool_forward(const at::Tensor& feats, const at::Tensor& coords, int64_t B, int64_t Z, int64_t X, int64_t Y,
                      at::Tensor& out) {
    check(feats, coords);
    TORCH_CHECK(B >= 0 && Z >= 0 && X >= 0 && Y >= 0, "negative grid size");
    TORCH_CHECK(out.is_contiguous() && out.numel() == B * Z * X * Y * feats.size(1) &&
                    out.scalar_type() == feats.scalar_type(), "bad output");
    const Grid g{B, Z, X, Y};
    if (out.numel() == 0) return;
    AT_DISPATCH_FLOATING_TYPES(feats.scalar_type(), "loongkit_bev_pool_forward", [&] {
        forward_impl<scalar_t>(feats.data_ptr<scalar_t>(), coords.data_ptr<int64_t>(), feats.size(0), feats.size(1), g,
                               out.data_ptr<scalar_t>());
    });
}

void bev_pool_backward(const at::Tensor& grad_out, const at::Tensor& coords, int64_t B, int64_t Z, int64_t X,
                       int64_t Y, at::Tensor& grad_feats) {
    check(grad_feats, coords);
    TORCH_CHECK(grad_out.is_contiguous() && grad_out.numel() == B * Z * X * Y * grad_feats.size(1) &&
                    grad_out.scalar_type() == grad_feats.scalar_type(), "bad grad_output");
    const Grid g{B, Z, X, Y};
    AT_DISPATCH_FLOATING_TYPES(grad_feats.scalar_type(), "loongkit_bev_pool_backward", [&] {
        backward_impl<scalar_t>(grad_out.data_ptr<scalar_t>(), coords.data_ptr<int64_t>(), grad_feats.size(0),
                                grad_feats.size(1), g, grad_feats.data_ptr<scalar_t>());
    });
}

}  // namespace loongkit
