"""The ``loongkit::*`` torch.library custom ops, with fake (meta) impls and autograd.

Each op picks its backend per call: the compiled C++ kernel for float32/float64 CPU tensors (and
float16 points for voxelization), the Triton kernel (``kernels/triton/<op>.py``) for fp16/bf16/fp32/
fp64 CUDA tensors when triton imports, otherwise the reference implementation
(:mod:`loongkit_ops.kernels.reference`, same maths in plain torch), so an op never fails because a
kernel is missing. :func:`msda_backend`, :func:`dice_backend`, :func:`daf_backend`,
:func:`bev_pool_backend` and :func:`voxelize_backend` say which one a tensor gets, and why.

Being custom ops (not autograd.Functions), they are opaque single nodes to torch.compile: dynamo and
AOTAutograd trace them through their fake impls, without graph breaks.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
from torch import Tensor

from loongkit_ops import kernels
from loongkit_ops.kernels import reference

_CPU_DTYPES = (torch.float32, torch.float64)
_GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@functools.cache
def _triton(name: str) -> Any:
    """The Triton module ``kernels.triton.<name>``, or None (no triton, or a broken install)."""
    from loongkit_ops.kernels.triton import available

    if not available():
        return None
    try:
        return importlib.import_module(f"loongkit_ops.kernels.triton.{name}")
    except Exception as exc:  # a broken triton install: keep the reference path
        kernels.build.log.warning("triton kernels unavailable", reason=f"{type(exc).__name__}: {exc}")
        return None


def _backend(t: Tensor, kernel: str, cpu_dtypes: tuple[torch.dtype, ...] = _CPU_DTYPES,
             triton: str | None = None) -> tuple[str, str]:
    """(backend, reason) for an op's main tensor: 'cpu', 'triton' or 'reference' (with why)."""
    if t.device.type == "cpu":
        if t.dtype not in cpu_dtypes:
            names = "/".join(str(d).removeprefix("torch.") for d in cpu_dtypes)
            return "reference", f"CPU kernel takes {names}, not {t.dtype}"
        if kernels.load() is None:
            return "reference", f"CPU kernel unavailable: {kernels.failure()}"
        return "cpu", ""
    if t.device.type == "cuda" and triton is not None:
        if t.dtype not in _GPU_DTYPES:
            return "reference", f"Triton kernel does not take {t.dtype}"
        if _triton(triton) is None:
            return "reference", "triton is not installed"
        return "triton", ""
    return "reference", f"no {kernel} kernel for device {t.device.type}"


def msda_backend(value: Tensor) -> tuple[str, str]:
    return _backend(value, "deformable attention", triton="msda")


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
        return _triton("msda").forward(value, shapes, starts, loc, attn)
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
        return _triton("msda").backward(grad_output, value, shapes, starts, loc, attn)
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


# BEVFormer's TemporalSelfAttention / MSDeformableAttention3D: softmax, locations and the mean over the
# [previous, current] BEV queue inside the kernel (see reference.ms_deform_attn_fused for the maths).
# Backends as for ms_deform_attn: the C++ kernel on CPU, kernels/triton/msda_fused.py on CUDA tensors,
# the reference otherwise.


def _msda_fused_backend(value: Tensor) -> str:
    """msda_backend's choice, with 'reference' should the fused Triton module alone fail to import."""
    backend = msda_backend(value)[0]
    return "reference" if backend == "triton" and _triton("msda_fused") is None else backend


