// Entry points of loongkit-ops' CPU kernels (defined in msda.cpp, dice.cpp, daf.cpp and bev_pool.cpp,
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

// Per-sample sums of mmseg 1.x DiceLoss: stats[n] = (sum p*t, sum p*p (or p if naive), sum t*t).
void dice_stats_forward(const at::Tensor& logits, const at::Tensor& target, int64_t activation,
                        int64_t drop_class, bool naive, at::Tensor& stats);
void dice_stats_backward(const at::Tensor& logits, const at::Tensor& target, int64_t activation,
                         int64_t drop_class, bool naive, const at::Tensor& grad_stats, at::Tensor& grad_logits);

// Deformable aggregation: out [bs, anchors, C] from mc_ms_feat [bs, num_feat, C]; spatial_shape int64
// [cams, levels, 2], scale_start int64 [cams, levels], loc [bs, anchors, pts, cams, 2], weights
// [bs, anchors, pts, cams, levels, groups]. inside_only: samples not strictly inside (0, 1) are dropped.
void daf_forward(const at::Tensor& mc_ms_feat, const at::Tensor& spatial_shape, const at::Tensor& scale_start,
                 const at::Tensor& loc, const at::Tensor& weights, bool inside_only, at::Tensor& out);

// grad_feat must be zero on entry; grad_loc and grad_weights are fully written.
void daf_backward(const at::Tensor& mc_ms_feat, const at::Tensor& spatial_shape, const at::Tensor& scale_start,
                  const at::Tensor& loc, const at::Tensor& weights, bool inside_only, const at::Tensor& grad_out,
                  at::Tensor& grad_feat, at::Tensor& grad_loc, at::Tensor& grad_weights);

// BEV pooling: out [B, Z, X, Y, C] (channel-last, fully written) = per-voxel sums of feats [N, C] at
// coords int64 [N, 4] (x, y, z, batch); out-of-grid points are dropped. Backward: grad_feats [N, C]
// gathered from grad_out [B, Z, X, Y, C] (zero for dropped points).
void bev_pool_forward(const at::Tensor& feats, const at::Tensor& coords, int64_t B, int64_t Z, int64_t X, int64_t Y,
                      at::Tensor& out);
void bev_pool_backward(const at::Tensor& grad_out, const at::Tensor& coords, int64_t B, int64_t Z, int64_t X,
                       int64_t Y, at::Tensor& grad_feats);

}  // namespace loongkit
