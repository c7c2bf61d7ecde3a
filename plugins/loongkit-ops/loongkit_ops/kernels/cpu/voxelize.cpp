// Hard and dynamic voxelization with mmcv's CPU semantics (mmcv.ops.voxelize, deterministic mode).
//
// A point's voxel is floor((p - range_min) / voxel_size) per axis, computed exactly as mmcv does: in
// float for float/half points (float arithmetic with the float32 voxel size and range), in double for
// double points; a coordinate outside [0, grid) drops the point. grid = round((max - min) / size) in
// float. Coordinates are reported (z, y, x).
//
// Hard voxelization keeps upstream's order rules: points are scanned in input order; a voxel gets the
// next index when its first point arrives, unless max_voxels voxels exist already (then that point,
// and every later point of that voxel, is dropped); a voxel keeps its first max_points points in input
// order; unused point slots are zero.
//
// Where mmcv allocates and fills a dense int32 grid of Z*Y*X voxel ids per call (332 MB for nuScenes
// CenterPoint's 1440x1440x40 grid) and zero-fills max_voxels * max_points rows, this kernel computes
// the voxel keys in parallel, assigns ids in one sequential pass over an open-addressing hash map
// sized by the number of points, then copies the points and zero-fills the unused slots of the
// voxels that exist, in parallel.
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace loongkit {
namespace {

struct Grid {
    float size[3];
    float lo[3];
    int64_t dim[3];  // x, y, z
};

Grid make_grid(const std::vector<double>& voxel_size, const std::vector<double>& coors_range) {
    TORCH_CHECK(voxel_size.size() == 3 && coors_range.size() == 6, "voxel_size has 3 values, coors_range 6");
    Grid g;
    for (int j = 0; j < 3; ++j) {
        g.size[j] = static_cast<float>(voxel_size[j]);
        g.lo[j] = static_cast<float>(coors_range[j]);
        const float extent = static_cast<float>(coors_range[3 + j]) - g.lo[j];
        g.dim[j] = static_cast<int64_t>(std::round(extent / g.size[j]));
        TORCH_CHECK(g.dim[j] > 0, "empty voxel grid");
    }
    return g;
}

// Linear key z*Y*X + y*X + x of point i (whose coordinates are (x, y, z) = p[0..2]), or -1.
template <typename T>
inline int64_t voxel_key(const T* p, const Grid& g, int32_t* zyx) {
    using A = typename std::conditional<std::is_same<T, double>::value, double, float>::type;
    int64_t c[3];
    for (int j = 0; j < 3; ++j) {
        const A f = std::floor((static_cast<A>(p[j]) - static_cast<A>(g.lo[j])) / static_cast<A>(g.size[j]));
        // NaN fails both comparisons: dropped, as upstream's int conversion of NaN is negative.
        if (!(f >= A(0) && f < static_cast<A>(g.dim[j]))) return -1;
        c[j] = static_cast<int64_t>(f);
    }
    if (zyx != nullptr) {
        zyx[0] = static_cast<int32_t>(c[2]);
        zyx[1] = static_cast<int32_t>(c[1]);
        zyx[2] = static_cast<int32_t>(c[0]);
    }
    return (c[2] * g.dim[1] + c[1]) * g.dim[0] + c[0];
}

// Open addressing, linear probing; keys are >= 0 so -1 marks an empty slot.
class VoxelMap {
   public:
    explicit VoxelMap(int64_t expected) {
        int64_t cap = 16;
        while (cap < 2 * expected) cap <<= 1;
        mask_ = cap - 1;
        keys_.assign(static_cast<size_t>(cap), -1);
        vals_.resize(static_cast<size_t>(cap));
    }
    // Slot of key: vals_[slot] is its value when keys_[slot] == key, else the slot is free for it.
    inline int64_t find(int64_t key) const {
        int64_t s = static_cast<int64_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> 20) & mask_;
        while (keys_[s] != -1 && keys_[s] != key) s = (s + 1) & mask_;
        return s;
    }
    inline bool occupied(int64_t slot) const { return keys_[slot] != -1; }
    inline int32_t value(int64_t slot) const { return vals_[slot]; }
    inline void insert(int64_t slot, int64_t key, int32_t v) {
        keys_[slot] = key;
        vals_[slot] = v;
    }

   private:
    int64_t mask_;
    std::vector<int64_t> keys_;
    std::vector<int32_t> vals_;
};

template <typename T>
std::vector<at::Tensor> hard_impl(const at::Tensor& points, const Grid& g, int64_t max_points, int64_t max_voxels) {
    const int64_t N = points.size(0), F = points.size(1);
    const T* pts = points.data_ptr<T>();
    std::vector<int64_t> key(static_cast<size_t>(N));
    at::parallel_for(0, N, 4096, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) key[i] = voxel_key<T>(pts + i * F, g, nullptr);
    });
    // Sequential, in input order: this fixes voxel ids and which points each voxel keeps.
    const int64_t cap_voxels = std::min(N, max_voxels);
    VoxelMap map(cap_voxels);
    std::vector<int64_t> voxel_keys;
    voxel_keys.reserve(static_cast<size_t>(cap_voxels));
    std::vector<int32_t> count;
    count.reserve(static_cast<size_t>(cap_voxels));
    std::vector<int64_t> dest(static_cast<size_t>(N));  // voxel * max_points + slot, or -1
    for (int64_t i = 0; i < N; ++i) {
        dest[i] = -1;
        const int64_t k = key[i];
        if (k < 0) continue;
        const int64_t s = map.find(k);
        int32_t v;
        if (map.occupied(s)) {
            v = map.value(s);
        } else {
            if (static_cast<int64_t>(voxel_keys.size()) >= max_voxels) continue;
            v = static_cast<int32_t>(voxel_keys.size());
            map.insert(s, k, v);
            voxel_keys.push_back(k);
            count.push_back(0);
        }
        if (count[v] < max_points) dest[i] = static_cast<int64_t>(v) * max_points + count[v]++;
    }
    const int64_t M = static_cast<int64_t>(voxel_keys.size());
    at::Tensor voxels = at::empty({M, max_points, F}, points.options());
    at::Tensor coors = at::empty({M, 3}, points.options().dtype(at::kInt));
    at::Tensor num = at::empty({M}, points.options().dtype(at::kInt));
    T* vox = voxels.data_ptr<T>();
    int32_t* co = coors.data_ptr<int32_t>();
    int32_t* nu = num.data_ptr<int32_t>();
    const int64_t XY = g.dim[0] * g.dim[1];
    at::parallel_for(0, M, 2048, [&](int64_t b, int64_t e) {
        for (int64_t v = b; v < e; ++v) {
            const int64_t k = voxel_keys[v];
            co[3 * v] = static_cast<int32_t>(k / XY);
            co[3 * v + 1] = static_cast<int32_t>((k % XY) / g.dim[0]);
            co[3 * v + 2] = static_cast<int32_t>(k % g.dim[0]);
            nu[v] = count[v];
            T* row = vox + v * max_points * F;
            std::fill(row + count[v] * F, row + max_points * F, T(0));  // zero padding
        }
    });
    at::parallel_for(0, N, 4096, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
            if (dest[i] < 0) continue;
            std::copy(pts + i * F, pts + (i + 1) * F, vox + dest[i] * F);
        }
    });
    return {voxels, coors, num};
}

}  // namespace

