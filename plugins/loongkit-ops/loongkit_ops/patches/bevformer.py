"""LOONGKIT_BEVFORMER: BEVFormer's attention modules, found where they are registered.

BEVFormer (and UniAD, which vendors its encoder) lives in the user's tree as
``projects/mmdet3d_plugin/bevformer/modules/*.py``; its classes register themselves in mmcv 1.x's
``ATTENTION`` registry (or mmengine's ``MODELS`` in 2.x ports). :mod:`.registry_watch` reports every
registration; a class whose name is one of :data:`SPECS` is checked against the upstream interface
(forward parameters, ``__init__`` parameters that create the attributes the maths uses, names the
forward references) and patched, or left alone with "interface differs: ..." in the Summary.

- ``SpatialCrossAttention``: the forward is replaced by :func:`make_sca_forward`: the queries each
  camera sees are gathered for all cameras at once and the results scattered back with one
  ``index_add`` (upstream: a Python loop over cameras and batch, one ``nonzero`` host sync per
  camera; here one sync, for the packed length). The inner ``deformable_attention`` is called once,
  exactly as upstream calls it (same tensors, same layout), so whatever module it is keeps working.
- ``MSDeformableAttention3D``, ``TemporalSelfAttention``, ``CustomMSDeformableAttention`` (and
  UniAD's ``MotionDeformableAttention``): their CPU path calls ``multi_scale_deformable_attn_pytorch``
  from their own module's globals (imported from mmcv when the project was imported). That global
  is swapped for the dispatcher of :mod:`.msda` (float32/float64 CPU -> ``loongkit::ms_deform_attn``,
  otherwise the original), so whatever runs the original forward only changes the sampling kernel.
- ``MSDeformableAttention3D`` and ``TemporalSelfAttention`` whose source shows upstream's maths
  (:data:`FUSED_MARKERS`) also get a fused forward (:func:`msda3d_fused`, :func:`tsa_fused`): the
  offset and attention projections as one matmul (TSA: the previous-BEV half of its [previous,
  current] query as its own product, so no gradient is computed for a previous BEV that needs
  none), and softmax, sampling locations, sampling and TSA's mean over the two frames in one op
  (``loongkit::ms_deform_attn_fused``). Inside SCA, its MSDeformableAttention3D projects the BEV
  queries once, before the per-camera gather (upstream projects every gathered copy and the zero
  padding, whose outputs SCA discards). Calls the fused path does not cover (other devices and
  dtypes, 4-coordinate reference points, TSA with bs > 1 in a layout that is not batch-major) run the
  original forward.

Batch size > 1, derived from upstream's SCA: the queries a camera sees are taken from the mask of
sample 0 (``mask_per_img[0]``) for every sample of the batch, while the normaliser (how many cameras
see a query) uses each sample's own mask. BEVFormer hands the deformable attention key/value rows in
camera-major order (``permute(0, 2, 1, 3).view``) while its queries are batch-major, so for bs > 1
sample j / camera i attends to the features of another (camera, sample) row; UniAD's copy reorders
key/value batch-major (``permute(2, 0, 1, 3).reshape``). The fast path reproduces whichever of the two
the class's source shows; a forward whose source shows neither (or cannot be read) runs the original
for bs > 1 (bs == 1 is the same in all of them). Results therefore equal upstream for every batch
size; a "per-sample" fix would change what models train to, and is not this feature's call.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_ops.patches import registry_watch
from loongkit_ops.patches.msda import FUNCTION, TARGET, BevformerMSDA, function_problem, fused_dispatcher

REGISTRY_TARGETS = ("mmcv.utils.registry", "mmengine.registry.registry")


@dataclass(frozen=True)
class Spec:
    """What a registered class must look like for its patch: ``kind`` says which patch."""

    kind: str  # "sca": forward replaced; "msda": module global swapped; "collision": see uniad.py
    forward: tuple[str, ...]  # the forward's parameters, "**" for **kwargs
    init: tuple[str, ...]  # __init__ parameters that must exist (they make the attributes used)
    uses: tuple[str, ...]  # names the forward's code must reference


_MSDA_FORWARD = ("self", "query", "key", "value", "identity", "query_pos", "key_padding_mask",
                 "reference_points", "spatial_shapes", "level_start_index")
_MSDA_INIT = ("embed_dims", "num_heads", "num_levels", "num_points")
_MSDA_USES = ("sampling_offsets", "attention_weights", "value_proj", FUNCTION)

SPECS: dict[str, Spec] = {
    "SpatialCrossAttention": Spec(
        "sca",
        ("self", "query", "key", "value", "residual", "query_pos", "key_padding_mask", "reference_points",
         "spatial_shapes", "reference_points_cam", "bev_mask", "level_start_index", "flag", "**"),
        ("embed_dims", "num_cams", "deformable_attention"),
        ("nonzero", "deformable_attention", "output_proj", "num_cams", "embed_dims", "dropout")),
    "MSDeformableAttention3D": Spec("msda", (*_MSDA_FORWARD, "**"), _MSDA_INIT, _MSDA_USES),
    "TemporalSelfAttention": Spec("msda", (*_MSDA_FORWARD, "flag", "**"), (*_MSDA_INIT, "num_bev_queue"),
                                  (*_MSDA_USES, "output_proj")),
    "CustomMSDeformableAttention": Spec("msda", (*_MSDA_FORWARD, "flag", "**"), _MSDA_INIT,
                                        (*_MSDA_USES, "output_proj")),
}


def _params(fn: Any) -> tuple[str, ...]:
    params = inspect.signature(fn).parameters.values()
    return tuple("**" if p.kind is p.VAR_KEYWORD else "*" if p.kind is p.VAR_POSITIONAL else p.name for p in params)


def code_names(code: Any) -> set[str]:
    """Global/attribute names a code object and its nested ones (comprehensions, lambdas) use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= code_names(const)
    return names


