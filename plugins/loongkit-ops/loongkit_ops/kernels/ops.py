"""The ``loongkit::*`` torch.library custom ops, with fake (meta) impls and autograd.

Each op picks its backend per call: the compiled C++ kernel for float32/float64 CPU tensors, the
Triton kernel for CUDA tensors (when triton imports), otherwise the reference implementation
(:mod:`loongkit_ops.kernels.reference`, same maths in plain torch), so an op never fails because a
kernel is missing. :func:`msda_backend` / :func:`dice_backend` say which one a tensor gets, and why.

Being custom ops (not autograd.Functions), they are opaque single nodes to torch.compile: dynamo and
AOTAutograd trace them through their fake impls, without graph breaks.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from loongkit_ops import kernels
from loongkit_ops.kernels import reference

_CPU_DTYPES = (torch.float32, torch.float64)
_GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@functools.lru_cache(maxsize=1)
def _triton_msda() -> Any:
    from loongkit_ops.kernels.triton import available

    if not available():
        return None
    try:
        from loongkit_ops.kernels.triton import msda
    except Exception as exc:  # a broken triton install: keep the reference path
        kernels.build.log.warning("triton kernels unavailable", reason=f"{type(exc).__name__}: {exc}")
        return None
    return msda


def msda_backend(value: Tensor) -> tuple[str, str]:
    """(backend, reason) for a value tensor: 'cpu', 'triton' or 'reference'."""
    if value.device.type == "cpu":
        if value.dtype not in _CPU_DTYPES:
            return "reference", f"CPU kernel takes float32/float64, not {value.dtype}"
        if kernels.load() is None:
            return "reference", f"CPU kernel unavailable: {kernels.failure()}"
        return "cpu", ""
    if value.device.type == "cuda":
        if value.dtype not in _GPU_DTYPES:
            return "reference", f"Triton kernel does not take {value.dtype}"
        if _triton_msda() is None:
            return "reference", "triton is not installed"
        return "triton", ""
    return "reference", f"no kernel for device {value.device.type}"


def _index_args(spatial_shapes: Tensor, level_start_index: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    return (spatial_shapes.to(device=device, dtype=torch.int64).contiguous(),
            level_start_index.to(device=device, dtype=torch.int64).contiguous())


# ------------------------------------------------------------------------------------------------
# Multi-scale deformable attention


@torch.library.custom_op("loongkit::ms_deform_attn", mutates_args=())
def ms_deform_attn_op(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                      sampling_locations: Tensor, attention_weights: Tensor) -> Tensor:
    """[bs, Lq, heads*C] from value [bs, K, heads, C] (mmcv's MultiScaleDeformableAttnFunction maths)."""
    backend, _ = msda_backend(value)
    if backend == "reference":
        return reference.ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                                        attention_weights)
    value, loc, attn = value.contiguous(), sampling_locations.contiguous(), attention_weights.contiguous()
    shapes, starts = _index_args(spatial_shapes, level_start_index, value.device)
    if backend == "triton":
        return _triton_msda().forward(value, shapes, starts, loc, attn)
    bs, _, heads, c = value.shape
    out = value.new_empty(bs, loc.shape[1], heads * c)
    kernels.load().msda_forward(value, shapes, starts, loc, attn, out)
    return out


@ms_deform_attn_op.register_fake
def _(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_locations: Tensor,
      attention_weights: Tensor) -> Tensor:
    torch._check(value.dim() == 4 and sampling_locations.dim() == 6 and attention_weights.dim() == 5)
    bs, _, heads, c = value.shape
    return value.new_empty(bs, sampling_locations.shape[1], heads * c)


