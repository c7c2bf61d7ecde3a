"""Test module: UniAD's copies of the BEVFormer encoder attentions, its motion deformable attention and
its planning CollisionLoss, with upstream's public interface and maths.

Written for loongkit's tests from UniAD's published algorithm and documented behaviour (Hu et al. 2023),
not copied. Registered like the real project: decorators on the ``ATTENTION`` / ``LOSSES`` registries
of the module ``lk_upstream_registry`` the test installs. ``MSDeformableAttention3D`` and the MSDA
function come from the BEVFormer test module (UniAD vendors the same class).
"""

from __future__ import annotations

from typing import Any

import torch
from lk_upstream_bevformer import (  # type: ignore[import-not-found]
    MSDeformableAttention3D,
    _init_offsets,
    multi_scale_deformable_attn_pytorch,
)
from lk_upstream_registry import ATTENTION, LOSSES  # type: ignore[import-not-found]
from torch import nn

ATTENTION.register_module(module=MSDeformableAttention3D)


@ATTENTION.register_module()
class SpatialCrossAttention(nn.Module):
    """UniAD's SCA: like BEVFormer's, with key/value ordered batch-major to match the packed queries."""

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
        per_cam = [mask_per_img[0].sum(-1).nonzero().squeeze(-1) for mask_per_img in bev_mask]
        max_len = max(len(idx) for idx in per_cam)
        q_pack = query.new_zeros([bs, self.num_cams, max_len, self.embed_dims])
        r_pack = reference_points_cam.new_zeros([bs, self.num_cams, max_len, depth, 2])
        for b in range(bs):
            for cam, idx in enumerate(per_cam):
                q_pack[b, cam, :len(idx)] = query[b, idx]
                r_pack[b, cam, :len(idx)] = reference_points_cam[cam, b, idx]
        _, length, bs, _ = key.shape
        key = key.permute(2, 0, 1, 3).reshape(bs * self.num_cams, length, self.embed_dims)
        value = value.permute(2, 0, 1, 3).reshape(bs * self.num_cams, length, self.embed_dims)
        out = self.deformable_attention(
            query=q_pack.view(bs * self.num_cams, max_len, self.embed_dims), key=key, value=value,
            reference_points=r_pack.view(bs * self.num_cams, max_len, depth, 2), spatial_shapes=spatial_shapes,
            level_start_index=level_start_index).view(bs, self.num_cams, max_len, self.embed_dims)
        for b in range(bs):
            for cam, idx in enumerate(per_cam):
                slots[b, idx] += out[b, cam, :len(idx)]
        seen_by = torch.clamp((bev_mask.sum(-1) > 0).permute(1, 2, 0).sum(-1), min=1.0)
        slots = self.output_proj(slots / seen_by[..., None])
        return self.dropout(slots) + inp_residual


