"""``loongkit::deformable_aggregation``: Sparse4D / SparseDrive's deformable feature aggregation.

Kernels: ``cpu/daf.cpp``, ``triton/daf.py``; :func:`reference` otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from loongkit_ops import kernels
from loongkit_ops.kernels.ops import dispatch


def backend(mc_ms_feat: Tensor) -> tuple[str, str]:
    """('cpu' | 'triton' | 'reference', why) for a call on ``mc_ms_feat``."""
    return dispatch.backend(mc_ms_feat, "deformable aggregation", triton_module="daf")


def reference(mc_ms_feat: Tensor, spatial_shape: Tensor, scale_start_index: Tensor,
              sampling_location: Tensor, weights: Tensor, inside_only: bool = True) -> Tensor:
    """Sparse4D's deformable aggregation by explicit gathers of the four bilinear corners (written from
    the algorithm; differentiable with plain autograd, any dtype).

    mc_ms_feat [bs, num_feat, C] (camera-major, then level, row-major H*W); spatial_shape [cams,
    levels, 2] as (H, W); scale_start_index [cams, levels]; sampling_location [bs, anchors, pts,
    cams, 2] as (x, y) in [0, 1]; weights [bs, anchors, pts, cams, levels, groups]. Channel c is
    weighted by group c // (C / groups). Pixel coordinate u*S - 0.5, out-of-map corners read zero.
    inside_only: a sample whose x or y is not strictly inside (0, 1) contributes nothing (the
    upstream CUDA kernel's rule); otherwise every location is sampled like grid_sample.
    Returns [bs, anchors, C].
    """
    bs, _, C = mc_ms_feat.shape
    _, A, P, cams, _ = sampling_location.shape
    levels, groups = weights.shape[4], weights.shape[5]
    shapes = [[(int(h), int(w)) for h, w in row] for row in dispatch.host_list(spatial_shape)]
    starts = [[int(s) for s in row] for row in dispatch.host_list(scale_start_index.reshape(cams, levels))]
    x, y = sampling_location[..., 0], sampling_location[..., 1]  # [bs, A, P, cams]
    keep = (x > 0) & (x < 1) & (y > 0) & (y < 1) if inside_only else torch.ones_like(x, dtype=torch.bool)
    out = mc_ms_feat.new_zeros(bs, A, groups, C // groups)
    for cam in range(cams):
        for level in range(levels):
            h_l, w_l = shapes[cam][level]
            fm = mc_ms_feat[:, starts[cam][level]:starts[cam][level] + h_l * w_l]  # [bs, HW, C]
            px = x[..., cam] * w_l - 0.5  # [bs, A, P]
            py = y[..., cam] * h_l - 0.5
            # NaN or far locations never select a corner; their index is clamped only to stay legal.
            x0 = torch.floor(px.detach().nan_to_num(-10).clamp(-10, w_l + 10))
            y0 = torch.floor(py.detach().nan_to_num(-10).clamp(-10, h_l + 10))
            sample = mc_ms_feat.new_zeros(bs, A, P, C)
            for dy in (0.0, 1.0):
                for dx in (0.0, 1.0):
                    xi, yi = x0 + dx, y0 + dy
                    inside = (xi >= 0) & (xi < w_l) & (yi >= 0) & (yi < h_l) & keep[..., cam]
                    weight = torch.where(inside, (1 - (px - xi).abs()) * (1 - (py - yi).abs()), 0.0)
                    index = (yi.clamp(0, h_l - 1) * w_l + xi.clamp(0, w_l - 1)).long().reshape(bs, A * P, 1)
                    corner = torch.gather(fm, 1, index.expand(-1, -1, C)).reshape(bs, A, P, C)
                    sample = sample + weight[..., None] * corner
            w = weights[:, :, :, cam, level]  # [bs, A, P, groups]
            out = out + (sample.reshape(bs, A, P, groups, C // groups) * w[..., None]).sum(2)
    return out.reshape(bs, A, C)


@dispatch.custom_op("loongkit::deformable_aggregation")
def op(mc_ms_feat: Tensor, spatial_shape: Tensor, scale_start_index: Tensor, sampling_location: Tensor,
       weights: Tensor, inside_only: bool) -> Tensor:
    """[bs, anchors, C]: Sparse4D's deformable aggregation (see :func:`reference`)."""
    which, _ = backend(mc_ms_feat)
    if which == "reference":
        return reference(mc_ms_feat, spatial_shape, scale_start_index, sampling_location, weights, inside_only)
    feat, loc, w = mc_ms_feat.contiguous(), sampling_location.contiguous(), weights.contiguous()
    shapes, starts = dispatch.index_args(spatial_shape, scale_start_index, feat.device)
    if which == "triton":
        return dispatch.triton("daf").forward(feat, shapes, starts, loc, w, inside_only)
    out = feat.new_empty(feat.shape[0], loc.shape[1], feat.shape[2])
    kernels.load().daf_forward(feat, shapes, starts, loc, w, inside_only, out)
    return out


@op.register_fake
def _(mc_ms_feat: Tensor, spatial_shape: Tensor, scale_start_index: Tensor, sampling_location: Tensor,
      weights: Tensor, inside_only: bool) -> Tensor:
    torch._check(mc_ms_feat.dim() == 3 and sampling_location.dim() == 5 and weights.dim() == 6)
    return mc_ms_feat.new_empty(mc_ms_feat.shape[0], sampling_location.shape[1], mc_ms_feat.shape[2])


@dispatch.custom_op("loongkit::deformable_aggregation_backward")
def backward_op(grad_output: Tensor, mc_ms_feat: Tensor, spatial_shape: Tensor, scale_start_index: Tensor,
                sampling_location: Tensor, weights: Tensor, inside_only: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_mc_ms_feat, grad_sampling_location, grad_weights)."""
    which, _ = backend(mc_ms_feat)
    if which == "reference":
        _, vjp = torch.func.vjp(lambda f, lc, w: reference(f, spatial_shape, scale_start_index, lc, w, inside_only),
                                mc_ms_feat, sampling_location, weights)
        return tuple(g.contiguous() for g in vjp(grad_output))  # type: ignore[return-value]
    feat, loc, w = mc_ms_feat.contiguous(), sampling_location.contiguous(), weights.contiguous()
    grad_output = grad_output.contiguous()
    shapes, starts = dispatch.index_args(spatial_shape, scale_start_index, feat.device)
    if which == "triton":
        return dispatch.triton("daf").backward(grad_output, feat, shapes, starts, loc, w, inside_only)
    grad_feat = torch.zeros_like(feat)
    grad_loc = torch.empty_like(loc)
    grad_w = torch.empty_like(w)
    kernels.load().daf_backward(feat, shapes, starts, loc, w, inside_only, grad_output, grad_feat, grad_loc, grad_w)
    return grad_feat, grad_loc, grad_w


@backward_op.register_fake
def _(grad_output: Tensor, mc_ms_feat: Tensor, spatial_shape: Tensor, scale_start_index: Tensor,
      sampling_location: Tensor, weights: Tensor, inside_only: bool) -> tuple[Tensor, Tensor, Tensor]:
    return (torch.empty_like(mc_ms_feat, memory_format=torch.contiguous_format),
            torch.empty_like(sampling_location, memory_format=torch.contiguous_format),
            torch.empty_like(weights, memory_format=torch.contiguous_format))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.inside_only = inputs[5]


def _backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
    feat, shapes, starts, loc, w = ctx.saved_tensors
    grad_feat, grad_loc, grad_w = backward_op(grad_output, feat, shapes, starts, loc, w, ctx.inside_only)
    return grad_feat, None, None, grad_loc, grad_w, None


op.register_autograd(_backward, setup_context=_setup_context)


def deformable_aggregation(mc_ms_feat: Tensor, spatial_shape: Tensor, scale_start_index: Tensor,
                           sampling_location: Tensor, weights: Tensor, inside_only: bool = True) -> Tensor:
    """The op with the upstream function's conventions: locations and weights cast to the features' dtype."""
    return op(mc_ms_feat, spatial_shape, scale_start_index, sampling_location.to(mc_ms_feat.dtype),
              weights.to(mc_ms_feat.dtype), inside_only)