def forward_function(cls: type) -> Any:
    """The class's forward without decorators (mmcv's force_fp32 / deprecated_api_warning use wraps)."""
    return inspect.unwrap(getattr(cls, "forward", None))


def interface_problem(name: str, cls: type, spec: Spec) -> str | None:
    """None when ``cls`` has the upstream interface ``spec`` describes, else what differs."""
    import torch

    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        return f"interface differs: {name} is not an nn.Module class"
    forward = forward_function(cls)
    code = getattr(forward, "__code__", None)
    if code is None:
        return f"interface differs: {name}.forward is not a Python function"
    try:
        fparams = _params(forward)
        iparams = set(_params(cls.__init__))
    except (TypeError, ValueError):
        return f"interface differs: cannot read {name}'s signatures"
    if fparams != spec.forward:
        return f"interface differs: {name}.forward{fparams}, expected {spec.forward}"
    missing = [p for p in spec.init if p not in iparams]
    if missing:
        return f"interface differs: {name}.__init__ lacks {missing}"
    used = code_names(code)
    unused = [n for n in spec.uses if n not in used]
    if unused:
        return f"interface differs: {name}.forward does not use {unused}"
    return None


# ------------------------------------------------------------------------------------------------
# MSDeformableAttention3D and TemporalSelfAttention: fused forwards

# Expressions of upstream's forward (whitespace removed) that define the maths the fused forward
# reproduces; a class whose source lacks one keeps its own forward (with the fused sampling kernel).
_COMMON_MARKERS = ("self.value_proj(value)", ".softmax(-1)",
                   "torch.stack([spatial_shapes[...,1],spatial_shapes[...,0]],-1)")
FUSED_MARKERS: dict[str, tuple[str, ...]] = {
    "MSDeformableAttention3D": (*_COMMON_MARKERS, "reference_points[:,:,None,None,None,:,:]"),
    "TemporalSelfAttention": (*_COMMON_MARKERS, "reference_points[:,:,None,:,None,:]", "torch.cat([value[",
                              "],query],-1)", "self.output_proj(", "self.dropout(output)+identity"),
}


