"""Test module: BEVFormer's attention classes with upstream's public interface and maths.

Written for loongkit's tests from the published algorithm (BEVFormer, Li et al. 2022, and its
reference implementation's documented behaviour), not copied. Loaded by the tests the way a user's
``projects/mmdet3d_plugin/bevformer/modules/`` is imported: the module-level decorators register
the classes in ``ATTENTION``, taken from the module ``lk_upstream_registry`` the test installs (an
mmcv 1.x Registry double, or mmengine's MODELS in the integration tests).

``multi_scale_deformable_attn_pytorch`` is mmcv's when mmcv is installed (as upstream imports it),
else an independent grid_sample implementation of the same maths.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lk_upstream_registry import ATTENTION  # type: ignore[import-not-found]
from torch import nn

try:
    from mmcv.ops.multi_scale_deform_attn import multi_scale_deformable_attn_pytorch
except ImportError:
    def multi_scale_deformable_attn_pytorch(value: torch.Tensor, value_spatial_shapes: Any,
                                            sampling_locations: torch.Tensor,
                                            attention_weights: torch.Tensor) -> torch.Tensor:
        bs, _, heads, channels = value.shape
        _, queries, _, _, points, _ = sampling_locations.shape
        shapes = [(int(h), int(w)) for h, w in value_spatial_shapes]
        maps = value.split([h * w for h, w in shapes], dim=1)
        grid = sampling_locations * 2 - 1  # grid_sample's [-1, 1], align_corners=False
        out = value.new_zeros(bs * heads, channels, queries)
        for lvl, (h, w) in enumerate(shapes):
            feat = maps[lvl].permute(0, 2, 3, 1).reshape(bs * heads, channels, h, w)
            g = grid[:, :, :, lvl].transpose(1, 2).reshape(bs * heads, queries, points, 2)
            sampled = F.grid_sample(feat, g, mode="bilinear", padding_mode="zeros", align_corners=False)
            weight = attention_weights[:, :, :, lvl].transpose(1, 2).reshape(bs * heads, 1, queries, points)
            out = out + (sampled * weight).sum(-1)
        return out.view(bs, heads * channels, queries).transpose(1, 2).contiguous()


def _init_offsets(linear: nn.Linear, heads: int, groups: int, points: int) -> None:
    """Deformable DETR's initialisation: head h points along angle 2*pi*h/heads, k-th point at k+1."""
    nn.init.zeros_(linear.weight)
    angle = torch.arange(heads, dtype=torch.float32) * (2.0 * math.pi / heads)
    direction = torch.stack([angle.cos(), angle.sin()], -1)
    direction = direction / direction.abs().max(-1, keepdim=True)[0]
    grid = direction[:, None, None, :].repeat(1, groups, points, 1)
    grid = grid * torch.arange(1, points + 1, dtype=torch.float32)[None, None, :, None]
    with torch.no_grad():
        linear.bias.copy_(grid.reshape(-1))