@ATTENTION.register_module()
class TemporalSelfAttention(nn.Module):
    """UniAD's TSA: batch-major [sample, queue] value rows, so it runs for any batch size; the
    previous-frame half of the sampling query is ``value[:bs]`` (UniAD's choice, kept as is)."""

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

    def forward(self, query: torch.Tensor, key: Any = None, value: Any = None, identity: Any = None,
                query_pos: Any = None, key_padding_mask: Any = None, reference_points: Any = None,
                spatial_shapes: Any = None, level_start_index: Any = None, flag: str = "decoder",
                **kwargs: Any) -> torch.Tensor:
        if value is None:
            bs, length, channels = query.shape
            value = torch.stack([query, query], 1).reshape(bs * 2, length, channels)
        if identity is None:
            identity = query
        if query_pos is not None:
            query = query + query_pos
        if not self.batch_first:
            query, value = query.permute(1, 0, 2), value.permute(1, 0, 2)
        bs, num_query, embed_dims = query.shape
        num_value = value.shape[1]
        queue, heads, levels, points = self.num_bev_queue, self.num_heads, self.num_levels, self.num_points
        query = torch.cat([value[:bs], query], -1)
        value = self.value_proj(value)
        if key_padding_mask is not None:
            value = value.masked_fill(key_padding_mask[..., None], 0.0)
        value = value.reshape(bs * queue, num_value, heads, -1)
        offsets = self.sampling_offsets(query).view(bs, num_query, heads, queue, levels, points, 2)
        weights = self.attention_weights(query).view(bs, num_query, heads, queue, levels * points).softmax(-1)
        weights = weights.view(bs, num_query, heads, queue, levels, points)
        weights = weights.permute(0, 3, 1, 2, 4, 5).reshape(bs * queue, num_query, heads, levels, points)
        offsets = offsets.permute(0, 3, 1, 2, 4, 5, 6).reshape(bs * queue, num_query, heads, levels, points, 2)
        normalizer = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)
        locations = reference_points[:, :, None, :, None, :] + offsets / normalizer[None, None, None, :, None, :]
        output = multi_scale_deformable_attn_pytorch(value, spatial_shapes, locations, weights)
        output = output.permute(1, 2, 0).reshape(num_query, embed_dims, bs, queue).mean(-1)
        output = self.output_proj(output.permute(2, 0, 1))
        if not self.batch_first:
            output = output.permute(1, 0, 2)
        return self.dropout(output) + identity


@ATTENTION.register_module()
class MotionDeformableAttention(nn.Module):
    """Motion queries [bs, agents, modes, C] sample the BEV around each agent's anchor trajectory point."""

    def __init__(self, embed_dims: int = 256, num_heads: int = 8, num_levels: int = 4, num_points: int = 4,
                 num_steps: int = 1, sample_index: int = -1, im2col_step: int = 64, dropout: float = 0.1,
                 bev_range: Any = (-51.2, -51.2, -5.0, 51.2, 51.2, 3.0), voxel_size: Any = (0.2, 0.2, 8),
                 batch_first: bool = True, norm_cfg: Any = None, init_cfg: Any = None) -> None:
        super().__init__()
        self.embed_dims, self.num_heads = embed_dims, num_heads
        self.num_levels, self.num_points = num_levels, num_points
        self.num_steps, self.sample_index, self.bev_range = num_steps, sample_index, list(bev_range)
        self.dropout = nn.Dropout(dropout)
        self.batch_first = batch_first
        self.fp16_enabled = False
        total = num_heads * num_steps * num_levels * num_points
        self.sampling_offsets = nn.Linear(embed_dims, total * 2)
        self.attention_weights = nn.Linear(embed_dims, total)
        self.value_proj = nn.Linear(embed_dims, embed_dims)
        self.output_proj = nn.Sequential(nn.Linear(num_steps * embed_dims, embed_dims), nn.LayerNorm(embed_dims),
                                         nn.ReLU(inplace=True))

    def forward(self, query: torch.Tensor, key: Any = None, value: Any = None, identity: Any = None,
                query_pos: Any = None, key_padding_mask: Any = None, spatial_shapes: Any = None,
                level_start_index: Any = None, bbox_results: Any = None, reference_trajs: Any = None,
                flag: str = "decoder", **kwargs: Any) -> torch.Tensor:
        bs, agents, modes, _ = query.shape
        num_query = agents * modes
        if value is None:
            value = query
        if identity is None:
            identity = query
        if query_pos is not None:
            query = query + query_pos
        query = query.flatten(1, 2)
        value = value.permute(1, 0, 2)
        num_value = value.shape[1]
        value = self.value_proj(value)
        if key_padding_mask is not None:
            value = value.masked_fill(key_padding_mask[..., None], 0.0)
        value = value.view(bs, num_value, self.num_heads, -1)
        heads, steps, levels, points = self.num_heads, self.num_steps, self.num_levels, self.num_points
        offsets = self.sampling_offsets(query).view(bs, num_query, heads, steps, levels, points, 2)
        weights = self.attention_weights(query).view(bs, num_query, heads, steps, levels * points).softmax(-1)
        weights = weights.view(bs, num_query, heads, steps, levels, points)
        trajs = reference_trajs[:, :, :, [self.sample_index], :, :].clone()
        centres = torch.stack([r[0].gravity_center.to(trajs.device)[:, None, None, None, :2] for r in bbox_results])
        ego = (trajs + centres).detach().flatten(1, 2)[:, :, None, :, :, None, :]  # agent -> ego frame
        lo_x, lo_y, hi_x, hi_y = self.bev_range[0], self.bev_range[1], self.bev_range[3], self.bev_range[4]
        ego = torch.stack([(ego[..., 0] - lo_x) / (hi_x - lo_x), (ego[..., 1] - lo_y) / (hi_y - lo_y)], -1)
        normalizer = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)
        locations = ego + offsets / normalizer[None, None, None, None, :, None, :]
        locations = locations.permute(0, 1, 3, 2, 4, 5, 6).reshape(bs, num_query * steps, heads, levels, points, 2)
        weights = weights.permute(0, 1, 3, 2, 4, 5).reshape(bs, num_query * steps, heads, levels, points)
        output = multi_scale_deformable_attn_pytorch(value, spatial_shapes, locations, weights)
        output = self.output_proj(output.view(bs, num_query, steps, -1).flatten(2, 3))
        return self.dropout(output.view(bs, agents, modes, -1)) + identity


