"""LOONGKIT_BEVFORMER: the fused path of MSDeformableAttention3D and TemporalSelfAttention.

Their CPU path calls ``multi_scale_deformable_attn_pytorch`` from their own module's globals (imported
from mmcv when the project was imported); :func:`patch` swaps that global for the dispatcher of
:mod:`.msda` (float32/float64 CPU -> ``loongkit::ms_deform_attn``, otherwise the original), so whatever
runs the original forward only changes the sampling kernel. When the class's source shows upstream's
maths (:data:`.bevformer_source.FUSED_MARKERS`) the forward is replaced too (:func:`msda3d_fused`,
:func:`tsa_fused`): the offset and attention projections as one matmul (TSA: the previous-BEV half of
its [previous, current] query as its own product, so no gradient is computed for a previous BEV that
needs none), and softmax, sampling locations, sampling and TSA's mean over the two frames in one op
(``loongkit::ms_deform_attn_fused``). Calls the fused path does not cover (other devices and dtypes,
4-coordinate reference points, TSA with bs > 1 in a layout that is not batch-major) run the original
forward, counted as fallbacks.
"""

from __future__ import annotations

import sys
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_ops.patches import msda
from loongkit_ops.patches.bevformer_source import FUSED_MARKERS, fused_problem, tsa_layout
from loongkit_ops.patches.model_classes import Patched, forward_function, mark


def common_problem(module: Any, query: Any, value: Any, reference_points: Any, spatial_shapes: Any,
                   queue: int) -> str | None:
    """Why a call of the fused MSDeformableAttention3D / TSA maths must run the original (None: it need not)."""
    import torch

    from loongkit_ops.kernels.ops import msda as msda_op

    if getattr(module, "fp16_enabled", False):
        return "fp16_enabled (force_fp32 casts)"
    so, aw = getattr(module, "sampling_offsets", None), getattr(module, "attention_weights", None)
    if not (isinstance(so, torch.nn.Linear) and isinstance(aw, torch.nn.Linear) and so.bias is not None
            and aw.bias is not None and callable(getattr(module, "value_proj", None))):
        return "sampling_offsets/attention_weights are not biased Linear layers"
    if not all(isinstance(t, torch.Tensor) for t in (query, value, reference_points, spatial_shapes)):
        return "missing tensors"
    backend, why = msda_op.backend(value)
    if backend != "cpu":
        return why or f"{value.device.type} tensors"
    if query.dtype != value.dtype or reference_points.dtype != value.dtype or so.weight.dtype != value.dtype:
        return "mixed dtypes"
    heads, levels, points = module.num_heads, module.num_levels, module.num_points
    if (reference_points.shape[-1] != 2 or spatial_shapes.dim() != 2 or spatial_shapes.shape[0] != levels
            or so.out_features != heads * queue * levels * points * 2 or aw.out_features != so.out_features // 2
            or query.shape[-1] * (2 if queue > 1 else 1) != so.in_features):
        return "unexpected shapes (or 4-coordinate reference points)"
    return None


def merged_projection(module: Any) -> tuple[Any, Any]:
    """[sampling_offsets; attention_weights] as one weight and bias: one matmul for both."""
    import torch

    so, aw = module.sampling_offsets, module.attention_weights
    return torch.cat([so.weight, aw.weight]), torch.cat([so.bias, aw.bias])


def msda3d_sample(module: Any, value: Any, proj: Any, reference_points: Any, key_padding_mask: Any,
                  spatial_shapes: Any, level_start_index: Any) -> Any:
    """MSDeformableAttention3D after its query projections: ``proj`` [bs, Q, offsets | logits]."""
    from loongkit_ops.kernels.ops import msda_fused

    bs, num_value, _ = value.shape
    value = module.value_proj(value)
    if key_padding_mask is not None:
        value = value.masked_fill(key_padding_mask[..., None], 0.0)
    value = value.view(bs, num_value, module.num_heads, -1)
    return msda_fused.ms_deform_attn_fused(value, spatial_shapes, level_start_index, reference_points, proj, False,
                                           1)


