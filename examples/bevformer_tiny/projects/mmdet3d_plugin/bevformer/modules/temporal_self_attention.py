"""TemporalSelfAttention: BEVFormer's deformable self-attention over [previous BEV, current BEV].

Written for this example from the published BEVFormer architecture (Li et al., 2022; the
reference implementation's public interface: class name, constructor parameters, forward
signature), for an OpenMMLab 2.x stack: registered in mmengine's ``MODELS`` as the mmdet3d 1.x-era
ports do. On a GPU the deformable sampling is mmcv's CUDA op; elsewhere it is mmcv's
``multi_scale_deformable_attn_pytorch`` (grid_sample), the path a CPU run takes.

Each BEV query carries its previous-frame feature (ego motion already compensated by the shifted
reference points) beside itself: the offsets and weights are predicted from both, one sampling per
queue entry, and the two results are averaged.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn as nn
from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttnFunction, multi_scale_deformable_attn_pytorch
from mmengine.model import BaseModule, constant_init, xavier_init
from mmengine.registry import MODELS


def deformable_offsets_init(linear: nn.Linear, num_heads: int, groups: int, num_points: int) -> None:
    """Deformable DETR's start: head h looks along angle 2*pi*h/heads, its k-th point k+1 cells out."""
    constant_init(linear, 0.0)
    thetas = torch.arange(num_heads, dtype=torch.float32) * (2.0 * math.pi / num_heads)
    grid = torch.stack([thetas.cos(), thetas.sin()], -1)
    grid = (grid / grid.abs().max(-1, keepdim=True)[0]).view(num_heads, 1, 1, 2).repeat(1, groups, num_points, 1)
    grid = grid * torch.arange(1, num_points + 1, dtype=torch.float32).view(1, 1, num_points, 1)
    linear.bias.data = grid.reshape(-1)


def warn_head_width(embed_dims: int, num_heads: int) -> None:
    if embed_dims % num_heads != 0:
        raise ValueError(f"embed_dims must be divisible by num_heads, but got {embed_dims} and {num_heads}")
    per_head = embed_dims // num_heads
    if per_head & (per_head - 1):
        warnings.warn("a power-of-2 width per attention head is faster in the CUDA kernel", stacklevel=3)


