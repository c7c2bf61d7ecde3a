"""``loongkit::ms_deform_attn_fused``: BEVFormer's TemporalSelfAttention / MSDeformableAttention3D sampling
from the raw query projections, softmax, locations, sampling and the BEV-queue mean in one op.

Kernels: ``cpu/msda.cpp`` (msda_fused_*), ``triton/msda_fused.py``; :func:`reference` otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from loongkit_ops import kernels
from loongkit_ops.kernels.ops import dispatch, msda


def backend(value: Tensor) -> tuple[str, str]:
    """msda's choice, with 'reference' should the fused Triton module alone fail to import."""
    which, why = msda.backend(value)
    if which == "triton" and dispatch.triton("msda_fused") is None:
        return "reference", "the fused Triton kernel did not import"
    return which, why


def reference(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, reference_points: Tensor,
              projection: Tensor, per_level: bool, queue: int,
              sample: Callable[..., Tensor] = msda.reference) -> Tensor:
    """The maths in plain torch, sampling with ``sample`` (:func:`msda.reference`; benchmarks pass the op).

    value [NQ*queue, K, heads, C]; reference_points [NQ*queue, Q, R, 2]; projection [NQ, Q,
    heads*queue*L*P*3] = [sampling offsets | attention logits] as the modules' two query projections
    output them. Weights are the softmax of the logits over (L, P); the location of (level l, point p)
    is the reference point ``l`` (per_level) or ``p % R`` plus offset / (W_l, H_l). Returns the mean
    over the queue of the sampled sums of query batch n from value batches n*queue + t: [NQ, Q, heads*C].
    """
    nv, _, heads, c = value.shape
    nq, q = projection.shape[:2]
    levels = spatial_shapes.shape[0]
    points = projection.shape[2] // (heads * queue * levels * 3)
    anchors = reference_points.shape[2]
    n_off = heads * queue * levels * points * 2
    off = projection[..., :n_off].reshape(nq, q, heads, queue, levels, points, 2)
    weights = projection[..., n_off:].reshape(nq, q, heads, queue, levels * points).softmax(-1)
    shapes = spatial_shapes.to(device=value.device, dtype=torch.int64)
    off = off / torch.stack([shapes[:, 1], shapes[:, 0]], -1).to(value.dtype)[:, None, :]
    ref = reference_points.reshape(nq, queue, q, anchors, 2).permute(0, 2, 1, 3, 4)  # [NQ, Q, queue, R, 2]
    if per_level:
        loc = ref[:, :, None, :, :, None, :] + off
    else:
        loc = ref[:, :, None, :, None, None] + off.reshape(nq, q, heads, queue, levels, points // anchors, anchors, 2)
    loc = loc.reshape(nq, q, heads, queue, levels, points, 2).permute(0, 3, 1, 2, 4, 5, 6)
    weights = weights.reshape(nq, q, heads, queue, levels, points).permute(0, 3, 1, 2, 4, 5)
    out = sample(value, shapes, level_start_index, loc.reshape(nv, q, heads, levels, points, 2),
                 weights.reshape(nv, q, heads, levels, points))
    return out.reshape(nq, queue, q, heads * c).mean(1)


@dispatch.custom_op("loongkit::ms_deform_attn_fused")
def op(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, reference_points: Tensor,
       projection: Tensor, per_level: bool, queue: int) -> Tensor:
    """[NQ, Q, heads*C] from value [NQ*queue, K, heads, C], reference_points [NQ*queue, Q, R, 2] and the
    query projections' output [NQ, Q, heads*queue*L*P*3] = [sampling offsets | attention logits].

    CPU (C++ kernel) and CUDA (Triton kernel) alike; the fused module forwards of the BEVFormer patches
    still call it on CPU tensors only (on CUDA the modules run their original forward)."""
    which, _ = backend(value)
    if which == "reference":
        return reference(value, spatial_shapes, level_start_index, reference_points, projection, per_level, queue)
    shapes, starts = dispatch.index_args(spatial_shapes, level_start_index, value.device)
    value = value.contiguous()
    proj = projection if projection.stride(-1) == 1 else projection.contiguous()  # rows may be strided
    if which == "triton":
        return dispatch.triton("msda_fused").forward(value, shapes, starts, reference_points.contiguous(), proj,
                                                     per_level, queue)
    out = value.new_empty(value.shape[0] // queue, proj.shape[1], value.shape[2] * value.shape[3])
    kernels.load().msda_fused_forward(value, shapes, starts, reference_points.contiguous(), proj, per_level, queue,
                                      out)
    return out


@op.register_fake
def _(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, reference_points: Tensor,
      projection: Tensor, per_level: bool, queue: int) -> Tensor:
    torch._check(value.dim() == 4 and projection.dim() == 3 and reference_points.dim() == 4)
    return value.new_empty(value.shape[0] // queue, projection.shape[1], value.shape[2] * value.shape[3])


@dispatch.custom_op("loongkit::ms_deform_attn_fused_backward")
def backward_op(grad_output: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                reference_points: Tensor, projection: Tensor, per_level: bool, queue: int) -> tuple[Tensor, Tensor]:
    """(grad_value, grad_projection), both contiguous."""
    which, _ = backend(value)
    if which == "reference":
        _, vjp = torch.func.vjp(
            lambda v, p: reference(v, spatial_shapes, level_start_index, reference_points, p, per_level, queue),
            value, projection)
        return tuple(g.contiguous() for g in vjp(grad_output))  # type: ignore[return-value]
    shapes, starts = dispatch.index_args(spatial_shapes, level_start_index, value.device)
    value = value.contiguous()
    proj = projection if projection.stride(-1) == 1 else projection.contiguous()
    if which == "triton":
        return dispatch.triton("msda_fused").backward(grad_output.contiguous(), value, shapes, starts,
                                                      reference_points.contiguous(), proj, per_level, queue)
    grad_value = torch.empty_like(value)  # the kernel writes all of it
    grad_proj = proj.new_empty(proj.shape)
    kernels.load().msda_fused_backward(value, shapes, starts, reference_points.contiguous(), proj, per_level, queue,
                                       grad_output.contiguous(), grad_value, grad_proj)
    return grad_value, grad_proj


@backward_op.register_fake
def _(grad_output: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
      reference_points: Tensor, projection: Tensor, per_level: bool, queue: int) -> tuple[Tensor, Tensor]:
    return torch.empty_like(value, memory_format=torch.contiguous_format), projection.new_empty(projection.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.per_level, ctx.queue = inputs[5], inputs[6]


def _backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
    value, shapes, starts, ref, proj = ctx.saved_tensors
    grad_value, grad_proj = backward_op(grad_output, value, shapes, starts, ref, proj, ctx.per_level, ctx.queue)
    grad_ref = None
    if ctx.needs_input_grad[3]:  # rare (reference points are usually constants): from the offsets' gradient
        nq, q, _ = grad_proj.shape
        heads, levels, anchors = value.shape[2], shapes.shape[0], ref.shape[2]
        points = grad_proj.shape[2] // (heads * ctx.queue * levels * 3)
        scale = torch.stack([shapes[:, 1], shapes[:, 0]], -1).to(device=value.device, dtype=grad_proj.dtype)
        grad_off = grad_proj[..., :heads * ctx.queue * levels * points * 2]
        grad_loc = grad_off.reshape(nq, q, heads, ctx.queue, levels, points, 2) * scale[:, None, :]
        if ctx.per_level:
            grad_ref = grad_loc.sum((2, 5))
        else:
            grad_ref = grad_loc.view(nq, q, heads, ctx.queue, levels, points // anchors, anchors, 2).sum((2, 4, 5))
        grad_ref = grad_ref.transpose(1, 2).reshape(ref.shape)
    return grad_value, None, None, grad_ref, grad_proj, None, None


op.register_autograd(_backward, setup_context=_setup_context)


def ms_deform_attn_fused(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, reference_points: Tensor,
                         projection: Tensor, per_level: bool, queue: int = 1) -> Tensor:
    """The fused op with the modules' conventions: reference points and projection cast to value's dtype."""
    return op(value, spatial_shapes, level_start_index, reference_points.to(value.dtype), projection.to(value.dtype),
              per_level, queue)