@LOSSES.register_module()
class CollisionLoss(nn.Module):
    """Overlap of the ego box (on the planned trajectory) with the future GT boxes, per future step."""

    def __init__(self, delta: float = 0.5, weight: float = 1.0) -> None:
        super().__init__()
        self.w = 1.85 + delta
        self.h = 4.084 + delta
        self.weight = weight

    def forward(self, sdc_traj_all: torch.Tensor, sdc_planning_gt: torch.Tensor, sdc_planning_gt_mask: Any,
                future_gt_bbox: Any) -> torch.Tensor:
        total = sdc_traj_all.new_zeros(1)
        for step, boxes in enumerate(future_gt_bbox):
            if len(boxes.tensor) == 0:
                continue
            gt = boxes.corners[:, [0, 3, 4, 7], :2]
            yaw = sdc_planning_gt[0, step, 2].to(sdc_traj_all.dtype)
            ego = self.to_corners([sdc_traj_all[0, step, 0], sdc_traj_all[0, step, 1], self.w, self.h, yaw])
            for k in range(gt.shape[0]):
                total += self.inter_bbox(ego, gt[k].to(sdc_traj_all.device))
        return total * self.weight

    def inter_bbox(self, corners_a: torch.Tensor, corners_b: torch.Tensor) -> torch.Tensor:
        a_hi_x, a_hi_y = torch.max(corners_a[:, 0]), torch.max(corners_a[:, 1])
        a_lo_x, a_lo_y = torch.min(corners_a[:, 0]), torch.min(corners_a[:, 1])
        b_hi_x, b_hi_y = torch.max(corners_b[:, 0]), torch.max(corners_b[:, 1])
        b_lo_x, b_lo_y = torch.min(corners_b[:, 0]), torch.min(corners_b[:, 1])
        zero = a_hi_x.new_zeros(1)
        width = max(min(a_hi_x, b_hi_x) - max(a_lo_x, b_lo_x), zero)
        height = max(min(a_hi_y, b_hi_y) - max(a_lo_y, b_lo_y), zero)
        return width * height

    def to_corners(self, bbox: list) -> torch.Tensor:
        x, _, width, length, theta = bbox
        half_w, half_l = width / 2, length / 2
        local = torch.tensor([[half_w, -half_l], [half_w, half_l], [-half_w, half_l], [-half_w, -half_l]]).to(x.device)
        # New tensors from the parts: the ego box is cut off from the trajectory's graph.
        rot = torch.tensor([[torch.cos(theta), torch.sin(theta)], [-torch.sin(theta), torch.cos(theta)]]).to(x.device)
        return (rot @ local.T + torch.tensor(bbox[:2])[:, None].to(x.device)).T