@MODELS.register_module()
class TemporalSelfAttention(BaseModule):
    """Deformable attention of a BEV query over the previous and the current BEV.

    Args:
        embed_dims: channels of the BEV features.
        num_heads: attention heads.
        num_levels: feature levels (1: the BEV plane).
        num_points: sampling points per query, head, level and queue entry.
        num_bev_queue: entries in the BEV queue (2: previous and current).
        im2col_step: mmcv CUDA kernel's step.
        dropout: dropout on the output before the residual.
        batch_first: query / value are (bs, n, c) rather than (n, bs, c).
    """

    def __init__(self, embed_dims: int = 256, num_heads: int = 8, num_levels: int = 4, num_points: int = 4,
                 num_bev_queue: int = 2, im2col_step: int = 64, dropout: float = 0.1, batch_first: bool = True,
                 norm_cfg: Any = None, init_cfg: Any = None) -> None:
        super().__init__(init_cfg)
        warn_head_width(embed_dims, num_heads)
        self.norm_cfg = norm_cfg
        self.dropout = nn.Dropout(dropout)
        self.batch_first = batch_first
        self.fp16_enabled = False
        self.im2col_step = im2col_step
        self.embed_dims = embed_dims
        self.num_levels = num_levels
        self.num_heads = num_heads
        self.num_points = num_points
        self.num_bev_queue = num_bev_queue
        samples = num_bev_queue * num_heads * num_levels * num_points
        # Offsets and weights come from [previous BEV, current query]: twice the channels in.
        self.sampling_offsets = nn.Linear(embed_dims * num_bev_queue, samples * 2)
        self.attention_weights = nn.Linear(embed_dims * num_bev_queue, samples)
        self.value_proj = nn.Linear(embed_dims, embed_dims)
        self.output_proj = nn.Linear(embed_dims, embed_dims)
        self.init_weights()

    def init_weights(self) -> None:
        deformable_offsets_init(self.sampling_offsets, self.num_heads, self.num_levels * self.num_bev_queue,
                                self.num_points)
        constant_init(self.attention_weights, val=0.0, bias=0.0)
        xavier_init(self.value_proj, distribution="uniform", bias=0.0)
        xavier_init(self.output_proj, distribution="uniform", bias=0.0)
        self._is_init = True

    def forward(self, query: torch.Tensor, key: Any = None, value: Any = None, identity: Any = None,
                query_pos: Any = None, key_padding_mask: Any = None, reference_points: Any = None,
                spatial_shapes: Any = None, level_start_index: Any = None, flag: str = "decoder",
                **kwargs: Any) -> torch.Tensor:
        """query: (bs, Q, C); value: (bs * queue, Q, C), per sample [previous, current] (None: the current
        BEV twice, the first frame of a sequence); reference_points: (bs * queue, Q, levels, 2)."""
        if value is None:
            assert self.batch_first
            bs, len_bev, channels = query.shape
            value = torch.stack([query, query], 1).reshape(bs * 2, len_bev, channels)
        if identity is None:
            identity = query
        if query_pos is not None:
            query = query + query_pos
        if not self.batch_first:
            query = query.permute(1, 0, 2)
            value = value.permute(1, 0, 2)
        bs, num_query, embed_dims = query.shape
        _, num_value, _ = value.shape
        assert (spatial_shapes[:, 0] * spatial_shapes[:, 1]).sum() == num_value
        assert self.num_bev_queue == 2
        queue, heads, levels, points = self.num_bev_queue, self.num_heads, self.num_levels, self.num_points

        # Rows of value are (sample, queue entry); value[:bs] is each sample's previous BEV when bs == 1.
        query = torch.cat([value[:bs], query], -1)
        value = self.value_proj(value)
        if key_padding_mask is not None:
            value = value.masked_fill(key_padding_mask[..., None], 0.0)
        value = value.reshape(bs * queue, num_value, heads, -1)

        sampling_offsets = self.sampling_offsets(query).view(bs, num_query, heads, queue, levels, points, 2)
        attention_weights = self.attention_weights(query).view(bs, num_query, heads, queue, levels * points)
        attention_weights = attention_weights.softmax(-1)
        attention_weights = attention_weights.view(bs, num_query, heads, queue, levels, points)
        # Queue entries become rows: (bs, queue) -> bs * queue, like value.
        attention_weights = attention_weights.permute(0, 3, 1, 2, 4, 5).reshape(
            bs * queue, num_query, heads, levels, points).contiguous()
        sampling_offsets = sampling_offsets.permute(0, 3, 1, 2, 4, 5, 6).reshape(
            bs * queue, num_query, heads, levels, points, 2)

        if reference_points.shape[-1] == 2:
            offset_normalizer = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)  # (w, h)
            sampling_locations = (reference_points[:, :, None, :, None, :]
                                  + sampling_offsets / offset_normalizer[None, None, None, :, None, :])
        elif reference_points.shape[-1] == 4:
            sampling_locations = (reference_points[:, :, None, :, None, :2]
                                  + sampling_offsets / points * reference_points[:, :, None, :, None, 2:] * 0.5)
        else:
            raise ValueError(f"reference_points must end in 2 or 4 coordinates, got {reference_points.shape[-1]}")

        if torch.cuda.is_available() and value.is_cuda:
            output = MultiScaleDeformableAttnFunction.apply(value, spatial_shapes, level_start_index,
                                                            sampling_locations, attention_weights, self.im2col_step)
        else:
            output = multi_scale_deformable_attn_pytorch(value, spatial_shapes, sampling_locations,
                                                         attention_weights)

        # (bs * queue, Q, C) -> (Q, C, bs, queue): the average over the queue fuses the two frames.
        output = output.permute(1, 2, 0)
        output = output.view(num_query, embed_dims, bs, queue)
        output = output.mean(-1)
        output = output.permute(2, 0, 1)
        output = self.output_proj(output)
        if not self.batch_first:
            output = output.permute(1, 0, 2)
        return self.dropout(output) + identity