@ATTENTION.register_module()
class MSDeformableAttention3D(nn.Module):
    """Deformable attention of SCA: each query has num_Z_anchors reference points per camera."""

    def __init__(self, embed_dims: int = 256, num_heads: int = 8, num_levels: int = 4, num_points: int = 8,
                 im2col_step: int = 64, dropout: float = 0.1, batch_first: bool = True, norm_cfg: Any = None,
                 init_cfg: Any = None) -> None:
        super().__init__()
        self.embed_dims, self.num_heads = embed_dims, num_heads
        self.num_levels, self.num_points = num_levels, num_points
        self.batch_first = batch_first
        self.output_proj = None
        self.fp16_enabled = False
        self.sampling_offsets = nn.Linear(embed_dims, num_heads * num_levels * num_points * 2)
        self.attention_weights = nn.Linear(embed_dims, num_heads * num_levels * num_points)
        self.value_proj = nn.Linear(embed_dims, embed_dims)
        _init_offsets(self.sampling_offsets, num_heads, num_levels, num_points)
        nn.init.zeros_(self.attention_weights.weight)
        nn.init.zeros_(self.attention_weights.bias)

    def forward(self, query: torch.Tensor, key: Any = None, value: Any = None, identity: Any = None,
                query_pos: Any = None, key_padding_mask: Any = None, reference_points: Any = None,
                spatial_shapes: Any = None, level_start_index: Any = None, **kwargs: Any) -> torch.Tensor:
        if value is None:
            value = query
        if query_pos is not None:
            query = query + query_pos
        if not self.batch_first:
            query, value = query.transpose(0, 1), value.transpose(0, 1)
        bs, num_query, _ = query.shape
        num_value = value.shape[1]
        value = self.value_proj(value)
        if key_padding_mask is not None:
            value = value.masked_fill(key_padding_mask[..., None], 0.0)
        value = value.view(bs, num_value, self.num_heads, -1)
        heads, levels, points = self.num_heads, self.num_levels, self.num_points
        offsets = self.sampling_offsets(query).view(bs, num_query, heads, levels, points, 2)
        weights = self.attention_weights(query).view(bs, num_query, heads, levels * points).softmax(-1)
        weights = weights.view(bs, num_query, heads, levels, points)
        if reference_points.shape[-1] != 2:
            raise ValueError("reference points must be (x, y)")
        anchors = reference_points.shape[2]
        # (w, h) per level; the points split into groups, one per Z anchor, anchor index fastest.
        normalizer = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)
        offsets = offsets / normalizer[None, None, None, :, None, :]
        offsets = offsets.view(bs, num_query, heads, levels, points // anchors, anchors, 2)
        locations = reference_points[:, :, None, None, None, :, :] + offsets
        locations = locations.view(bs, num_query, heads, levels, points, 2)
        output = multi_scale_deformable_attn_pytorch(value, spatial_shapes, locations, weights)
        if not self.batch_first:
            output = output.transpose(0, 1)
        return output


@ATTENTION.register_module()
class SpatialCrossAttention(nn.Module):
    """BEV queries attend to the cameras that see them; per-camera outputs averaged over those cameras."""

    def __init__(self, embed_dims: int = 256, num_cams: int = 6, pc_range: Any = None, dropout: float = 0.1,
                 init_cfg: Any = None, batch_first: bool = False,
                 deformable_attention: Any = None, **kwargs: Any) -> None:
        super().__init__()
        cfg = deformable_attention or {"type": "MSDeformableAttention3D", "embed_dims": 256, "num_levels": 4}
        self.dropout = nn.Dropout(dropout)
        self.pc_range = pc_range
        self.fp16_enabled = False
        self.deformable_attention = ATTENTION.build(cfg)
        self.embed_dims = embed_dims
        self.num_cams = num_cams
        self.output_proj = nn.Linear(embed_dims, embed_dims)
        self.batch_first = batch_first

    def forward(self, query: torch.Tensor, key: Any, value: Any, residual: Any = None, query_pos: Any = None,
                key_padding_mask: Any = None, reference_points: Any = None, spatial_shapes: Any = None,
                reference_points_cam: Any = None, bev_mask: Any = None, level_start_index: Any = None,
                flag: str = "encoder", **kwargs: Any) -> torch.Tensor:
        if key is None:
            key = query
        if value is None:
            value = key
        if residual is None:
            inp_residual = query
            slots = torch.zeros_like(query)
        if query_pos is not None:
            query = query + query_pos
        bs = query.shape[0]
        depth = reference_points_cam.size(3)
        # Visible queries per camera, from the first sample's mask (used for the whole batch).
        per_cam = [mask_per_img[0].sum(-1).nonzero().squeeze(-1) for mask_per_img in bev_mask]
        max_len = max(len(idx) for idx in per_cam)
        q_pack = query.new_zeros([bs * self.num_cams, max_len, self.embed_dims])
        r_pack = reference_points_cam.new_zeros([bs * self.num_cams, max_len, depth, 2])
        for cam, idx in enumerate(per_cam):
            for b in range(bs):
                q_pack[b * self.num_cams + cam, :len(idx)] = query[b, idx]
                r_pack[b * self.num_cams + cam, :len(idx)] = reference_points_cam[cam, b, idx]
        _, length, bs, _ = key.shape
        # Key/value camera-major beside batch-major queries: an early BEVFormer revision's order (published
        # BEVFormer and UniAD's test module are batch-major); kept so the camera-major path stays tested.
        key = key.permute(0, 2, 1, 3).view(self.num_cams * bs, length, self.embed_dims)
        value = value.permute(0, 2, 1, 3).view(self.num_cams * bs, length, self.embed_dims)
        out = self.deformable_attention(query=q_pack, key=key, value=value, reference_points=r_pack,
                                        spatial_shapes=spatial_shapes, level_start_index=level_start_index)
        for cam, idx in enumerate(per_cam):
            for b in range(bs):
                slots[b, idx] += out[b * self.num_cams + cam, :len(idx)]
        seen_by = (bev_mask.sum(-1) > 0).permute(1, 2, 0).sum(-1)
        seen_by = torch.clamp(seen_by, min=1.0)
        slots = self.output_proj(slots / seen_by[..., None])
        return self.dropout(slots) + inp_residual


@ATTENTION.register_module()
class TemporalSelfAttention(nn.Module):
    """Deformable self-attention over [previous BEV, current BEV]; both results averaged.

    BEVFormer's formulation, which only runs with batch size 1 (the previous-frame features are
    ``value[0:1]`` and the value is reshaped to the queue length).
    """

    def __init__(self, embed_dims: int = 256, num_heads: int = 8, num_levels: int = 4, num_points: int = 4,
                 num_bev_queue: int = 2, im2col_step: int = 64, dropout: float = 0.1, batch_first: bool = True,
                 norm_cfg: Any = None, init_cfg: Any = None) -> None:
        super().__init__()
        self.embed_dims, self.num_heads = embed_dims, num_heads
        self.num_levels, self.num_points = num_levels, num_points
        self.num_bev_queue = num_bev_queue
        self.dropout = nn.Dropout(dropout)
        self.batch_first = batch_first
        self.fp16_enabled = False
        total = num_bev_queue * num_heads * num_levels * num_points
        self.sampling_offsets = nn.Linear(embed_dims * num_bev_queue, total * 2)
        self.attention_weights = nn.Linear(embed_dims * num_bev_queue, total)
        self.value_proj = nn.Linear(embed_dims, embed_dims)
        self.output_proj = nn.Linear(embed_dims, embed_dims)
        _init_offsets(self.sampling_offsets, num_heads, num_levels * num_bev_queue, num_points)
        nn.init.zeros_(self.attention_weights.weight)
        nn.init.zeros_(self.attention_weights.bias)

    def forward(self, query: torch.Tensor, key: Any = None, value: Any = None, identity: Any = None,
                query_pos: Any = None, key_padding_mask: Any = None, reference_points: Any = None,
                spatial_shapes: Any = None, level_start_index: Any = None, flag: str = "decoder",
                **kwargs: Any) -> torch.Tensor:
        if value is None:
            value = torch.cat([query, query], 0)
        if identity is None:
            identity = query
        if query_pos is not None:
            query = query + query_pos
        if not self.batch_first:
            query, value = query.permute(1, 0, 2), value.permute(1, 0, 2)
        bs, num_query, _ = query.shape
        num_value = value.shape[1]
        queue, heads, levels, points = self.num_bev_queue, self.num_heads, self.num_levels, self.num_points
        query = torch.cat([value[0:1], query], -1)  # previous BEV beside the current query
        value = self.value_proj(value)
        if key_padding_mask is not None:
            value = value.masked_fill(key_padding_mask[..., None], 0.0)
        value = value.reshape(queue, num_value, heads, -1)
        offsets = self.sampling_offsets(query).view(bs, num_query, heads, queue, levels, points, 2)
        weights = self.attention_weights(query).view(bs, num_query, heads, queue, levels * points).softmax(-1)
        weights = weights.view(bs, num_query, heads, queue, levels, points)
        weights = weights.permute(3, 0, 1, 2, 4, 5).reshape(bs * queue, num_query, heads, levels, points)
        offsets = offsets.permute(3, 0, 1, 2, 4, 5, 6).reshape(bs * queue, num_query, heads, levels, points, 2)
        if reference_points.shape[-1] == 2:
            normalizer = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)
            locations = reference_points[:, :, None, :, None, :] + offsets / normalizer[None, None, None, :, None, :]
        elif reference_points.shape[-1] == 4:
            locations = (reference_points[:, :, None, :, None, :2]
                         + offsets / points * reference_points[:, :, None, :, None, 2:] * 0.5)
        else:
            raise ValueError("reference points must have 2 or 4 coordinates")
        output = multi_scale_deformable_attn_pytorch(value, spatial_shapes, locations, weights)
        output = output.permute(1, 2, 0)  # [Q, C, queue*bs]
        output = (output[..., :bs] + output[..., bs:]) / queue
        output = self.output_proj(output.permute(2, 0, 1))
        if not self.batch_first:
            output = output.permute(1, 0, 2)
        return self.dropout(output) + identity
