// loongkit's binding of mmcv 2.1.0's CUDA launchers for the GPU kit's baselines (benchmarks/gpu/).
//
// build_baselines.py compiles the carried upstream files (benchmarks/gpu/carry/mmcv/, Apache-2.0:
// pytorch/cuda/ms_deform_attn_cuda.cu and pytorch/cuda/voxelization_cuda.cu with their kernels) and
// links them with this file into one library; torch.ops.load_library() then registers the ops below
// under torch.ops.lk_mmcv_baseline. The declarations are the launchers' signatures as defined in those
// files; the wrappers do what mmcv's Python side (ops/multi_scale_deform_attn.py, ops/voxelize.py)
// does around them: allocate the outputs and zeroed gradients, slice to the voxel count.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

// mmcv/ops/csrc/pytorch/cuda/ms_deform_attn_cuda.cu
at::Tensor ms_deform_attn_cuda_forward(const at::Tensor &value, const at::Tensor &spatial_shapes,
                                       const at::Tensor &level_start_index, const at::Tensor &sampling_loc,
                                       const at::Tensor &attn_weight, const int im2col_step);
void ms_deform_attn_cuda_backward(const at::Tensor &value, const at::Tensor &spatial_shapes,
                                  const at::Tensor &level_start_index, const at::Tensor &sampling_loc,
                                  const at::Tensor &attn_weight, const at::Tensor &grad_output,
                                  at::Tensor &grad_value, at::Tensor &grad_sampling_loc,
                                  at::Tensor &grad_attn_weight, const int im2col_step);

// mmcv/ops/csrc/pytorch/cuda/voxelization_cuda.cu (the deterministic hard voxelization and the dynamic one)
int HardVoxelizeForwardCUDAKernelLauncher(const at::Tensor &points, at::Tensor &voxels, at::Tensor &coors,
                                          at::Tensor &num_points_per_voxel, const std::vector<float> voxel_size,
                                          const std::vector<float> coors_range, const int max_points,
                                          const int max_voxels, const int NDim);
void DynamicVoxelizeForwardCUDAKernelLauncher(const at::Tensor &points, at::Tensor &coors,
                                              const std::vector<float> voxel_size,
                                              const std::vector<float> coors_range, const int NDim);

