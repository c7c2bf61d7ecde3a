// Entry points of loongkit-ops' CPU kernels (defined in the *.cpp beside this file). Every function
// declared at the top level of the namespace below is in the library's table (what Python sees), and
// every *.cpp is compiled once per instruction set into loongkit::<isa>: loongkit_core.kernelbuild
// generates both. lk::View is a strided array handed over by loongkit_core.kernels (no libtorch types:
// see loongkit/kernel.h).
// Callers (the op modules in kernels/ops/) pass contiguous tensors of one floating dtype (float or double) and
// preallocated outputs; argument shapes are checked here once more because a wrong shape would
// read out of bounds.
#pragma once

#include <loongkit/kernel.h>

namespace loongkit::LK_ISA {

using lk::View;

// out [bs, Lq, heads*C] = sum over levels and points of weight * bilinear(value, location).
void msda_forward(const View& value, const View& spatial_shapes, const View& level_start,
                  const View& loc, const View& attn, const View& out);

// grad_value must be zero on entry; grad_loc and grad_attn are fully written.
void msda_backward(const View& value, const View& spatial_shapes, const View& level_start,
                   const View& loc, const View& attn, const View& grad_out,
                   const View& grad_value, const View& grad_loc, const View& grad_attn);

// Fused deformable attention (BEVFormer's TSA / MSDeformableAttention3D): out [NQ, Q, heads*C] = mean over
// t < queue of sum over levels and points of softmax(logits)[...] * bilinear(value[n*queue + t], loc), loc =
// ref[n*queue + t, q, per_level ? l : p % R] + offset / (W_l, H_l). value [NQ*queue, K, heads, C], ref
// [NQ*queue, Q, R, 2] contiguous; proj [NQ, Q, heads*queue*L*P*3] = [offsets (x, y) | logits] per (head,
// queue entry, level, point), unit stride in the last dim (any row strides).
void msda_fused_forward(const View& value, const View& spatial_shapes, const View& level_start,
                        const View& ref, const View& proj, bool per_level, int64_t queue, const View& out);

// grad_value (any contents on entry) and grad_proj (contiguous, proj's sizes) are fully written.
void msda_fused_backward(const View& value, const View& spatial_shapes, const View& level_start,
                         const View& ref, const View& proj, bool per_level, int64_t queue,
                         const View& grad_out, const View& grad_value, const View& grad_proj);

// Per-sample sums of mmseg 1.x DiceLoss: stats[n] = (sum p*t, sum p*p (or p if naive), sum t*t).
void dice_stats_forward(const View& logits, const View& target, int64_t activation,
                        int64_t drop_class, bool naive, const View& stats);
void dice_stats_backward(const View& logits, const View& target, int64_t activation,
                         int64_t drop_class, bool naive, const View& grad_stats, const View& grad_logits);

// Per-(sample, class) sums of mmseg 0.x DiceLoss (softmax): stats [N, C, 3] = (sum p*t*valid, sum p^e,
// sum t^e) with t the one-hot of clamp(label, 0, C-1) and valid = label != ignore_index; exponent > 0.
void dice_class_stats_forward(const View& logits, const View& target, int64_t ignore_index,
                              double exponent, const View& stats);
void dice_class_stats_backward(const View& logits, const View& target, int64_t ignore_index,
                               double exponent, const View& grad_stats, const View& grad_logits);

// Deformable aggregation: out [bs, anchors, C] from mc_ms_feat [bs, num_feat, C]; spatial_shape int64
// [cams, levels, 2], scale_start int64 [cams, levels], loc [bs, anchors, pts, cams, 2], weights
// [bs, anchors, pts, cams, levels, groups]. inside_only: samples not strictly inside (0, 1) are dropped.
void daf_forward(const View& mc_ms_feat, const View& spatial_shape, const View& scale_start,
                 const View& loc, const View& weights, bool inside_only, const View& out);

// grad_feat must be zero on entry; grad_loc and grad_weights are fully written.
void daf_backward(const View& mc_ms_feat, const View& spatial_shape, const View& scale_start,
                  const View& loc, const View& weights, bool inside_only, const View& grad_out,
                  const View& grad_feat, const View& grad_loc, const View& grad_weights);

// BEV pooling: out [B, C, Z, X, Y] (BEVFusion's layout, fully written) = per-voxel sums of feats [N, C]
// at coords int64 [N, 4] (x, y, z, batch); out-of-grid points are dropped. Backward: grad_feats [N, C]
// gathered from grad_out [B, C, Z, X, Y] (zero for dropped points).
void bev_pool_forward(const View& feats, const View& coords, int64_t B, int64_t Z, int64_t X, int64_t Y,
                      const View& out);
void bev_pool_backward(const View& grad_out, const View& coords, int64_t B, int64_t Z, int64_t X,
                       int64_t Y, const View& grad_feats);

// mmcv hard_voxelize (deterministic) on CPU, in two calls because the number of voxels M is known
// only after the sequential pass: hard_voxelize_plan returns a plan (an opaque handle: the points
// must stay alive until the fill) and hard_voxelize_voxels(plan) its M; the caller allocates
// voxels [M, max_points, F] (points' dtype), coors int32 [M, 3] and num_points int32 [M], and
// hard_voxelize_fill writes them (zero-padded, coors as (z, y, x)) and frees the plan;
// hard_voxelize_discard frees a plan that will not be filled. Voxel ids in order of each voxel's
// first point, at most max_voxels voxels and max_points points per voxel. voxel_size (3) and
// coors_range (6) are taken as float32 values, as mmcv does.
int64_t hard_voxelize_plan(const View& points, const std::vector<double>& voxel_size,
                           const std::vector<double>& coors_range, int64_t max_points, int64_t max_voxels);
int64_t hard_voxelize_voxels(int64_t plan);
void hard_voxelize_fill(int64_t plan, const View& voxels, const View& coors, const View& num_points);
void hard_voxelize_discard(int64_t plan);
// mmcv dynamic_voxelize into coors int32 [N, 3] (z, y, x) per point, -1 rows for points outside the range.
void dynamic_voxelize_into(const View& points, const std::vector<double>& voxel_size,
                      const std::vector<double>& coors_range, const View& coors);

}  // namespace loongkit::LK_ISA