std::vector<at::Tensor> hard_voxelize(const at::Tensor& points, const std::vector<double>& voxel_size,
                                      const std::vector<double>& coors_range, int64_t max_points,
                                      int64_t max_voxels) {
    TORCH_CHECK(points.device().is_cpu() && points.dim() == 2 && points.size(1) >= 3 && points.is_contiguous(),
                "points must be a contiguous CPU tensor [N, >=3]");
    TORCH_CHECK(max_points >= 0 && max_voxels >= 0, "max_points and max_voxels must be >= 0");
    const Grid g = make_grid(voxel_size, coors_range);
    std::vector<at::Tensor> out;
    AT_DISPATCH_FLOATING_TYPES_AND_HALF(points.scalar_type(), "loongkit_hard_voxelize", [&] {
        out = hard_impl<scalar_t>(points, g, max_points, max_voxels);
    });
    return out;
}

at::Tensor dynamic_voxelize(const at::Tensor& points, const std::vector<double>& voxel_size,
                            const std::vector<double>& coors_range) {
    TORCH_CHECK(points.device().is_cpu() && points.dim() == 2 && points.size(1) >= 3 && points.is_contiguous(),
                "points must be a contiguous CPU tensor [N, >=3]");
    const Grid g = make_grid(voxel_size, coors_range);
    const int64_t N = points.size(0), F = points.size(1);
    at::Tensor coors = at::empty({N, 3}, points.options().dtype(at::kInt));
    int32_t* co = coors.data_ptr<int32_t>();
    AT_DISPATCH_FLOATING_TYPES_AND_HALF(points.scalar_type(), "loongkit_dynamic_voxelize", [&] {
        const scalar_t* pts = points.data_ptr<scalar_t>();
        at::parallel_for(0, N, 4096, [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) {
                if (voxel_key<scalar_t>(pts + i * F, g, co + 3 * i) < 0) co[3 * i] = co[3 * i + 1] = co[3 * i + 2] = -1;
            }
        });
    });
    return coors;
}

}  // namespace loongkit
