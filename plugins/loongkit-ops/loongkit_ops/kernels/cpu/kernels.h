// Entry points of loongkit-ops' CPU kernels (defined in msda.cpp and dice.cpp, bound in bindings.cpp).
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

}  // namespace loongkit
