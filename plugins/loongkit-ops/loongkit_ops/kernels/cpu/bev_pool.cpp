// BEV pooling (BEVFusion `bev_pool`) on the CPU: per-voxel sums of point features.
//
// feats [N, C], coords [N, 4] int64 as (x, y, z, batch); the sum of every point's features in voxel
// (b, z, x, y) is written to out [B, C, Z, X, Y], BEVFusion's channel-first layout. Points whose
// coordinates fall outside the grid contribute nothing (BEVFusion filters them before the call; here
// they are simply dropped).
//
// The voxels of each batch's Z*X*Y plane are cut into tiles of `kTile` consecutive voxels. A stable
// counting sort groups the points by tile (no comparison sort, no atomics). Each tile is then owned by
// one task: it sums its points' rows, in increasing point order, into a small channel-last buffer that
// stays in cache (each point's C values are one contiguous vectorisable row), then writes the buffer
// transposed into the channel-first output: C runs of kTile contiguous values. Every output element
// is written exactly once (empty tiles get zeros), so there is no zero-fill pass, no channel-last
// [B, Z, X, Y, C] intermediate and no permute pass. Every voxel's sum is taken in point order,
// whatever the thread count: deterministic.
//
// The backward is the same walk in reverse: a tile of grad_out [B, C, Z, X, Y] is read in its native
// layout into the buffer (transposed), then each of the tile's points copies its voxel's row.
//
// Fresh outputs of many megabytes are first touched here; the kernel asks for transparent huge pages
// on them (madvise, a hint) because 4 KiB first-touch page faults otherwise cost more than the
// pooling itself on machines with THP in "madvise" mode.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "kernels.h"

namespace loongkit::LK_ISA {
namespace {

// Voxels per tile: a 64 x C buffer (20 KiB at C = 80 float) stays in L1/L2, and each channel's run
// in the output is 64 values (whole cache lines).
constexpr int64_t kTile = 64;

struct BevGrid {
    int64_t B, Z, X, Y;
    int64_t plane() const { return Z * X * Y; }
    // Flattened (b, z, x, y) voxel of a point, or -1 when it is outside the grid.
    int64_t voxel(const int64_t* c) const {
        const int64_t x = c[0], y = c[1], z = c[2], b = c[3];
        if (x < 0 || x >= X || y < 0 || y >= Y || z < 0 || z >= Z || b < 0 || b >= B) return -1;
        return ((b * Z + z) * X + x) * Y + y;
    }
};

void check_bev_pool(const View& feats, const View& coords) {
    LK_CHECK(feats.dim() == 2 && feats.is_contiguous(), "feats must be contiguous [N, C]");
    LK_CHECK(coords.dim() == 2 && coords.size(1) == 4 && coords.size(0) == feats.size(0) &&
                    coords.scalar_type() == lk::kLong && coords.is_contiguous(),
                "coords must be contiguous int64 [N, 4]");
}

// Hint the kernel to back a large buffer we are about to fill with huge pages (fewer first-touch faults).
void advise_huge_pages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    constexpr int64_t kMin = int64_t(8) << 20;  // small buffers: not worth a syscall
    if (bytes < kMin) return;
    const int64_t page = sysconf(_SC_PAGESIZE);
    if (page <= 0) return;
    const auto lo = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
    const auto hi = (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(bytes)) / page * page;
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // failure is harmless
#else
    (void)data;
    (void)bytes;
#endif
}

// The points of every tile, in point order: point order[j] and its voxel's offset in the tile slot[j]
// for j in [start[t], start[t + 1]).
struct Plan {
    int64_t tiles_per_plane = 0, tiles = 0;
    std::vector<int64_t> start, order;
    std::vector<int32_t> slot;
    std::vector<int64_t> vox;  // per point: flattened voxel, -1 when dropped
};

int64_t tile_of(int64_t v, int64_t plane, int64_t tiles_per_plane) {
    const int64_t b = v / plane;
    return b * tiles_per_plane + (v - b * plane) / kTile;
}

Plan plan_tiles(const int64_t* coords, int64_t n, const BevGrid& g) {
    Plan p;
    const int64_t plane = g.plane();
    p.tiles_per_plane = (plane + kTile - 1) / kTile;
    p.tiles = g.B * p.tiles_per_plane;
    p.vox.resize(static_cast<size_t>(n));
    const int64_t tiles = p.tiles, tpp = p.tiles_per_plane;
    // A few point chunks per thread; each chunk counts its points per tile (no shared counters).
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(lk::num_threads(), (n + 16383) / 16384));
    std::vector<int64_t> count(static_cast<size_t>(chunks * tiles), 0);
    lk::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t ch = begin; ch < end; ++ch) {
            int64_t* cnt = count.data() + ch * tiles;
            for (int64_t i = n * ch / chunks; i < n * (ch + 1) / chunks; ++i) {
                const int64_t v = g.voxel(coords + 4 * i);
                p.vox[i] = v;
                if (v >= 0) ++cnt[tile_of(v, plane, tpp)];
            }
        }
    });
    // Offsets in (tile, chunk) order: within a tile, chunks (and so points) stay in point order.
    p.start.resize(static_cast<size_t>(tiles + 1));
    int64_t total = 0;
    for (int64_t t = 0; t < tiles; ++t) {
        p.start[t] = total;
        for (int64_t ch = 0; ch < chunks; ++ch) {
            const int64_t c = count[ch * tiles + t];
            count[ch * tiles + t] = total;
            total += c;
        }
    }
    p.start[tiles] = total;
    p.order.resize(static_cast<size_t>(total));
    p.slot.resize(static_cast<size_t>(total));
    lk::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t ch = begin; ch < end; ++ch) {
            int64_t* off = count.data() + ch * tiles;
            for (int64_t i = n * ch / chunks; i < n * (ch + 1) / chunks; ++i) {
                const int64_t v = p.vox[i];
                if (v < 0) continue;
                const int64_t b = v / plane, r = v - b * plane;
                const int64_t j = off[b * tpp + r / kTile]++;
                p.order[j] = i;
                p.slot[j] = static_cast<int32_t>(r % kTile);
            }
        }
    });
    return p;
}

