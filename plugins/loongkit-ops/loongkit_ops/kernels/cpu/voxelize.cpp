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
#include "kernels.h"

namespace loongkit::LK_ISA {
namespace {

struct VoxelGrid {
    float size[3];
    float lo[3];
    int64_t dim[3];  // x, y, z
};

VoxelGrid make_grid(const std::vector<double>& voxel_size, const std::vector<double>& coors_range) {
    LK_CHECK(voxel_size.size() == 3 && coors_range.size() == 6, "voxel_size has 3 values, coors_range 6");
    VoxelGrid g;
    for (int j = 0; j < 3; ++j) {
        g.size[j] = static_cast<float>(voxel_size[j]);
        g.lo[j] = static_cast<float>(coors_range[j]);
        const float extent = static_cast<float>(coors_range[3 + j]) - g.lo[j];
        g.dim[j] = static_cast<int64_t>(std::round(extent / g.size[j]));
        LK_CHECK(g.dim[j] > 0, "empty voxel grid");
    }
    return g;
}

// Linear key z*Y*X + y*X + x of point i (whose coordinates are (x, y, z) = p[0..2]), or -1.
template <typename T>
inline int64_t voxel_key(const T* p, const VoxelGrid& g, int32_t* zyx) {
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

// What the sequential pass decided; hard_voxelize_fill writes the outputs from it.
struct HardPlan {
    const void* points;
    lk::Dtype dtype;
    int64_t N, F, max_points;
    VoxelGrid g;
    std::vector<int64_t> voxel_keys;  // per voxel, in id order
    std::vector<int32_t> count;       // points kept per voxel
    std::vector<int64_t> dest;        // per point: voxel * max_points + slot, or -1
};

template <typename T>
void plan_impl(HardPlan& plan, int64_t max_voxels) {
    const int64_t N = plan.N, F = plan.F, max_points = plan.max_points;
    const T* pts = static_cast<const T*>(plan.points);
    const VoxelGrid& g = plan.g;
    std::vector<int64_t> key(static_cast<size_t>(N));
    lk::parallel_for(0, N, 4096, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) key[i] = voxel_key<T>(pts + i * F, g, nullptr);
    });
    // Sequential, in input order: this fixes voxel ids and which points each voxel keeps.
    const int64_t cap_voxels = std::min(N, max_voxels);
    VoxelMap map(cap_voxels);
    std::vector<int64_t>& voxel_keys = plan.voxel_keys;
    voxel_keys.reserve(static_cast<size_t>(cap_voxels));
    std::vector<int32_t>& count = plan.count;
    count.reserve(static_cast<size_t>(cap_voxels));
    std::vector<int64_t>& dest = plan.dest;
    dest.resize(static_cast<size_t>(N));
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
}

template <typename T>
void fill_impl(const HardPlan& plan, T* vox, int32_t* co, int32_t* nu) {
    const int64_t N = plan.N, F = plan.F, max_points = plan.max_points;
    const int64_t M = static_cast<int64_t>(plan.voxel_keys.size());
    const T* pts = static_cast<const T*>(plan.points);
    const VoxelGrid& g = plan.g;
    const std::vector<int64_t>& voxel_keys = plan.voxel_keys;
    const std::vector<int32_t>& count = plan.count;
    const std::vector<int64_t>& dest = plan.dest;
    const int64_t XY = g.dim[0] * g.dim[1];
    lk::parallel_for(0, M, 2048, [&](int64_t b, int64_t e) {
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
    lk::parallel_for(0, N, 4096, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
            if (dest[i] < 0) continue;
            std::copy(pts + i * F, pts + (i + 1) * F, vox + dest[i] * F);
        }
    });
}

void check_points(const View& points) {
    LK_CHECK(points.dim() == 2 && points.size(1) >= 3 && points.is_contiguous(),
             "points must be a contiguous CPU tensor [N, >=3]");
}

HardPlan* plan_of(int64_t handle) {
    LK_CHECK(handle != 0, "no voxelization plan");
    return reinterpret_cast<HardPlan*>(static_cast<intptr_t>(handle));
}

}  // namespace

int64_t hard_voxelize_plan(const View& points, const std::vector<double>& voxel_size,
                           const std::vector<double>& coors_range, int64_t max_points, int64_t max_voxels) {
    check_points(points);
    LK_CHECK(max_points >= 0 && max_voxels >= 0, "max_points and max_voxels must be >= 0");
    auto plan = std::make_unique<HardPlan>();
    plan->points = points.data_ptr();
    plan->dtype = points.scalar_type();
    plan->N = points.size(0);
    plan->F = points.size(1);
    plan->max_points = max_points;
    plan->g = make_grid(voxel_size, coors_range);
    LK_DISPATCH_FLOATING_TYPES_AND_HALF(points.scalar_type(), "loongkit_hard_voxelize", [&] {
        plan_impl<scalar_t>(*plan, max_voxels);
    });
    return static_cast<int64_t>(reinterpret_cast<intptr_t>(plan.release()));
}

int64_t hard_voxelize_voxels(int64_t handle) { return static_cast<int64_t>(plan_of(handle)->voxel_keys.size()); }

void hard_voxelize_fill(int64_t handle, const View& voxels, const View& coors, const View& num_points) {
    std::unique_ptr<HardPlan> plan(plan_of(handle));  // freed whatever happens
    const int64_t M = static_cast<int64_t>(plan->voxel_keys.size());
    LK_CHECK(voxels.is_contiguous() && voxels.dim() == 3 && voxels.size(0) == M && voxels.size(1) == plan->max_points &&
                 voxels.size(2) == plan->F && voxels.scalar_type() == plan->dtype,
             "voxels must be contiguous [M, max_points, F] of the points' dtype");
    LK_CHECK(coors.is_contiguous() && coors.dim() == 2 && coors.size(0) == M && coors.size(1) == 3 &&
                 coors.scalar_type() == lk::kInt, "coors must be contiguous int32 [M, 3]");
    LK_CHECK(num_points.is_contiguous() && num_points.numel() == M && num_points.scalar_type() == lk::kInt,
             "num_points must be contiguous int32 [M]");
    LK_DISPATCH_FLOATING_TYPES_AND_HALF(plan->dtype, "loongkit_hard_voxelize", [&] {
        fill_impl<scalar_t>(*plan, voxels.data_ptr<scalar_t>(), coors.data_ptr<int32_t>(),
                            num_points.data_ptr<int32_t>());
    });
}

void hard_voxelize_discard(int64_t handle) { delete plan_of(handle); }

void dynamic_voxelize_into(const View& points, const std::vector<double>& voxel_size,
                      const std::vector<double>& coors_range, const View& coors) {
    check_points(points);
    const VoxelGrid g = make_grid(voxel_size, coors_range);
    const int64_t N = points.size(0), F = points.size(1);
    LK_CHECK(coors.is_contiguous() && coors.dim() == 2 && coors.size(0) == N && coors.size(1) == 3 &&
                 coors.scalar_type() == lk::kInt, "coors must be contiguous int32 [N, 3]");
    int32_t* co = coors.data_ptr<int32_t>();
    LK_DISPATCH_FLOATING_TYPES_AND_HALF(points.scalar_type(), "loongkit_dynamic_voxelize", [&] {
        const scalar_t* pts = points.data_ptr<scalar_t>();
        lk::parallel_for(0, N, 4096, [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) {
                if (voxel_key<scalar_t>(pts + i * F, g, co + 3 * i) < 0) co[3 * i] = co[3 * i + 1] = co[3 * i + 2] = -1;
            }
        });
    });
}

}  // namespace loongkit::LK_ISA