def compact_source(fn: Any) -> str | None:
    try:
        return "".join(inspect.getsource(fn).split())
    except (OSError, TypeError):
        return None


def fused_problem(name: str, forward: Any) -> str | None:
    """None when ``forward``'s source shows the maths :func:`msda3d_fused` / :func:`tsa_fused` compute."""
    compact = compact_source(forward)
    if compact is None:
        return "source unavailable"
    missing = [m for m in FUSED_MARKERS[name] if m not in compact]
    return f"source lacks {missing}" if missing else None


def tsa_layout(forward: Any) -> str | None:
    """'batch-major' when the TSA's rows are [sample, queue] with the previous half ``value[:bs]``
    (BEVFormer's and UniAD's code); otherwise None: bs > 1 runs the original."""
    compact = compact_source(forward) or ""
    if "permute(0,3,1,2,4,5)" in compact and "torch.cat([value[:bs],query],-1)" in compact:
        return "batch-major"
    return None


def _msda_common_problem(module: Any, query: Any, value: Any, reference_points: Any, spatial_shapes: Any,
                         queue: int) -> str | None:
    import torch

    from loongkit_ops.kernels.ops import msda

    if getattr(module, "fp16_enabled", False):
        return "fp16_enabled (force_fp32 casts)"
    so, aw = getattr(module, "sampling_offsets", None), getattr(module, "attention_weights", None)
    if not (isinstance(so, torch.nn.Linear) and isinstance(aw, torch.nn.Linear) and so.bias is not None
            and aw.bias is not None and callable(getattr(module, "value_proj", None))):
        return "sampling_offsets/attention_weights are not biased Linear layers"
    if not all(isinstance(t, torch.Tensor) for t in (query, value, reference_points, spatial_shapes)):
        return "missing tensors"
    backend, why = msda.backend(value)
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
    problem = _msda_common_problem(module, query, query if value is None else value, reference_points,
                                   spatial_shapes, 1)
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
    problem = _msda_common_problem(module, query, query if value is None else value, reference_points,
                                   spatial_shapes, queue)
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


def make_fused_forward(name: str, original: Any, layout: str | None, record: Any,
                       on_fallback: Callable[[str], None]) -> Any:
    """The class's forward, same signature: the fused maths where it applies, else the original."""
    if name == "TemporalSelfAttention":
        def forward(self: Any, query: Any, key: Any = None, value: Any = None, identity: Any = None,
                    query_pos: Any = None, key_padding_mask: Any = None, reference_points: Any = None,
                    spatial_shapes: Any = None, level_start_index: Any = None, flag: str = "decoder",
                    **kwargs: Any) -> Any:
            why = tsa_problem(self, query, value, reference_points, spatial_shapes, layout)
            if why is not None:
                on_fallback(f"TemporalSelfAttention: {why}")
                return original(self, query, key, value, identity, query_pos, key_padding_mask, reference_points,
                                spatial_shapes, level_start_index, flag, **kwargs)
            record.calls += 1
            return tsa_fused(self, query, value, identity, query_pos, key_padding_mask, reference_points,
                             spatial_shapes, level_start_index)
    else:
        def forward(self: Any, query: Any, key: Any = None, value: Any = None, identity: Any = None,  # type: ignore[misc]
                    query_pos: Any = None, key_padding_mask: Any = None, reference_points: Any = None,
                    spatial_shapes: Any = None, level_start_index: Any = None, **kwargs: Any) -> Any:
            why = msda3d_problem(self, query, value, reference_points, spatial_shapes)
            if why is not None:
                on_fallback(f"MSDeformableAttention3D: {why}")
                return original(self, query, key, value, identity, query_pos, key_padding_mask, reference_points,
                                spatial_shapes, level_start_index, **kwargs)
            record.calls += 1
            return msda3d_fused(self, query, value, query_pos, key_padding_mask, reference_points, spatial_shapes,
                                level_start_index)

    forward.__doc__ = getattr(original, "__doc__", None)
    forward.__loongkit_feature__ = record.feature.name  # type: ignore[attr-defined]
    forward.__loongkit_original__ = original  # type: ignore[attr-defined]
    forward.__loongkit_fused__ = name  # type: ignore[attr-defined]
    return forward