@torch.library.custom_op("loongkit::ms_deform_attn_backward", mutates_args=())
def ms_deform_attn_backward_op(grad_output: Tensor, value: Tensor, spatial_shapes: Tensor,
                               level_start_index: Tensor, sampling_locations: Tensor,
                               attention_weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_value, grad_sampling_locations, grad_attention_weights)."""
    backend, _ = msda_backend(value)
    if backend == "reference":
        # torch.func.vjp, not enable_grad + autograd.grad: an op's impl runs below the Autograd key.
        _, vjp = torch.func.vjp(
            lambda v, lc, a: reference.ms_deform_attn(v, spatial_shapes, level_start_index, lc, a),
            value, sampling_locations, attention_weights)
        return tuple(g.contiguous() for g in vjp(grad_output))  # type: ignore[return-value]
    value, loc, attn = value.contiguous(), sampling_locations.contiguous(), attention_weights.contiguous()
    grad_output = grad_output.contiguous()
    shapes, starts = _index_args(spatial_shapes, level_start_index, value.device)
    if backend == "triton":
        return _triton_msda().backward(grad_output, value, shapes, starts, loc, attn)
    grad_value = torch.zeros_like(value)
    grad_loc = torch.empty_like(loc)
    grad_attn = torch.empty_like(attn)
    kernels.load().msda_backward(value, shapes, starts, loc, attn, grad_output, grad_value, grad_loc, grad_attn)
    return grad_value, grad_loc, grad_attn


@ms_deform_attn_backward_op.register_fake
def _(grad_output: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
      sampling_locations: Tensor, attention_weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(value), torch.empty_like(sampling_locations), torch.empty_like(attention_weights)


def _msda_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _msda_backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
    value, shapes, starts, loc, attn = ctx.saved_tensors
    grad_value, grad_loc, grad_attn = ms_deform_attn_backward_op(grad_output, value, shapes, starts, loc, attn)
    return grad_value, None, None, grad_loc, grad_attn


ms_deform_attn_op.register_autograd(_msda_backward, setup_context=_msda_setup_context)


def multi_scale_deformable_attn(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                                sampling_locations: Tensor, attention_weights: Tensor) -> Tensor:
    """The op with mmcv's input conventions: locations and weights are cast to value's dtype (amp)."""
    return ms_deform_attn_op(value, spatial_shapes, level_start_index, sampling_locations.to(value.dtype),
                             attention_weights.to(value.dtype))


# ------------------------------------------------------------------------------------------------
# Dice loss statistics (mmseg >= 1.1 DiceLoss)

ACTIVATIONS = {"none": 0, "sigmoid": 1, "softmax": 2}


def dice_backend(logits: Tensor) -> tuple[str, str]:
    """(backend, reason): 'cpu' or 'reference' (the GPU path is plain torch)."""
    if logits.device.type != "cpu":
        return "reference", f"no fused Dice kernel for device {logits.device.type}"
    if logits.dtype not in _CPU_DTYPES:
        return "reference", f"CPU kernel takes float32/float64, not {logits.dtype}"
    if kernels.load() is None:
        return "reference", f"CPU kernel unavailable: {kernels.failure()}"
    return "cpu", ""


@torch.library.custom_op("loongkit::dice_stats", mutates_args=())
def dice_stats_op(logits: Tensor, target: Tensor, activation: int, drop_class: int, naive: bool) -> Tensor:
    """[N, 3] per-sample (sum p*t, sum p^2 | sum p, sum t^2) of logits [N, C, S] and labels [N, S]."""
    if dice_backend(logits)[0] == "reference":
        return reference.dice_stats(logits, target, activation, drop_class, naive)
    stats = logits.new_empty(logits.shape[0], 3)
    kernels.load().dice_stats_forward(logits.contiguous(), target.to(torch.int64).contiguous(), activation,
                                      drop_class, naive, stats)
    return stats


@dice_stats_op.register_fake
def _(logits: Tensor, target: Tensor, activation: int, drop_class: int, naive: bool) -> Tensor:
    torch._check(logits.dim() == 3 and target.dim() == 2)
    return logits.new_empty(logits.shape[0], 3)


@torch.library.custom_op("loongkit::dice_stats_backward", mutates_args=())
def dice_stats_backward_op(grad_stats: Tensor, logits: Tensor, target: Tensor, activation: int, drop_class: int,
                           naive: bool) -> Tensor:
    if dice_backend(logits)[0] == "reference":
        _, vjp = torch.func.vjp(lambda x: reference.dice_stats(x, target, activation, drop_class, naive), logits)
        return vjp(grad_stats)[0].contiguous()
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    kernels.load().dice_stats_backward(logits.contiguous(), target.to(torch.int64).contiguous(), activation,
                                       drop_class, naive, grad_stats.contiguous(), grad)
    return grad


@dice_stats_backward_op.register_fake
def _(grad_stats: Tensor, logits: Tensor, target: Tensor, activation: int, drop_class: int, naive: bool) -> Tensor:
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _dice_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    logits, target, activation, drop_class, naive = inputs
    ctx.save_for_backward(logits, target)
    ctx.args = (activation, drop_class, naive)


def _dice_backward(ctx: Any, grad_stats: Tensor) -> tuple[Tensor | None, ...]:
    logits, target = ctx.saved_tensors
    grad = dice_stats_backward_op(grad_stats, logits, target, *ctx.args)
    return grad, None, None, None, None


dice_stats_op.register_autograd(_dice_backward, setup_context=_dice_setup_context)