def msda3d_problem(module: Any, query: Any, value: Any, reference_points: Any, spatial_shapes: Any) -> str | None:
    problem = common_problem(module, query, query if value is None else value, reference_points, spatial_shapes, 1)
    if problem is None and (reference_points.dim() != 4 or module.num_points % reference_points.shape[2]):
        return "reference points are not [bs, Q, Z anchors, 2] with the anchors dividing the points"
    return problem


def msda3d_fused(module: Any, query: Any, value: Any, query_pos: Any, key_padding_mask: Any, reference_points: Any,
                 spatial_shapes: Any, level_start_index: Any) -> Any:
    """MSDeformableAttention3D.forward's maths on the fused op (see the module docstring)."""
    import torch.nn.functional as F

    if value is None:
        value = query
    if query_pos is not None:
        query = query + query_pos
    if not module.batch_first:
        query, value = query.permute(1, 0, 2), value.permute(1, 0, 2)
    weight, bias = merged_projection(module)
    output = msda3d_sample(module, value, F.linear(query, weight, bias), reference_points, key_padding_mask,
                           spatial_shapes, level_start_index)
    return output if module.batch_first else output.permute(1, 0, 2)


def tsa_fused(module: Any, query: Any, value: Any, identity: Any, query_pos: Any, key_padding_mask: Any,
              reference_points: Any, spatial_shapes: Any, level_start_index: Any) -> Any:
    """TemporalSelfAttention.forward's maths on the fused op, batch-major rows (see the module docstring)."""
    import torch

    from loongkit_ops.kernels.ops import msda_fused

    if value is None:  # batch_first (checked): [current, current] per sample
        bs, length, channels = query.shape
        value = torch.stack([query, query], 1).reshape(bs * 2, length, channels)
    if identity is None:
        identity = query
    if query_pos is not None:
        query = query + query_pos
    if not module.batch_first:
        query, value = query.permute(1, 0, 2), value.permute(1, 0, 2)
    bs, num_query, embed_dims = query.shape
    num_value = value.shape[1]
    queue = module.num_bev_queue
    weight, bias = merged_projection(module)
    # cat([value[:bs], query]) @ W.T as two products: none for the previous BEV unless it needs a gradient.
    proj = torch.addmm(bias, query.reshape(-1, embed_dims), weight[:, embed_dims:].t())
    proj = torch.addmm(proj, value[:bs].reshape(-1, embed_dims), weight[:, :embed_dims].t())
    proj = proj.view(bs, num_query, -1)
    value = module.value_proj(value)
    if key_padding_mask is not None:
        value = value.masked_fill(key_padding_mask[..., None], 0.0)
    value = value.reshape(bs * queue, num_value, module.num_heads, -1)
    output = msda_fused.ms_deform_attn_fused(value, spatial_shapes, level_start_index, reference_points, proj, True,
                                             queue)
    output = module.output_proj(output)
    if not module.batch_first:
        output = output.permute(1, 0, 2)
    return module.dropout(output) + identity


def tsa_problem(module: Any, query: Any, value: Any, reference_points: Any, spatial_shapes: Any,
                layout: str | None) -> str | None:
    queue = getattr(module, "num_bev_queue", None)
    if queue != 2 or not all(callable(getattr(module, a, None)) for a in ("output_proj", "dropout")):
        return "num_bev_queue is not 2, or no output_proj/dropout"
    if not (hasattr(reference_points, "dim") and reference_points.dim() == 4):
        return "reference points are not [bs * queue, Q, levels, 2]"
    if value is None and not module.batch_first:
        return "value is None with batch_first=False"
    problem = common_problem(module, query, query if value is None else value, reference_points, spatial_shapes,
                             queue)
    if problem is not None:
        return problem
    bs = query.shape[0] if module.batch_first else query.shape[1]
    if bs > 1 and layout != "batch-major":
        return "batch > 1 in a TemporalSelfAttention whose rows are not batch-major"
    num_query = query.shape[1] if module.batch_first else query.shape[0]
    rows = bs * queue if value is None else (value.shape[0] if module.batch_first else value.shape[1])
    if rows != bs * queue or tuple(reference_points.shape[:3]) != (bs * queue, num_query, module.num_levels):
        return "unexpected shapes"
    return None