# ------------------------------------------------------------------------------------------------
# SpatialCrossAttention


def sca_layout(forward: Any) -> str | None:
    """Which upstream batch layout the forward's source shows: 'camera-major' (BEVFormer),
    'batch-major' (UniAD) or None (unknown: bs > 1 then runs the original)."""
    try:
        compact = "".join(inspect.getsource(forward).split())
    except (OSError, TypeError):
        return None
    if "mask_per_img[0]" not in compact:
        return None
    if "key.permute(0,2,1,3).view(" in compact and "value.permute(0,2,1,3).view(" in compact:
        return "camera-major"
    if "key.permute(2,0,1,3).reshape(" in compact and "value.permute(2,0,1,3).reshape(" in compact:
        return "batch-major"
    return None


def _sca_fallback(module: Any, query: Any, key: Any, residual: Any, reference_points_cam: Any, bev_mask: Any,
                  layout: str | None) -> str | None:
    """Why this call must run the original forward (None: the fast path computes the same)."""
    import torch

    if residual is not None:
        return "residual given"  # upstream never defines slots then; let it fail as it does
    if getattr(module, "fp16_enabled", False):
        return "fp16_enabled (force_fp32 casts)"
    num_cams, embed_dims = getattr(module, "num_cams", None), getattr(module, "embed_dims", None)
    if not (isinstance(num_cams, int) and isinstance(embed_dims, int)
            and all(callable(getattr(module, a, None)) for a in ("deformable_attention", "output_proj", "dropout"))):
        return "instance lacks num_cams/embed_dims/deformable_attention/output_proj/dropout"
    if not all(isinstance(t, torch.Tensor) for t in (query, key, reference_points_cam, bev_mask)):
        return "missing tensors"
    if (query.dim() != 3 or key.dim() != 4 or reference_points_cam.dim() != 5 or bev_mask.dim() != 4
            or query.shape[-1] != embed_dims or bev_mask.shape[0] != num_cams
            or reference_points_cam.shape[0] != num_cams or bev_mask.shape[1] != query.shape[0]):
        return "unexpected shapes"
    if query.shape[0] > 1 and layout is None:
        return "batch > 1 with an unknown key/value layout"
    return None


def packed_msda3d(inner: Any, query: Any, value: Any, reference_points_cam: Any, spatial_shapes: Any) -> bool:
    """Whether SCA may run its MSDeformableAttention3D's maths itself, projecting the BEV queries before
    the gather: the inner module has the fused forward, no hooks, and the call is one it fuses."""
    import torch

    if getattr(forward_function(type(inner)), "__loongkit_fused__", None) != "MSDeformableAttention3D":
        return False
    glob = torch.nn.modules.module  # hooks run only when the module is called: then call it
    if (not getattr(inner, "batch_first", False) or inner._forward_hooks or inner._forward_pre_hooks
            or inner._backward_hooks or inner._backward_pre_hooks or glob._global_forward_hooks
            or glob._global_forward_pre_hooks or glob._global_backward_hooks or glob._global_backward_pre_hooks):
        return False
    return msda3d_problem(inner, query, value, reference_points_cam[0], spatial_shapes) is None