// Runs fn(t) for every tile t, tiles split into contiguous ranges of about equal work (points * C plus
// one tile's transpose), one range per thread: the points crowd in a few tiles near the ego car.
template <typename F>
void for_tiles(const Plan& p, bool skip_empty, const F& fn) {
    const int64_t tiles = p.tiles;
    if (tiles == 0) return;
    const int64_t tile_cost = skip_empty ? 0 : kTile;  // in point rows
    const int64_t total = p.start[tiles] + tile_cost * tiles + tiles;  // +1 per tile: the loop itself
    const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(lk::num_threads() * 4, tiles));
    // cost before tile t = start[t] + (tile_cost + 1) * t: monotone, so a binary search finds each range.
    auto first_tile = [&](int64_t k) {
        const int64_t target = total * k / tasks;
        int64_t lo = 0, hi = tiles;
        while (lo < hi) {
            const int64_t mid = (lo + hi) / 2;
            if (p.start[mid] + (tile_cost + 1) * mid < target) lo = mid + 1;
            else hi = mid;
        }
        return lo;
    };
    lk::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = first_tile(begin), last = first_tile(end); t < last; ++t) fn(t);
    });
}

template <typename T>
void forward_impl(const T* __restrict feats, const int64_t* coords, int64_t n, int64_t C, const BevGrid& g,
                  T* __restrict out) {
    const Plan p = plan_tiles(coords, n, g);
    const int64_t plane = g.plane();
    for_tiles(p, false, [&](int64_t t) {
        thread_local std::vector<T> scratch;
        const int64_t b = t / p.tiles_per_plane, base = (t - b * p.tiles_per_plane) * kTile;
        const int64_t len = std::min(kTile, plane - base);
        T* __restrict dst = out + b * C * plane + base;
        if (p.start[t] == p.start[t + 1]) {
            for (int64_t c = 0; c < C; ++c) std::fill(dst + c * plane, dst + c * plane + len, T(0));
            return;
        }
        scratch.assign(static_cast<size_t>(kTile * C), T(0));
        T* __restrict buf = scratch.data();
        const int64_t* order = p.order.data();
        const int32_t* slot = p.slot.data();
        for (int64_t j = p.start[t], e = p.start[t + 1]; j < e; ++j) {
            if (j + 8 < e) __builtin_prefetch(feats + order[j + 8] * C);
            const T* __restrict f = feats + order[j] * C;
            T* __restrict o = buf + slot[j] * C;
#pragma omp simd
            for (int64_t c = 0; c < C; ++c) o[c] += f[c];
        }
        // Transposed write: channel c of the tile's voxels is len contiguous outputs.
        for (int64_t c = 0; c < C; ++c) {
            T* __restrict d = dst + c * plane;
            for (int64_t v = 0; v < len; ++v) d[v] = buf[v * C + c];
        }
    });
}

