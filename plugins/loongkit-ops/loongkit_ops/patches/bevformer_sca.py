"""LOONGKIT_BEVFORMER: SpatialCrossAttention with all cameras gathered and scattered at once.

The forward is replaced by :func:`make_forward`'s: the queries each camera sees are gathered for all
cameras at once and the results scattered back with one ``index_add`` (upstream: a Python loop over
cameras and batch, one ``nonzero`` host sync per camera; here one sync, for the packed length). The
inner ``deformable_attention`` is called once, exactly as upstream calls it (same tensors, same
layout), so whatever module it is keeps working; an MSDeformableAttention3D with the fused forward of
:mod:`.bevformer_fused` projects the BEV queries once, before the gather, instead (upstream projects
every gathered copy and the zero padding, whose outputs SCA discards).

Batch size > 1, as upstream does it: the queries a camera sees are taken from the mask of sample 0
(``mask_per_img[0]``) for every sample of the batch, while the normaliser (how many cameras see a
query) uses each sample's own mask. Published BEVFormer (fundamentalvision/BEVFormer, master) and
UniAD pack the queries batch-major and hand the deformable attention key/value rows batch-major too
(``permute(2, 0, 1, 3).reshape``); an early BEVFormer revision packed the queries batch-major but the
key/value rows camera-major (``permute(0, 2, 1, 3).view``), so for bs > 1 sample j / camera i attended
to another (camera, sample) row's features. The fast path reproduces whichever of the two the class's
source shows (:func:`.bevformer_source.sca_layout`); a forward whose source shows neither (or cannot
be read) runs the original for bs > 1 (bs == 1 is the same in all of them). Results therefore equal
upstream's for every batch size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loongkit_core.context import ActivationContext
from loongkit_ops.patches.bevformer_fused import merged_projection, msda3d_problem, msda3d_sample
from loongkit_ops.patches.bevformer_source import sca_layout
from loongkit_ops.patches.model_classes import Patched, forward_function, mark


def fallback_reason(module: Any, query: Any, key: Any, residual: Any, reference_points_cam: Any, bev_mask: Any,
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
              count: Callable[[], None] | None = None) -> Any:
    """SpatialCrossAttention.forward's maths with batched gather/scatter (see the module docstring);
    ``count()`` when the inner MSDeformableAttention3D's maths run here (packed)."""
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
    else:  # camera-major: the early BEVFormer revision's (the same as batch-major when bs == 1)
        key = key.permute(0, 2, 1, 3).view(num_cams * key_bs, length, embed_dims)
        value = value.permute(0, 2, 1, 3).view(num_cams * key_bs, length, embed_dims)
    if packed:
        if count is not None:
            count()
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


def make_forward(ctx: ActivationContext, original: Any, layout: str | None) -> Any:
    """SpatialCrossAttention.forward, same signature: :func:`sca_fused` where it applies, else the original."""
    count, fallback = ctx.count, ctx.fallback

    def forward(self: Any, query: Any, key: Any, value: Any, residual: Any = None, query_pos: Any = None,
                key_padding_mask: Any = None, reference_points: Any = None, spatial_shapes: Any = None,
                reference_points_cam: Any = None, bev_mask: Any = None, level_start_index: Any = None,
                flag: str = "encoder", **kwargs: Any) -> Any:
        why = fallback_reason(self, query, key, residual, reference_points_cam, bev_mask, layout)
        if why is not None:
            fallback(why)
            return original(self, query, key, value, residual, query_pos, key_padding_mask, reference_points,
                            spatial_shapes, reference_points_cam, bev_mask, level_start_index, flag, **kwargs)
        count()
        return sca_fused(self, query, key, value, query_pos, reference_points_cam, bev_mask, spatial_shapes,
                         level_start_index, layout, count)

    return mark(forward, ctx, original)


def patch(ctx: ActivationContext, name: str, cls: type) -> Patched:
    """Replace the class's forward by :func:`make_forward`'s."""
    layout = sca_layout(forward_function(cls))
    ctx.patcher.patch(cls, "forward", make_forward(ctx, cls.forward, layout))  # type: ignore[attr-defined]
    return Patched("batched gather/scatter",
                   f"batched gather/scatter over cameras (batch>1 layout: {layout or 'unknown, original forward'})")