@torch.library.custom_op("loongkit::ms_deform_attn_fused", mutates_args=())
def ms_deform_attn_fused_op(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                            reference_points: Tensor, projection: Tensor, per_level: bool, queue: int) -> Tensor:
    """[NQ, Q, heads*C] from value [NQ*queue, K, heads, C], reference_points [NQ*queue, Q, R, 2] and the
    query projections' output [NQ, Q, heads*queue*L*P*3] = [sampling offsets | attention logits].

    CPU (C++ kernel) and CUDA (Triton kernel) alike; the fused module forwards of patches/bevformer.py
    still call it on CPU tensors only (on CUDA the modules run their original forward)."""
    backend = _msda_fused_backend(value)
    if backend == "reference":
        return reference.ms_deform_attn_fused(value, spatial_shapes, level_start_index, reference_points, projection,
                                              per_level, queue)
    shapes, starts = _index_args(spatial_shapes, level_start_index, value.device)
    value = value.contiguous()
    proj = projection if projection.stride(-1) == 1 else projection.contiguous()  # rows may be strided
    if backend == "triton":
        return _triton("msda_fused").forward(value, shapes, starts, reference_points.contiguous(), proj, per_level,
                                             queue)
    out = value.new_empty(value.shape[0] // queue, proj.shape[1], value.shape[2] * value.shape[3])
    kernels.load().msda_fused_forward(value, shapes, starts, reference_points.contiguous(), proj, per_level, queue,
                                      out)
    return out


@ms_deform_attn_fused_op.register_fake
def _(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, reference_points: Tensor,
      projection: Tensor, per_level: bool, queue: int) -> Tensor:
    torch._check(value.dim() == 4 and projection.dim() == 3 and reference_points.dim() == 4)
    return value.new_empty(value.shape[0] // queue, projection.shape[1], value.shape[2] * value.shape[3])


@torch.library.custom_op("loongkit::ms_deform_attn_fused_backward", mutates_args=())
def ms_deform_attn_fused_backward_op(grad_output: Tensor, value: Tensor, spatial_shapes: Tensor,
                                     level_start_index: Tensor, reference_points: Tensor, projection: Tensor,
                                     per_level: bool, queue: int) -> tuple[Tensor, Tensor]:
    """(grad_value, grad_projection), both contiguous."""
    backend = _msda_fused_backend(value)
    if backend == "reference":
        _, vjp = torch.func.vjp(
            lambda v, p: reference.ms_deform_attn_fused(v, spatial_shapes, level_start_index, reference_points, p,
                                                        per_level, queue), value, projection)
        return tuple(g.contiguous() for g in vjp(grad_output))  # type: ignore[return-value]
    shapes, starts = _index_args(spatial_shapes, level_start_index, value.device)
    value = value.contiguous()
    proj = projection if projection.stride(-1) == 1 else projection.contiguous()
    if backend == "triton":
        return _triton("msda_fused").backward(grad_output.contiguous(), value, shapes, starts,
                                              reference_points.contiguous(), proj, per_level, queue)
    grad_value = torch.empty_like(value)  # the kernel writes all of it
    grad_proj = proj.new_empty(proj.shape)
    kernels.load().msda_fused_backward(value, shapes, starts, reference_points.contiguous(), proj, per_level, queue,
                                       grad_output.contiguous(), grad_value, grad_proj)
    return grad_value, grad_proj


@ms_deform_attn_fused_backward_op.register_fake
def _(grad_output: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
      reference_points: Tensor, projection: Tensor, per_level: bool, queue: int) -> tuple[Tensor, Tensor]:
    return torch.empty_like(value, memory_format=torch.contiguous_format), projection.new_empty(projection.shape)


def _msda_fused_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.per_level, ctx.queue = inputs[5], inputs[6]


def _msda_fused_backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
    value, shapes, starts, ref, proj = ctx.saved_tensors
    grad_value, grad_proj = ms_deform_attn_fused_backward_op(grad_output, value, shapes, starts, ref, proj,
                                                             ctx.per_level, ctx.queue)
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


ms_deform_attn_fused_op.register_autograd(_msda_fused_backward, setup_context=_msda_fused_setup_context)


def ms_deform_attn_fused(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, reference_points: Tensor,
                         projection: Tensor, per_level: bool, queue: int = 1) -> Tensor:
    """The fused op with the modules' conventions: reference points and projection cast to value's dtype."""
    return ms_deform_attn_fused_op(value, spatial_shapes, level_start_index, reference_points.to(value.dtype),
                                   projection.to(value.dtype), per_level, queue)


# ------------------------------------------------------------------------------------------------
# Dice loss statistics (mmseg >= 1.1 DiceLoss)

ACTIVATIONS = {"none": 0, "sigmoid": 1, "softmax": 2}


def dice_backend(logits: Tensor) -> tuple[str, str]:
    """'cpu' (C++ kernel), 'triton' (CUDA tensors, kernels/triton/dice.py) or 'reference' (plain torch)."""
    return _backend(logits, "fused Dice", triton="dice")


@torch.library.custom_op("loongkit::dice_stats", mutates_args=())
def dice_stats_op(logits: Tensor, target: Tensor, activation: int, drop_class: int, naive: bool) -> Tensor:
    """[N, 3] per-sample (sum p*t, sum p^2 | sum p, sum t^2) of logits [N, C, S] and labels [N, S]."""
    backend, _ = dice_backend(logits)
    if backend == "reference":
        return reference.dice_stats(logits, target, activation, drop_class, naive)
    if backend == "triton":
        return _triton("dice").stats_forward(logits.contiguous(), target.to(torch.int64).contiguous(), activation,
                                             drop_class, naive)
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
    backend, _ = dice_backend(logits)
    if backend == "reference":
        _, vjp = torch.func.vjp(lambda x: reference.dice_stats(x, target, activation, drop_class, naive), logits)
        return vjp(grad_stats)[0].contiguous()
    if backend == "triton":
        return _triton("dice").stats_backward(grad_stats.contiguous(), logits.contiguous(),
                                              target.to(torch.int64).contiguous(), activation, drop_class, naive)
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


# ------------------------------------------------------------------------------------------------
# Dice loss statistics per class (mmseg 0.x DiceLoss)


@torch.library.custom_op("loongkit::dice_class_stats", mutates_args=())
def dice_class_stats_op(logits: Tensor, target: Tensor, ignore_index: int, exponent: float) -> Tensor:
    """[N, C, 3] per-(sample, class) (sum p*t*valid, sum p^e, sum t^e) of logits [N, C, S] and labels [N, S]."""
    backend, _ = dice_backend(logits)
    if backend == "reference":
        return reference.dice_class_stats(logits, target, ignore_index, exponent)
    if backend == "triton":
        return _triton("dice").class_stats_forward(logits.contiguous(), target.to(torch.int64).contiguous(),
                                                   ignore_index, exponent)
    stats = logits.new_empty(logits.shape[0], logits.shape[1], 3)
    kernels.load().dice_class_stats_forward(logits.contiguous(), target.to(torch.int64).contiguous(), ignore_index,
                                            exponent, stats)
    return stats


@dice_class_stats_op.register_fake
def _(logits: Tensor, target: Tensor, ignore_index: int, exponent: float) -> Tensor:
    torch._check(logits.dim() == 3 and target.dim() == 2)
    return logits.new_empty(logits.shape[0], logits.shape[1], 3)


@torch.library.custom_op("loongkit::dice_class_stats_backward", mutates_args=())
def dice_class_stats_backward_op(grad_stats: Tensor, logits: Tensor, target: Tensor, ignore_index: int,
                                 exponent: float) -> Tensor:
    backend, _ = dice_backend(logits)
    if backend == "reference":
        _, vjp = torch.func.vjp(lambda x: reference.dice_class_stats(x, target, ignore_index, exponent), logits)
        return vjp(grad_stats)[0].contiguous()
    if backend == "triton":
        return _triton("dice").class_stats_backward(grad_stats.contiguous(), logits.contiguous(),
                                                    target.to(torch.int64).contiguous(), ignore_index, exponent)
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    kernels.load().dice_class_stats_backward(logits.contiguous(), target.to(torch.int64).contiguous(), ignore_index,
                                             exponent, grad_stats.contiguous(), grad)
    return grad


@dice_class_stats_backward_op.register_fake
def _(grad_stats: Tensor, logits: Tensor, target: Tensor, ignore_index: int, exponent: float) -> Tensor:
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _dice_class_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    logits, target, ignore_index, exponent = inputs
    ctx.save_for_backward(logits, target)
    ctx.args = (ignore_index, exponent)


def _dice_class_backward(ctx: Any, grad_stats: Tensor) -> tuple[Tensor | None, ...]:
    logits, target = ctx.saved_tensors
    return dice_class_stats_backward_op(grad_stats, logits, target, *ctx.args), None, None, None


dice_class_stats_op.register_autograd(_dice_class_backward, setup_context=_dice_class_setup_context)


# ------------------------------------------------------------------------------------------------
# Deformable aggregation (Sparse4D / SparseDrive)


def daf_backend(mc_ms_feat: Tensor) -> tuple[str, str]:
    return _backend(mc_ms_feat, "deformable aggregation", triton="daf")


def _daf_index_args(spatial_shape: Tensor, scale_start_index: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    return (spatial_shape.to(device=device, dtype=torch.int64).contiguous(),
            scale_start_index.to(device=device, dtype=torch.int64).contiguous())


@torch.library.custom_op("loongkit::deformable_aggregation", mutates_args=())
def deformable_aggregation_op(mc_ms_feat: Tensor, spatial_shape: Tensor, scale_start_index: Tensor,
                              sampling_location: Tensor, weights: Tensor, inside_only: bool) -> Tensor:
    """[bs, anchors, C]: Sparse4D's deformable aggregation (see reference.deformable_aggregation)."""
    backend, _ = daf_backend(mc_ms_feat)
    if backend == "reference":
        return reference.deformable_aggregation(mc_ms_feat, spatial_shape, scale_start_index, sampling_location,
                                                weights, inside_only)
    feat, loc, w = mc_ms_feat.contiguous(), sampling_location.contiguous(), weights.contiguous()
    shapes, starts = _daf_index_args(spatial_shape, scale_start_index, feat.device)
    if backend == "triton":
        return _triton("daf").forward(feat, shapes, starts, loc, w, inside_only)
    out = feat.new_empty(feat.shape[0], loc.shape[1], feat.shape[2])
    kernels.load().daf_forward(feat, shapes, starts, loc, w, inside_only, out)
    return out


@deformable_aggregation_op.register_fake
def _(mc_ms_feat: Tensor, spatial_shape: Tensor, scale_start_index: Tensor, sampling_location: Tensor,
      weights: Tensor, inside_only: bool) -> Tensor:
    torch._check(mc_ms_feat.dim() == 3 and sampling_location.dim() == 5 and weights.dim() == 6)
    return mc_ms_feat.new_empty(mc_ms_feat.shape[0], sampling_location.shape[1], mc_ms_feat.shape[2])


@torch.library.custom_op("loongkit::deformable_aggregation_backward", mutates_args=())
def deformable_aggregation_backward_op(grad_output: Tensor, mc_ms_feat: Tensor, spatial_shape: Tensor,
                                       scale_start_index: Tensor, sampling_location: Tensor, weights: Tensor,
                                       inside_only: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_mc_ms_feat, grad_sampling_location, grad_weights)."""
    backend, _ = daf_backend(mc_ms_feat)
    if backend == "reference":
        _, vjp = torch.func.vjp(
            lambda f, lc, w: reference.deformable_aggregation(f, spatial_shape, scale_start_index, lc, w, inside_only),
            mc_ms_feat, sampling_location, weights)
        return tuple(g.contiguous() for g in vjp(grad_output))  # type: ignore[return-value]
    feat, loc, w = mc_ms_feat.contiguous(), sampling_location.contiguous(), weights.contiguous()
    grad_output = grad_output.contiguous()
    shapes, starts = _daf_index_args(spatial_shape, scale_start_index, feat.device)
    if backend == "triton":
        return _triton("daf").backward(grad_output, feat, shapes, starts, loc, w, inside_only)
    grad_feat = torch.zeros_like(feat)
    grad_loc = torch.empty_like(loc)
    grad_w = torch.empty_like(w)
    kernels.load().daf_backward(feat, shapes, starts, loc, w, inside_only, grad_output, grad_feat, grad_loc, grad_w)
    return grad_feat, grad_loc, grad_w


@deformable_aggregation_backward_op.register_fake
def _(grad_output: Tensor, mc_ms_feat: Tensor, spatial_shape: Tensor, scale_start_index: Tensor,
      sampling_location: Tensor, weights: Tensor, inside_only: bool) -> tuple[Tensor, Tensor, Tensor]:
    return (torch.empty_like(mc_ms_feat, memory_format=torch.contiguous_format),
            torch.empty_like(sampling_location, memory_format=torch.contiguous_format),
            torch.empty_like(weights, memory_format=torch.contiguous_format))


def _daf_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.inside_only = inputs[5]


def _daf_backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
    feat, shapes, starts, loc, w = ctx.saved_tensors
    grad_feat, grad_loc, grad_w = deformable_aggregation_backward_op(grad_output, feat, shapes, starts, loc, w,
                                                                     ctx.inside_only)
    return grad_feat, None, None, grad_loc, grad_w, None


deformable_aggregation_op.register_autograd(_daf_backward, setup_context=_daf_setup_context)


def deformable_aggregation(mc_ms_feat: Tensor, spatial_shape: Tensor, scale_start_index: Tensor,
                           sampling_location: Tensor, weights: Tensor, inside_only: bool = True) -> Tensor:
    """The op with the upstream function's conventions: locations and weights cast to the features' dtype."""
    return deformable_aggregation_op(mc_ms_feat, spatial_shape, scale_start_index,
                                     sampling_location.to(mc_ms_feat.dtype), weights.to(mc_ms_feat.dtype),
                                     inside_only)


# ------------------------------------------------------------------------------------------------
# BEV pooling (BEVFusion)


def bev_pool_backend(feats: Tensor) -> tuple[str, str]:
    """'cpu' (C++ kernel), 'triton' (CUDA tensors, kernels/triton/bev_pool.py) or 'reference' (index_add)."""
    return _backend(feats, "bev_pool", triton="bev_pool")


@torch.library.custom_op("loongkit::bev_pool", mutates_args=())
def bev_pool_op(feats: Tensor, coords: Tensor, B: int, Z: int, X: int, Y: int) -> Tensor:
    """[B, C, Z, X, Y]: sums of feats [N, C] per voxel coords [N, 4] = (x, y, z, batch)."""
    backend, _ = bev_pool_backend(feats)
    if backend == "reference":
        return reference.bev_pool(feats, coords, B, Z, X, Y)
    if backend == "triton":
        return _triton("bev_pool").forward(feats.contiguous(), coords.to(torch.int64).contiguous(), B, Z, X, Y)
    out = feats.new_empty(B, feats.shape[1], Z, X, Y)  # written in this layout by the kernel: no permute
    kernels.load().bev_pool_forward(feats.contiguous(), coords.to(torch.int64).contiguous(), B, Z, X, Y, out)
    return out


@bev_pool_op.register_fake
def _(feats: Tensor, coords: Tensor, B: int, Z: int, X: int, Y: int) -> Tensor:
    torch._check(feats.dim() == 2 and coords.dim() == 2)
    return feats.new_empty(B, feats.shape[1], Z, X, Y)


@torch.library.custom_op("loongkit::bev_pool_backward", mutates_args=())
def bev_pool_backward_op(grad_output: Tensor, coords: Tensor, B: int, Z: int, X: int, Y: int) -> Tensor:
    """grad_feats [N, C]: each point's voxel row of grad_output [B, C, Z, X, Y] (zero when dropped)."""
    backend, _ = bev_pool_backend(grad_output)
    if backend == "reference":
        c = grad_output.shape[1]
        feats = grad_output.new_zeros(coords.shape[0], c)
        _, vjp = torch.func.vjp(lambda f: reference.bev_pool(f, coords, B, Z, X, Y), feats)
        return vjp(grad_output)[0].contiguous()
    if backend == "triton":
        return _triton("bev_pool").backward(grad_output, coords.to(torch.int64).contiguous(), B, Z, X, Y)
    grad = grad_output.new_empty(coords.shape[0], grad_output.shape[1])
    kernels.load().bev_pool_backward(grad_output.contiguous(), coords.to(torch.int64).contiguous(), B, Z, X, Y, grad)
    return grad


@bev_pool_backward_op.register_fake
def _(grad_output: Tensor, coords: Tensor, B: int, Z: int, X: int, Y: int) -> Tensor:
    return grad_output.new_empty(coords.shape[0], grad_output.shape[1])


def _bev_pool_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(inputs[1])
    ctx.grid = inputs[2:]


def _bev_pool_backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
    (coords,) = ctx.saved_tensors
    return bev_pool_backward_op(grad_output, coords, *ctx.grid), None, None, None, None, None


bev_pool_op.register_autograd(_bev_pool_backward, setup_context=_bev_pool_setup_context)


# ------------------------------------------------------------------------------------------------
# Voxelization (mmcv hard_voxelize / dynamic_voxelize, deterministic)

_VOXEL_DTYPES = (torch.float16, torch.float32, torch.float64)


def voxelize_backend(points: Tensor) -> tuple[str, str]:
    """'cpu' (C++ kernel), 'triton' (CUDA tensors, kernels/triton/voxelize.py) or 'reference' (sort-based torch)."""
    return _backend(points, "voxelization", _VOXEL_DTYPES, triton="voxelize")


@torch.library.custom_op("loongkit::hard_voxelize", mutates_args=())
def hard_voxelize_op(points: Tensor, voxel_size: list[float], coors_range: list[float], max_points: int,
                     max_voxels: int) -> tuple[Tensor, Tensor, Tensor]:
    """(voxels [M, max_points, F], coors int32 [M, 3] (z, y, x), num_points int32 [M]) of points [N, F]."""
    backend, _ = voxelize_backend(points)
    if backend == "reference":
        return reference.hard_voxelize(points, voxel_size, coors_range, max_points, max_voxels)
    if backend == "triton":
        return _triton("voxelize").hard_voxelize(points.contiguous(), voxel_size, coors_range, max_points,
                                                 max_voxels)
    voxels, coors, num = kernels.load().hard_voxelize(points.contiguous(), voxel_size, coors_range, max_points,
                                                      max_voxels)
    return voxels, coors, num


@hard_voxelize_op.register_fake
def _(points: Tensor, voxel_size: list[float], coors_range: list[float], max_points: int,
      max_voxels: int) -> tuple[Tensor, Tensor, Tensor]:
    torch._check(points.dim() == 2)
    m = torch.library.get_ctx().new_dynamic_size()  # data-dependent: the number of occupied voxels
    return (points.new_empty(m, max_points, points.shape[1]), points.new_empty(m, 3, dtype=torch.int32),
            points.new_empty(m, dtype=torch.int32))


@torch.library.custom_op("loongkit::dynamic_voxelize", mutates_args=())
def dynamic_voxelize_op(points: Tensor, voxel_size: list[float], coors_range: list[float]) -> Tensor:
    """int32 [N, 3] (z, y, x) voxel of each point, -1 rows for points outside coors_range."""
    backend, _ = voxelize_backend(points)
    if backend == "reference":
        return reference.dynamic_voxelize(points, voxel_size, coors_range)
    if backend == "triton":
        return _triton("voxelize").dynamic_voxelize(points.contiguous(), voxel_size, coors_range)
    return kernels.load().dynamic_voxelize(points.contiguous(), voxel_size, coors_range)


@dynamic_voxelize_op.register_fake
def _(points: Tensor, voxel_size: list[float], coors_range: list[float]) -> Tensor:
    torch._check(points.dim() == 2)
    return points.new_empty(points.shape[0], 3, dtype=torch.int32)
