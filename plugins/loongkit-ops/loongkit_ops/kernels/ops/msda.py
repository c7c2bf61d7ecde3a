"""``loongkit::ms_deform_attn``: multi-scale deformable attention (mmcv's MultiScaleDeformableAttnFunction).

value [bs, K, heads, C]; sampling_locations [bs, Lq, heads, L, P, 2] as (x, y) in [0, 1];
attention_weights [bs, Lq, heads, L, P] -> [bs, Lq, heads*C]. Kernels: ``cpu/msda.cpp``,
``triton/msda.py``; :func:`reference` otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from loongkit_ops import kernels
from loongkit_ops.kernels.ops import dispatch


def backend(value: Tensor) -> tuple[str, str]:
    """('cpu' | 'triton' | 'reference', why) for a call on ``value``."""
    return dispatch.backend(value, "deformable attention", triton_module="msda")


def reference(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_locations: Tensor,
              attention_weights: Tensor) -> Tensor:
    """Multi-scale deformable attention by explicit gathers of the four bilinear corners.

    Written from the algorithm (not from upstream code); differentiable with plain autograd, in
    whatever dtype it is given (tests pass float64). Pixel coordinate of u on an axis of size S is
    u*S - 0.5 (align_corners=False); corners outside the map contribute zero.
    """
    bs, _, heads, C = value.shape
    _, Lq, _, _, P, _ = sampling_locations.shape
    shapes = [(int(h), int(w)) for h, w in dispatch.host_list(spatial_shapes)]
    starts = [int(s) for s in dispatch.host_list(level_start_index)]
    out = value.new_zeros(bs, Lq, heads, C)
    by_head = value.permute(0, 2, 1, 3)  # [bs, heads, K, C]
    for level, (h_l, w_l) in enumerate(shapes):
        v = by_head[:, :, starts[level]:starts[level] + h_l * w_l]
        x = sampling_locations[:, :, :, level, :, 0] * w_l - 0.5  # [bs, Lq, heads, P]
        y = sampling_locations[:, :, :, level, :, 1] * h_l - 0.5
        x0, y0 = torch.floor(x).detach(), torch.floor(y).detach()
        a = attention_weights[:, :, :, level]
        for dy in (0.0, 1.0):
            for dx in (0.0, 1.0):
                xi, yi = x0 + dx, y0 + dy
                weight = (1 - (x - xi).abs()) * (1 - (y - yi).abs())
                inside = (xi >= 0) & (xi < w_l) & (yi >= 0) & (yi < h_l)
                index = (yi.clamp(0, h_l - 1) * w_l + xi.clamp(0, w_l - 1)).long()  # [bs, Lq, heads, P]
                index = index.permute(0, 2, 1, 3).reshape(bs, heads, Lq * P, 1).expand(-1, -1, -1, C)
                corner = torch.gather(v, 2, index).reshape(bs, heads, Lq, P, C).permute(0, 2, 1, 3, 4)
                coeff = (a * weight * inside)[..., None]
                out = out + (coeff * corner).sum(3)
    return out.reshape(bs, Lq, heads * C)


@dispatch.custom_op("loongkit::ms_deform_attn")
def op(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_locations: Tensor,
       attention_weights: Tensor) -> Tensor:
    """[bs, Lq, heads*C] from value [bs, K, heads, C] (mmcv's MultiScaleDeformableAttnFunction maths)."""
    which, _ = backend(value)
    if which == "reference":
        return reference(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    value, loc, attn = value.contiguous(), sampling_locations.contiguous(), attention_weights.contiguous()
    shapes, starts = dispatch.index_args(spatial_shapes, level_start_index, value.device)
    if which == "triton":
        return dispatch.triton("msda").forward(value, shapes, starts, loc, attn)
    bs, _, heads, c = value.shape
    out = value.new_empty(bs, loc.shape[1], heads * c)
    kernels.load().msda_forward(value, shapes, starts, loc, attn, out)
    return out


@op.register_fake
def _(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_locations: Tensor,
      attention_weights: Tensor) -> Tensor:
    torch._check(value.dim() == 4 and sampling_locations.dim() == 6 and attention_weights.dim() == 5)
    bs, _, heads, c = value.shape
    return value.new_empty(bs, sampling_locations.shape[1], heads * c)


@dispatch.custom_op("loongkit::ms_deform_attn_backward")
def backward_op(grad_output: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                sampling_locations: Tensor, attention_weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_value, grad_sampling_locations, grad_attention_weights)."""
    which, _ = backend(value)
    if which == "reference":
        # torch.func.vjp, not enable_grad + autograd.grad: an op's impl runs below the Autograd key.
        _, vjp = torch.func.vjp(lambda v, lc, a: reference(v, spatial_shapes, level_start_index, lc, a),
                                value, sampling_locations, attention_weights)
        return tuple(g.contiguous() for g in vjp(grad_output))  # type: ignore[return-value]
    value, loc, attn = value.contiguous(), sampling_locations.contiguous(), attention_weights.contiguous()
    grad_output = grad_output.contiguous()
    shapes, starts = dispatch.index_args(spatial_shapes, level_start_index, value.device)
    if which == "triton":
        return dispatch.triton("msda").backward(grad_output, value, shapes, starts, loc, attn)
    grad_value = torch.zeros_like(value)
    grad_loc = torch.empty_like(loc)
    grad_attn = torch.empty_like(attn)
    kernels.load().msda_backward(value, shapes, starts, loc, attn, grad_output, grad_value, grad_loc, grad_attn)
    return grad_value, grad_loc, grad_attn


@backward_op.register_fake
def _(grad_output: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
      sampling_locations: Tensor, attention_weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(value), torch.empty_like(sampling_locations), torch.empty_like(attention_weights)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
    value, shapes, starts, loc, attn = ctx.saved_tensors
    grad_value, grad_loc, grad_attn = backward_op(grad_output, value, shapes, starts, loc, attn)
    return grad_value, None, None, grad_loc, grad_attn


op.register_autograd(_backward, setup_context=_setup_context)


def multi_scale_deformable_attn(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                                sampling_locations: Tensor, attention_weights: Tensor) -> Tensor:
    """The op with mmcv's input conventions: locations and weights are cast to value's dtype (amp)."""
    return op(value, spatial_shapes, level_start_index, sampling_locations.to(value.dtype),
              attention_weights.to(value.dtype))