template <typename T>
void backward_impl(const T* __restrict gout, const int64_t* coords, int64_t n, int64_t C, const BevGrid& g,
                   T* __restrict gfeats) {
    const Plan p = plan_tiles(coords, n, g);
    const int64_t plane = g.plane();
    // Dropped points get zero rows.
    lk::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
            if (p.vox[i] < 0) std::fill(gfeats + i * C, gfeats + (i + 1) * C, T(0));
    });
    for_tiles(p, true, [&](int64_t t) {
        if (p.start[t] == p.start[t + 1]) return;
        thread_local std::vector<T> scratch;
        const int64_t b = t / p.tiles_per_plane, base = (t - b * p.tiles_per_plane) * kTile;
        const int64_t len = std::min(kTile, plane - base);
        const T* __restrict src = gout + b * C * plane + base;
        scratch.resize(static_cast<size_t>(kTile * C));
        T* __restrict buf = scratch.data();
        for (int64_t c = 0; c < C; ++c) {
            const T* __restrict s = src + c * plane;
            for (int64_t v = 0; v < len; ++v) buf[v * C + c] = s[v];
        }
        const int64_t* order = p.order.data();
        const int32_t* slot = p.slot.data();
        for (int64_t j = p.start[t], e = p.start[t + 1]; j < e; ++j) {
            const T* __restrict s = buf + slot[j] * C;
            T* __restrict d = gfeats + order[j] * C;
#pragma omp simd
            for (int64_t c = 0; c < C; ++c) d[c] = s[c];
        }
    });
}

}  // namespace

void bev_pool_forward(const View& feats, const View& coords, int64_t B, int64_t Z, int64_t X, int64_t Y,
                      const View& out) {
    check_bev_pool(feats, coords);
    LK_CHECK(B >= 0 && Z >= 0 && X >= 0 && Y >= 0, "negative grid size");
    LK_CHECK(out.is_contiguous() && out.dim() == 5 && out.size(0) == B && out.size(1) == feats.size(1) &&
                    out.size(2) == Z && out.size(3) == X && out.size(4) == Y &&
                    out.scalar_type() == feats.scalar_type(), "out must be contiguous [B, C, Z, X, Y]");
    const BevGrid g{B, Z, X, Y};
    if (out.numel() == 0) return;
    advise_huge_pages(out.data_ptr(), out.numel() * out.element_size());
    LK_DISPATCH_FLOATING_TYPES(feats.scalar_type(), "loongkit_bev_pool_forward", [&] {
        forward_impl<scalar_t>(feats.data_ptr<scalar_t>(), coords.data_ptr<int64_t>(), feats.size(0), feats.size(1), g,
                               out.data_ptr<scalar_t>());
    });
}

void bev_pool_backward(const View& grad_out, const View& coords, int64_t B, int64_t Z, int64_t X,
                       int64_t Y, const View& grad_feats) {
    check_bev_pool(grad_feats, coords);
    LK_CHECK(grad_out.is_contiguous() && grad_out.dim() == 5 && grad_out.size(0) == B &&
                    grad_out.size(1) == grad_feats.size(1) && grad_out.size(2) == Z && grad_out.size(3) == X &&
                    grad_out.size(4) == Y && grad_out.scalar_type() == grad_feats.scalar_type(),
                "grad_output must be contiguous [B, C, Z, X, Y]");
    const BevGrid g{B, Z, X, Y};
    if (grad_feats.numel() == 0) return;
    advise_huge_pages(grad_feats.data_ptr(), grad_feats.numel() * grad_feats.element_size());
    LK_DISPATCH_FLOATING_TYPES(grad_feats.scalar_type(), "loongkit_bev_pool_backward", [&] {
        backward_impl<scalar_t>(grad_out.data_ptr<scalar_t>(), coords.data_ptr<int64_t>(), grad_feats.size(0),
                                grad_feats.size(1), g, grad_feats.data_ptr<scalar_t>());
    });
}

}  // namespace loongkit::LK_ISA