def sca_fused(module: Any, query: Any, key: Any, value: Any, query_pos: Any, reference_points_cam: Any,
              bev_mask: Any, spatial_shapes: Any, level_start_index: Any, layout: str | None,
              record: Any = None) -> Any:
    """SpatialCrossAttention.forward's maths with batched gather/scatter (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    if value is None:
        value = key
    inp_residual = query
    if query_pos is not None:
        query = query + query_pos
    bs, num_query, _ = query.shape
    num_cams, embed_dims = module.num_cams, module.embed_dims
    depth = reference_points_cam.size(3)

    # The queries each camera sees: those with any visible anchor in sample 0's mask (upstream rule).
    visible = bev_mask[:, 0].sum(-1) != 0  # [cams, Q]
    max_len = int(visible.sum(-1).max()) if num_query else 0  # the one host sync: the packed length
    # table[i, s] = s-th visible query of camera i, ascending like nonzero(); num_query marks padding.
    slot = visible.cumsum(-1) - 1 + torch.arange(num_cams, device=visible.device)[:, None] * max_len
    dump = num_cams * max_len
    target = torch.where(visible, slot, torch.full_like(slot, dump)).reshape(-1)
    queries_index = torch.arange(num_query, device=visible.device).repeat(num_cams)
    table = torch.full((dump + 1,), num_query, dtype=torch.int64, device=visible.device)
    table = table.scatter(0, target, queries_index)[:dump]  # the dump slot (invisible pairs) is dropped

    # Gather: padding reads an appended zero row, as upstream's zero-initialised buffers hold.
    inner = module.deformable_attention
    packed = packed_msda3d(inner, query, value, reference_points_cam, spatial_shapes)
    if packed:  # the gathered rows of the projected queries; padding rows' outputs are discarded below
        weight, bias = merged_projection(inner)
        proj = F.linear(query, weight, bias)
        proj = torch.cat([proj, proj.new_zeros(bs, 1, proj.shape[-1])], 1)
        proj_rebatch = proj.index_select(1, table).reshape(bs * num_cams, max_len, -1)
    else:
        query_pad = torch.cat([query, query.new_zeros(bs, 1, query.shape[-1])], 1)
        queries_rebatch = query_pad.index_select(1, table).reshape(bs * num_cams, max_len, embed_dims)
    ref_pad = torch.cat([reference_points_cam, reference_points_cam.new_zeros(num_cams, bs, 1, depth, 2)], 2)
    cams = torch.arange(num_cams, device=visible.device)[:, None]
    ref_rebatch = ref_pad.transpose(0, 1)[:, cams, table.view(num_cams, max_len)]
    ref_rebatch = ref_rebatch.reshape(bs * num_cams, max_len, depth, 2)

    _, length, key_bs, _ = key.shape
    if layout == "batch-major":
        key = key.permute(2, 0, 1, 3).reshape(key_bs * num_cams, length, embed_dims)
        value = value.permute(2, 0, 1, 3).reshape(key_bs * num_cams, length, embed_dims)
    else:  # camera-major, BEVFormer's (identical to batch-major when bs == 1)
        key = key.permute(0, 2, 1, 3).view(num_cams * key_bs, length, embed_dims)
        value = value.permute(0, 2, 1, 3).view(num_cams * key_bs, length, embed_dims)
    if packed:
        if record is not None:
            record.calls += 1
        queries = msda3d_sample(inner, value, proj_rebatch, ref_rebatch, None, spatial_shapes, level_start_index)
    else:
        queries = inner(query=queries_rebatch, key=key, value=value, reference_points=ref_rebatch,
                        spatial_shapes=spatial_shapes, level_start_index=level_start_index)

    # Scatter: index_add walks the index in order, so each query sums its cameras in camera order.
    out = queries.reshape(bs, num_cams * max_len, -1)
    slots = torch.zeros(bs, num_query + 1, out.shape[-1], dtype=inp_residual.dtype, device=inp_residual.device)
    slots = slots.index_add(1, table, out.to(slots.dtype))[:, :num_query]
    count = bev_mask.sum(-1) > 0
    count = count.permute(1, 2, 0).sum(-1)
    count = torch.clamp(count, min=1.0)
    slots = slots / count[..., None]
    slots = module.output_proj(slots)
    return module.dropout(slots) + inp_residual


def make_sca_forward(original: Any, layout: str | None, record: Any, on_fallback: Callable[[str], None]) -> Any:
    def forward(self: Any, query: Any, key: Any, value: Any, residual: Any = None, query_pos: Any = None,
                key_padding_mask: Any = None, reference_points: Any = None, spatial_shapes: Any = None,
                reference_points_cam: Any = None, bev_mask: Any = None, level_start_index: Any = None,
                flag: str = "encoder", **kwargs: Any) -> Any:
        why = _sca_fallback(self, query, key, residual, reference_points_cam, bev_mask, layout)
        if why is not None:
            on_fallback(why)
            return original(self, query, key, value, residual, query_pos, key_padding_mask, reference_points,
                            spatial_shapes, reference_points_cam, bev_mask, level_start_index, flag, **kwargs)
        record.calls += 1
        return sca_fused(self, query, key, value, query_pos, reference_points_cam, bev_mask, spatial_shapes,
                         level_start_index, layout, record)

    forward.__doc__ = getattr(original, "__doc__", None)
    forward.__loongkit_feature__ = record.feature.name  # type: ignore[attr-defined]
    forward.__loongkit_original__ = original  # type: ignore[attr-defined]
    return forward


# ------------------------------------------------------------------------------------------------
# The feature


class ModelClasses:
    """Watches the registries for ``specs`` and patches what matches; shared by BEVFORMER and UNIAD."""

    def __init__(self, ctx: ActivationContext, specs: dict[str, Spec],
                 patchers: dict[str, Callable[[str, type, Spec], str]]) -> None:
        self.ctx = ctx
        self.specs = specs
        self.patchers = patchers  # kind -> patch(name, cls, spec) returning what was done
        self.seen: set[type] = set()
        self.patched: dict[str, str] = {}
        self.problems: dict[str, str] = {}
        self.fallbacks: dict[str, int] = {}
        self.registries: list[type] = []

    def watch(self, module_name: str) -> None:
        module = sys.modules[module_name]
        registry_cls = getattr(module, "Registry", None)
        problem = registry_watch.registry_problem(registry_cls)
        if problem:  # not NotApplicable: that would also undo this feature's other targets
            self.problems[module_name] = f"registry hook not installed: {problem}"
            self.ctx.log.warning("registry not watched", target=module_name, reason=problem)
            self.refresh()
            return
        if registry_cls not in self.registries:
            registry_watch.subscribe(registry_cls, self.on_register, self.ctx.log)
            self.registries.append(registry_cls)
        for name, cls in registry_watch.registered_classes(registry_cls, frozenset(self.specs)):
            self.on_register(name, cls)
        self.ctx.log.info("watching registrations", registry=f"{registry_cls.__module__}.Registry",
                          classes=sorted(self.specs), patched=sorted(self.patched))
        self.refresh()

    def on_register(self, name: str, cls: type) -> None:
        spec = self.specs.get(name)
        if spec is None or cls in self.seen:
            return
        self.seen.add(cls)
        label = f"{name} ({cls.__module__})"
        owner = getattr(forward_function(cls), "__loongkit_feature__", None)
        if owner is not None:  # BEVFORMER and UNIAD watch the same classes: the first one patches
            self.patched[label] = f"patched by LOONGKIT_{str(owner).upper()}"
            self.refresh()
            return
        problem = interface_problem(name, cls, spec)
        if problem is None:
            try:
                done = self.patchers[spec.kind](name, cls, spec)
            except NotApplicable as exc:
                problem = str(exc)
            else:
                self.patched[label] = done
                self.problems.pop(label, None)
                self.ctx.log.info("model class patched", cls=label, how=done)
        if problem is not None:
            self.problems[label] = problem
            self.ctx.log.warning("model class not patched", cls=label, reason=problem)
        self.refresh()

    def on_fallback(self, why: str) -> None:
        if why not in self.fallbacks:
            self.ctx.log.info("original forward used for a call", reason=why)
        self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
        self.ctx.detail("fallbacks", dict(self.fallbacks))

    def refresh(self) -> None:
        """What the Summary shows: patched classes in the config, mismatches as the reason."""
        self.ctx.detail("patched", dict(self.patched))
        self.ctx.detail("not_applicable", dict(self.problems))
        self.ctx.record.reason = "; ".join(f"{k}: {v}" for k, v in self.problems.items())

    def close(self) -> None:
        registry_watch.unsubscribe(self.on_register)
        self.registries.clear()


class Bevformer(BevformerMSDA):
    """LOONGKIT_BEVFORMER: mmcv's MSDA (target mmcv.ops.multi_scale_deform_attn, :mod:`.msda`) and
    BEVFormer's registered attention classes (targets: the mmcv 1.x and mmengine registry modules)."""

    specs: dict[str, Spec] = SPECS

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        if target == TARGET:
            super().activate(ctx, target)
            self.classes(ctx).refresh()
            return
        if target not in REGISTRY_TARGETS:
            raise NotApplicable(f"unknown target {target}")
        # No kernel build here: every OpenMMLab program imports the registries; the kernel is loaded
        # when a class that needs it registers (patch_msda), and SCA's gather/scatter needs none.
        self.classes(ctx).watch(target)

    def classes(self, ctx: ActivationContext) -> ModelClasses:
        found = getattr(self, "_classes", None)
        if found is None or found.ctx is not ctx:
            found = self._classes = ModelClasses(ctx, self.specs, self.patchers(ctx))
        return found

    def patchers(self, ctx: ActivationContext) -> dict[str, Callable[[str, type, Spec], str]]:
        return {"sca": lambda n, c, s: self.patch_sca(ctx, n, c), "msda": lambda n, c, s: self.patch_msda(ctx, n, c)}

    def patch_sca(self, ctx: ActivationContext, name: str, cls: type) -> str:
        original = cls.forward
        layout = sca_layout(forward_function(cls))
        forward = make_sca_forward(original, layout, ctx.record, self.classes(ctx).on_fallback)
        ctx.patcher.patch(cls, "forward", forward)
        return f"batched gather/scatter over cameras (batch>1 layout: {layout or 'unknown, original forward'})"

    def patch_msda(self, ctx: ActivationContext, name: str, cls: type) -> str:
        forward = forward_function(cls)
        namespace = forward.__globals__
        module = sys.modules.get(namespace.get("__name__", ""))
        if module is None or module.__dict__ is not namespace:
            raise NotApplicable(f"interface differs: {name}.forward's module is not importable")
        current = namespace.get(FUNCTION)
        if getattr(current, "__loongkit_original__", None) is not None:
            done = f"{module.__name__}.{FUNCTION} already on loongkit::ms_deform_attn"
        else:
            problem = function_problem(current)
            if problem:
                raise NotApplicable(f"interface differs: {module.__name__}.{problem}")
            ctx.patcher.patch(module, FUNCTION, fused_dispatcher(current, ctx.record))  # kernel built at first call
            done = f"{module.__name__}.{FUNCTION} -> loongkit::ms_deform_attn (CPU)"
        if name not in FUSED_MARKERS:
            return done
        problem = fused_problem(name, forward)
        if problem is not None:  # the module's own maths stay, on the fused sampling kernel
            ctx.log.info("own forward kept", cls=name, reason=problem)
            return f"{done}; own forward kept ({problem})"
        layout = tsa_layout(forward) if name == "TemporalSelfAttention" else "any"
        fused = make_fused_forward(name, cls.forward, layout, ctx.record, self.classes(ctx).on_fallback)  # type: ignore[attr-defined]
        ctx.patcher.patch(cls, "forward", fused)
        return f"{done}; forward on loongkit::ms_deform_attn_fused (batch>1: {layout or 'original forward'})"

    def deactivate(self, ctx: ActivationContext) -> None:
        found = getattr(self, "_classes", None)
        if found is not None:
            found.close()
            self._classes = None
        super().deactivate(ctx)