def make_fused_forward(ctx: ActivationContext, name: str, original: Any, layout: str | None) -> Any:
    """The class's forward, same signature: the fused maths where it applies, else the original."""
    count, fallback = ctx.count, ctx.fallback
    if name == "TemporalSelfAttention":
        def forward(self: Any, query: Any, key: Any = None, value: Any = None, identity: Any = None,
                    query_pos: Any = None, key_padding_mask: Any = None, reference_points: Any = None,
                    spatial_shapes: Any = None, level_start_index: Any = None, flag: str = "decoder",
                    **kwargs: Any) -> Any:
            why = tsa_problem(self, query, value, reference_points, spatial_shapes, layout)
            if why is not None:
                fallback(f"TemporalSelfAttention: {why}")
                return original(self, query, key, value, identity, query_pos, key_padding_mask, reference_points,
                                spatial_shapes, level_start_index, flag, **kwargs)
            count()
            return tsa_fused(self, query, value, identity, query_pos, key_padding_mask, reference_points,
                             spatial_shapes, level_start_index)
    else:
        def forward(self: Any, query: Any, key: Any = None, value: Any = None, identity: Any = None,  # type: ignore[misc]
                    query_pos: Any = None, key_padding_mask: Any = None, reference_points: Any = None,
                    spatial_shapes: Any = None, level_start_index: Any = None, **kwargs: Any) -> Any:
            why = msda3d_problem(self, query, value, reference_points, spatial_shapes)
            if why is not None:
                fallback(f"MSDeformableAttention3D: {why}")
                return original(self, query, key, value, identity, query_pos, key_padding_mask, reference_points,
                                spatial_shapes, level_start_index, **kwargs)
            count()
            return msda3d_fused(self, query, value, query_pos, key_padding_mask, reference_points, spatial_shapes,
                                level_start_index)

    forward.__loongkit_fused__ = name  # type: ignore[attr-defined]
    return mark(forward, ctx, original)


def patch(ctx: ActivationContext, name: str, cls: type) -> Patched:
    """Swap the sampling function in the class's module (once per module), and, when its source shows
    upstream's maths, its forward for the fused one."""
    forward = forward_function(cls)
    namespace = forward.__globals__
    module = sys.modules.get(namespace.get("__name__", ""))
    if module is None or module.__dict__ is not namespace:
        raise NotApplicable(f"interface differs: {name}.forward's module is not importable")
    current = namespace.get(msda.FUNCTION)
    if getattr(current, "__loongkit_original__", None) is not None:
        done = f"{module.__name__}.{msda.FUNCTION} already on loongkit::ms_deform_attn"
    else:
        problem = msda.function_problem(current)
        if problem:
            raise NotApplicable(f"interface differs: {module.__name__}.{problem}")
        ctx.patcher.patch(module, msda.FUNCTION, msda.fused_dispatcher(current, ctx))  # kernel built at first call
        done = f"{module.__name__}.{msda.FUNCTION} -> loongkit::ms_deform_attn (CPU)"
    if name not in FUSED_MARKERS:
        return Patched("loongkit::ms_deform_attn", done)
    problem = fused_problem(name, forward)
    if problem is not None:  # the module's own maths stay, on the fused sampling kernel
        ctx.log.info("own forward kept", cls=name, reason=problem)
        return Patched("loongkit::ms_deform_attn", f"{done}; own forward kept ({problem})")
    layout = tsa_layout(forward) if name == "TemporalSelfAttention" else "any"
    ctx.patcher.patch(cls, "forward", make_fused_forward(ctx, name, cls.forward, layout))  # type: ignore[attr-defined]
    return Patched("loongkit::ms_deform_attn_fused",
                   f"{done}; forward on loongkit::ms_deform_attn_fused (batch>1: {layout or 'original forward'})")
