// Entry points of loongkit-ops' CPU kernels (defined in msda.cpp, dice.cpp, daf.cpp, bev_pool.cpp and voxelize.cpp,
// bound in bindings.cpp).
// Callers (kernels/ops.py) pass contiguous tensors of one floating dtype (float or double) and
// preallocated outputs; argument shapes are checked here once more because a wrong shape would
// read out of bounds.
#pragma once

#include <torch/extension.h>

namespace loongkit {

// out [bs, Lq, heads*C] = sum over levels and points of weight * bilinear(value, location).
void msda_forward(const at::Tensor& value, const at::Tensor& spatial_shapes, const at::Tensor& level_start,
                  const at::Tensor& loc, const at::Tensor& attn, at::Tensor& out);

// grad_value must be zero on entry; grad_loc and grad_attn are fully written.
void msda_backward(const at::Tensor& value, const at::Tensor& spatial_shapes, const at::Tensor& level_start,
                   const at::Tensor& loc, const at::Tensor& attn, const at::Tensor& grad_out,
                   at::Tensor& grad_value, at::Tensor& grad_loc, at::Tensor& grad_attn);

// Fused deformable attention (BEVFormer's TSA / MSDeformableAttention3D): out [NQ, Q, heads*C] = mean over
// t < queue of sum over levels and points of softmax(logits)[...] * bilinear(value[n*queue + t], loc), loc =
// ref[n*queue + t, q, per_level ? l : p % R] + offset / (W_l, H_l). value [NQ*queue, K, heads, C], ref
// [NQ*queue, Q, R, 2] contiguous; proj [NQ, Q, heads*queue*L*P*3] = [offsets (x, y) | logits] per (head,
// queue entry, level, point), unit stride in the last dim (any row strides).
void msda_fused_forward(const at::Tensor& value, const at::Tensor& spatial_shapes, const at::Tensor& level_start,
                        const at::Tensor& ref, const at::Tensor& proj, bool per_level, int64_t queue, at::Tensor& out);

// grad_value (any contents on entry) and grad_proj (contiguous, proj's sizes) are fully written.
void msda_fused_backward(const at::Tensor& value, const at::Tensor& spatial_shapes, const at::Tensor& level_start,
                         const at::Tensor& ref, const at::Tensor& proj, bool per_level, int64_t queue,
                         const at::Tensor& grad_out, at::Tensor& grad_value, at::Tensor& grad_proj);

// Per-sample sums of mmseg 1.x DiceLoss: stats[n] = (sum p*t, sum p*p (or p if naive), sum t*t).
void dice_stats_forward(const at::Tensor& logits, const at::Tensor& target, int64_t activation,
                        int64_t drop_class, bool naive, at::Tensor& stats);
void dice_stats_backward(const at::Tensor& logits, const at::Tensor& target, int64_t activation,
                         int64_t drop_class, bool naive, const at::Tensor& grad_stats, at::Tensor& grad_logits);

// Per-(sample, class) sums of mmseg 0.x DiceLoss (softmax): stats [N, C, 3] = (sum p*t*valid, sum p^e,
// sum t^e) with t the one-hot of clamp(label, 0, C-1) and valid = label != ignore_index; exponent > 0.
void dice_class_stats_forward(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                              double exponent, at::Tensor& stats);
void dice_class_stats_backward(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                               double exponent, const at::Tensor& grad_stats, at::Tensor& grad_logits);

// Deformable aggregation: out [bs, anchors, C] from mc_ms_feat [bs, num_feat, C]; spatial_shape int64
// [cams, levels, 2], scale_start int64 [cams, levels], loc [bs, anchors, pts, cams, 2], weights
// [bs, anchors, pts, cams, levels, groups]. inside_only: samples not strictly inside (0, 1) are dropped.
void daf_forward(const at::Tensor& mc_ms_feat, const at::Tensor& spatial_shape, const at::Tensor& scale_start,
                 const at::Tensor& loc, const at::Tensor& weights, bool inside_only, at::Tensor& out);

// grad_feat must be zero on entry; grad_loc and grad_weights are fully written.
void daf_backward(const at::Tensor& mc_ms_feat, const at::Tensor& spatial_shape, const at::Tensor& scale_start,
                  const at::Tensor& loc, const at::Tensor& weights, bool inside_only, const at::Tensor& grad_out,
                  at::Tensor& grad_feat, at::Tensor& grad_loc, at::Tensor& grad_weights);

// BEV pooling: out [B, C, Z, X, Y] (BEVFusion's layout, fully written) = per-voxel sums of feats [N, C]
// at coords int64 [N, 4] (x, y, z, batch); out-of-grid points are dropped. Backward: grad_feats [N, C]
// gathered from grad_out [B, C, Z, X, Y] (zero for dropped points).
void bev_pool_forward(const at::Tensor& feats, const at::Tensor& coords, int64_t B, int64_t Z, int64_t X, int64_t Y,
                      at::Tensor& out);
void bev_pool_backward(const at::Tensor& grad_out, const at::Tensor& coords, int64_t B, int64_t Z, int64_t X,
                       int64_t Y, at::Tensor& grad_feats);

// mmcv hard_voxelize (deterministic) on CPU: (voxels [M, max_points, F] zero-padded, coors int32 [M, 3]
// as (z, y, x), num_points int32 [M]); voxel ids in order of each voxel's first point, at most
// max_voxels voxels and max_points points per voxel. voxel_size (3) and coors_range (6) are taken as
// float32 values, as mmcv does.
std::vector<at::Tensor> hard_voxelize(const at::Tensor& points, const std::vector<double>& voxel_size,
                                      const std::vector<double>& coors_range, int64_t max_points,
                                      int64_t max_voxels);
// mmcv dynamic_voxelize: int32 [N, 3] (z, y, x) per point, -1 rows for points outside the range.
at::Tensor dynamic_voxelize(const at::Tensor& points, const std::vector<double>& voxel_size,
                            const std::vector<double>& coors_range);

}  // namespace loongkit
