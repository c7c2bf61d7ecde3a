// loongkit's binding of Sparse4D's CUDA deformable aggregation for the GPU kit's baseline (benchmarks/gpu/).
//
// build_baselines.py compiles the carried upstream launcher file (benchmarks/gpu/carry/sparse4d/, MIT:
// projects/mmdet3d_plugin/ops/src/deformable_aggregation_cuda.cu, commit pinned in carry.py) and links it
// with this file; torch.ops.load_library() registers the ops under torch.ops.lk_sparse4d_baseline. The
// declarations are the two launchers' signatures as defined there (raw float32 / int32 pointers, no
// stream argument: they launch on the default stream); the wrappers derive the sizes from the tensors the
// way Sparse4D's op does and allocate the output and the zeroed gradients.
//
// Shapes: mc_ms_feat [bs, num_feat, C], spatial_shape [cams, scales, 2] (H, W), scale_start_index
// [cams, scales], sampling_location [bs, anchors, pts, cams, 2], weights [bs, anchors, pts, cams, scales,
// groups]; output [bs, anchors, C].

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

// projects/mmdet3d_plugin/ops/src/deformable_aggregation_cuda.cu
void deformable_aggregation(float *output, const float *mc_ms_feat, const int *spatial_shape,
                            const int *scale_start_index, const float *sample_location, const float *weights,
                            int batch_size, int num_cams, int num_feat, int num_embeds, int num_scale,
                            int num_anchors, int num_pts, int num_groups);
void deformable_aggregation_grad(const float *mc_ms_feat, const int *spatial_shape, const int *scale_start_index,
                                 const float *sample_location, const float *weights, const float *grad_output,
                                 float *grad_mc_ms_feat, float *grad_sampling_location, float *grad_weights,
                                 int batch_size, int num_cams, int num_feat, int num_embeds, int num_scale,
                                 int num_anchors, int num_pts, int num_groups);

namespace {

struct Sizes {
  int batch, feat, embeds, cams, scales, anchors, pts, groups;
};

// The launchers index raw pointers: every tensor must be contiguous, on one device, of the dtype read.
Sizes check(const at::Tensor &feat, const at::Tensor &shape, const at::Tensor &start, const at::Tensor &loc,
            const at::Tensor &weights) {
  TORCH_CHECK(feat.is_cuda() && feat.dim() == 3 && shape.dim() == 3 && start.dim() == 2 && loc.dim() == 5 &&
                  weights.dim() == 6,
              "deformable_aggregation: feat [bs, N, C], shape [cams, scales, 2], start [cams, scales], "
              "location [bs, anchors, pts, cams, 2], weights [bs, anchors, pts, cams, scales, groups] on CUDA");
  for (const at::Tensor *t : {&feat, &loc, &weights}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device() == feat.device(),
                "deformable_aggregation: features, locations and weights must be contiguous float32");
  }
  for (const at::Tensor *t : {&shape, &start}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device() == feat.device(),
                "deformable_aggregation: spatial_shape and scale_start_index must be contiguous int32");
  }
  const Sizes s{static_cast<int>(feat.size(0)),    static_cast<int>(feat.size(1)),
                static_cast<int>(feat.size(2)),    static_cast<int>(shape.size(0)),
                static_cast<int>(shape.size(1)),   static_cast<int>(loc.size(1)),
                static_cast<int>(loc.size(2)),     static_cast<int>(weights.size(5))};
  TORCH_CHECK(s.groups > 0 && s.embeds % s.groups == 0, "deformable_aggregation: C must be a multiple of groups");
  return s;
}

at::Tensor forward(const at::Tensor &feat, const at::Tensor &shape, const at::Tensor &start, const at::Tensor &loc,
                   const at::Tensor &weights) {
  const Sizes s = check(feat, shape, start, loc, weights);
  const c10::cuda::CUDAGuard guard(feat.device());
  // The kernel accumulates each sample with atomicAdd: the output starts at zero.
  at::Tensor out = at::zeros({s.batch, s.anchors, s.embeds}, feat.options());
  deformable_aggregation(out.data_ptr<float>(), feat.data_ptr<float>(), shape.data_ptr<int>(),
                         start.data_ptr<int>(), loc.data_ptr<float>(), weights.data_ptr<float>(), s.batch, s.cams,
                         s.feat, s.embeds, s.scales, s.anchors, s.pts, s.groups);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor &feat, const at::Tensor &shape,
                                                        const at::Tensor &start, const at::Tensor &loc,
                                                        const at::Tensor &weights, const at::Tensor &grad_output) {
  const Sizes s = check(feat, shape, start, loc, weights);
  const c10::cuda::CUDAGuard guard(feat.device());
  const at::Tensor grad = grad_output.contiguous().to(at::kFloat);
  at::Tensor grad_feat = at::zeros_like(feat);
  at::Tensor grad_loc = at::zeros_like(loc);
  at::Tensor grad_weights = at::zeros_like(weights);
  deformable_aggregation_grad(feat.data_ptr<float>(), shape.data_ptr<int>(), start.data_ptr<int>(),
                              loc.data_ptr<float>(), weights.data_ptr<float>(), grad.data_ptr<float>(),
                              grad_feat.data_ptr<float>(), grad_loc.data_ptr<float>(), grad_weights.data_ptr<float>(),
                              s.batch, s.cams, s.feat, s.embeds, s.scales, s.anchors, s.pts, s.groups);
  return {grad_feat, grad_loc, grad_weights};
}

}  // namespace

TORCH_LIBRARY(lk_sparse4d_baseline, m) {
  m.def("deformable_aggregation_forward(Tensor mc_ms_feat, Tensor spatial_shape, Tensor scale_start_index, "
        "Tensor sampling_location, Tensor weights) -> Tensor");
  m.def("deformable_aggregation_backward(Tensor mc_ms_feat, Tensor spatial_shape, Tensor scale_start_index, "
        "Tensor sampling_location, Tensor weights, Tensor grad_output) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lk_sparse4d_baseline, CUDA, m) {
  m.impl("deformable_aggregation_forward", &forward);
  m.impl("deformable_aggregation_backward", &backward);
}