namespace {

// mmcv hands the sizes to its launchers through float32 tensors: the same rounding as this cast.
std::vector<float> to_float(c10::ArrayRef<double> values) {
  return std::vector<float>(values.begin(), values.end());
}

void check_msda_inputs(const at::Tensor &value, const at::Tensor &spatial_shapes,
                       const at::Tensor &level_start_index) {
  TORCH_CHECK(value.is_cuda() && value.dim() == 4, "value must be a CUDA tensor [bs, keys, heads, channels]");
  // The launchers read the index tensors as int64 (data_ptr<int64_t>): reject anything else here.
  TORCH_CHECK(spatial_shapes.scalar_type() == at::kLong && level_start_index.scalar_type() == at::kLong,
              "spatial_shapes and level_start_index must be int64");
}

at::Tensor msda_forward(const at::Tensor &value, const at::Tensor &spatial_shapes,
                        const at::Tensor &level_start_index, const at::Tensor &sampling_loc,
                        const at::Tensor &attn_weight, int64_t im2col_step) {
  check_msda_inputs(value, spatial_shapes, level_start_index);
  const c10::cuda::CUDAGuard guard(value.device());
  return ms_deform_attn_cuda_forward(value, spatial_shapes, level_start_index, sampling_loc, attn_weight,
                                     static_cast<int>(im2col_step));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> msda_backward(
    const at::Tensor &value, const at::Tensor &spatial_shapes, const at::Tensor &level_start_index,
    const at::Tensor &sampling_loc, const at::Tensor &attn_weight, const at::Tensor &grad_output,
    int64_t im2col_step) {
  check_msda_inputs(value, spatial_shapes, level_start_index);
  const c10::cuda::CUDAGuard guard(value.device());
  // The backward kernels accumulate (atomicAdd) into the gradients: they must start at zero.
  at::Tensor grad_value = at::zeros_like(value);
  at::Tensor grad_sampling_loc = at::zeros_like(sampling_loc);
  at::Tensor grad_attn_weight = at::zeros_like(attn_weight);
  ms_deform_attn_cuda_backward(value, spatial_shapes, level_start_index, sampling_loc, attn_weight,
                               grad_output.contiguous(), grad_value, grad_sampling_loc, grad_attn_weight,
                               static_cast<int>(im2col_step));
  return {grad_value, grad_sampling_loc, grad_attn_weight};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hard_voxelize(const at::Tensor &points,
                                                             c10::ArrayRef<double> voxel_size,
                                                             c10::ArrayRef<double> coors_range,
                                                             int64_t max_points, int64_t max_voxels) {
  TORCH_CHECK(points.is_cuda() && points.dim() == 2, "points must be a CUDA tensor [N, features]");
  // The deterministic launcher copies the features through data_ptr<float>().
  TORCH_CHECK(points.scalar_type() == at::kFloat, "mmcv's deterministic hard voxelization takes float32 points");
  TORCH_CHECK(voxel_size.size() == 3 && coors_range.size() == 6, "voxel_size [3] and coors_range [6]");
  const c10::cuda::CUDAGuard guard(points.device());
  const at::Tensor pts = points.contiguous();
  at::Tensor voxels = at::zeros({max_voxels, max_points, pts.size(1)}, pts.options());
  at::Tensor coors = at::zeros({max_voxels, 3}, pts.options().dtype(at::kInt));
  at::Tensor num_points = at::zeros({max_voxels}, pts.options().dtype(at::kInt));
  const int count = HardVoxelizeForwardCUDAKernelLauncher(pts, voxels, coors, num_points, to_float(voxel_size),
                                                          to_float(coors_range), static_cast<int>(max_points),
                                                          static_cast<int>(max_voxels), 3);
  return {voxels.narrow(0, 0, count), coors.narrow(0, 0, count), num_points.narrow(0, 0, count)};
}

at::Tensor dynamic_voxelize(const at::Tensor &points, c10::ArrayRef<double> voxel_size,
                            c10::ArrayRef<double> coors_range) {
  TORCH_CHECK(points.is_cuda() && points.dim() == 2, "points must be a CUDA tensor [N, features]");
  TORCH_CHECK(voxel_size.size() == 3 && coors_range.size() == 6, "voxel_size [3] and coors_range [6]");
  const c10::cuda::CUDAGuard guard(points.device());
  const at::Tensor pts = points.contiguous();
  at::Tensor coors = at::zeros({pts.size(0), 3}, pts.options().dtype(at::kInt));
  DynamicVoxelizeForwardCUDAKernelLauncher(pts, coors, to_float(voxel_size), to_float(coors_range), 3);
  return coors;
}

}  // namespace

TORCH_LIBRARY(lk_mmcv_baseline, m) {
  m.def("ms_deform_attn_forward(Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
        "Tensor sampling_loc, Tensor attn_weight, int im2col_step) -> Tensor");
  m.def("ms_deform_attn_backward(Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
        "Tensor sampling_loc, Tensor attn_weight, Tensor grad_output, int im2col_step) -> (Tensor, Tensor, Tensor)");
  m.def("hard_voxelize(Tensor points, float[] voxel_size, float[] coors_range, int max_points, "
        "int max_voxels) -> (Tensor, Tensor, Tensor)");
  m.def("dynamic_voxelize(Tensor points, float[] voxel_size, float[] coors_range) -> Tensor");
}

TORCH_LIBRARY_IMPL(lk_mmcv_baseline, CUDA, m) {
  m.impl("ms_deform_attn_forward", &msda_forward);
  m.impl("ms_deform_attn_backward", &msda_backward);
  m.impl("hard_voxelize", &hard_voxelize);
  m.impl("dynamic_voxelize", &dynamic_voxelize);
}
