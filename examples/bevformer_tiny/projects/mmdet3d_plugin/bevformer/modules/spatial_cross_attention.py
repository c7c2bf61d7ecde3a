"""SpatialCrossAttention and MSDeformableAttention3D: BEV queries look into the cameras that see them.

Written for this example from the published BEVFormer architecture (class names, constructor
parameters and forward signatures as the reference implementation publishes them), registered in
mmengine's ``MODELS``. Each BEV query is a pillar of ``num_Z_anchors`` 3D points; projected into a
camera they give that many 2D reference points, around each of which MSDeformableAttention3D samples
``num_points / num_Z_anchors`` points. SpatialCrossAttention packs, per camera, the queries that
camera sees (mask of the first sample), runs the deformable attention once for all cameras, and
averages each query's results over the cameras that saw it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttnFunction, multi_scale_deformable_attn_pytorch
from mmengine.model import BaseModule, constant_init, xavier_init
from mmengine.registry import MODELS

from .temporal_self_attention import deformable_offsets_init, warn_head_width


@MODELS.register_module()
class SpatialCrossAttention(BaseModule):
    """Cross-attention from BEV queries to the multi-camera image features.

    Args:
        embed_dims: channels.
        num_cams: cameras.
        pc_range: point-cloud range (kept for the configs that pass it).
        dropout: dropout on the output before the residual.
        batch_first: unused (queries are batch-first here), kept for the layer's config check.
        deformable_attention: config of the per-camera deformable attention.
    """

    def __init__(self, embed_dims: int = 256, num_cams: int = 6, pc_range: Any = None, dropout: float = 0.1,
                 init_cfg: Any = None, batch_first: bool = False,
                 deformable_attention: Any = None, **kwargs: Any) -> None:
        super().__init__(init_cfg)
        if deformable_attention is None:
            deformable_attention = dict(type="MSDeformableAttention3D", embed_dims=256, num_levels=4)
        self.init_cfg = init_cfg
        self.dropout = nn.Dropout(dropout)
        self.pc_range = pc_range
        self.fp16_enabled = False
        self.deformable_attention = MODELS.build(deformable_attention)
        self.embed_dims = embed_dims
        self.num_cams = num_cams
        self.output_proj = nn.Linear(embed_dims, embed_dims)
        self.batch_first = batch_first
        self.init_weight()

    def init_weight(self) -> None:
        xavier_init(self.output_proj, distribution="uniform", bias=0.0)

    def forward(self, query: torch.Tensor, key: Any, value: Any, residual: Any = None, query_pos: Any = None,
                key_padding_mask: Any = None, reference_points: Any = None, spatial_shapes: Any = None,
                reference_points_cam: Any = None, bev_mask: Any = None, level_start_index: Any = None,
                flag: str = "encoder", **kwargs: Any) -> torch.Tensor:
        """query: (bs, Q, C); key/value: (cams, HW, bs, C); reference_points_cam: (cams, bs, Q, Z, 2);
        bev_mask: (cams, bs, Q, Z), whether a query's anchor falls inside a camera's image."""
        if key is None:
            key = query
        if value is None:
            value = key
        if residual is None:
            inp_residual = query
            slots = torch.zeros_like(query)
        if query_pos is not None:
            query = query + query_pos
        bs = query.size(0)
        depth = reference_points_cam.size(3)

        # The queries each camera sees (any anchor visible), from the first sample's mask.
        indexes = []
        for mask_per_img in bev_mask:
            indexes.append(mask_per_img[0].sum(-1).nonzero().squeeze(-1))
        max_len = max(len(index) for index in indexes)

        queries_rebatch = query.new_zeros([bs, self.num_cams, max_len, self.embed_dims])
        reference_points_rebatch = reference_points_cam.new_zeros([bs, self.num_cams, max_len, depth, 2])
        for j in range(bs):
            for i, reference_points_per_img in enumerate(reference_points_cam):
                index_query_per_img = indexes[i]
                queries_rebatch[j, i, :len(index_query_per_img)] = query[j, index_query_per_img]
                reference_points_rebatch[j, i, :len(index_query_per_img)] = reference_points_per_img[
                    j, index_query_per_img]

        _, length, bs, _ = key.shape
        # Rows (sample, camera), as the packed queries.
        key = key.permute(2, 0, 1, 3).reshape(bs * self.num_cams, length, self.embed_dims)
        value = value.permute(2, 0, 1, 3).reshape(bs * self.num_cams, length, self.embed_dims)

        queries = self.deformable_attention(
            query=queries_rebatch.view(bs * self.num_cams, max_len, self.embed_dims), key=key, value=value,
            reference_points=reference_points_rebatch.view(bs * self.num_cams, max_len, depth, 2),
            spatial_shapes=spatial_shapes, level_start_index=level_start_index,
        ).view(bs, self.num_cams, max_len, self.embed_dims)
        for j in range(bs):
            for i, index_query_per_img in enumerate(indexes):
                slots[j, index_query_per_img] += queries[j, i, :len(index_query_per_img)]

        # Average over the cameras that see a query (at least one, so unseen queries stay zero).
        count = bev_mask.sum(-1) > 0
        count = count.permute(1, 2, 0).sum(-1)
        count = torch.clamp(count, min=1.0)
        slots = slots / count[..., None]
        slots = self.output_proj(slots)
        return self.dropout(slots) + inp_residual


@MODELS.register_module()
class MSDeformableAttention3D(BaseModule):
    """Deformable attention with ``num_Z_anchors`` reference points per query (one per pillar height).

    Args:
        embed_dims: channels.
        num_heads: attention heads.
        num_levels: feature levels.
        num_points: sampling points per query, head and level, split evenly over the Z anchors.
        im2col_step: mmcv CUDA kernel's step.
        dropout: unused (SpatialCrossAttention applies it), kept for the published signature.
        batch_first: query / value are (bs, n, c).
    """

    def __init__(self, embed_dims: int = 256, num_heads: int = 8, num_levels: int = 4, num_points: int = 8,
                 im2col_step: int = 64, dropout: float = 0.1, batch_first: bool = True, norm_cfg: Any = None,
                 init_cfg: Any = None) -> None:
        super().__init__(init_cfg)
        warn_head_width(embed_dims, num_heads)
        self.norm_cfg = norm_cfg
        self.batch_first = batch_first
        self.output_proj = None
        self.fp16_enabled = False
        self.im2col_step = im2col_step
        self.embed_dims = embed_dims
        self.num_levels = num_levels
        self.num_heads = num_heads
        self.num_points = num_points
        self.sampling_offsets = nn.Linear(embed_dims, num_heads * num_levels * num_points * 2)
        self.attention_weights = nn.Linear(embed_dims, num_heads * num_levels * num_points)
        self.value_proj = nn.Linear(embed_dims, embed_dims)
        self.init_weights()

    def init_weights(self) -> None:
        deformable_offsets_init(self.sampling_offsets, self.num_heads, self.num_levels, self.num_points)
        constant_init(self.attention_weights, val=0.0, bias=0.0)
        xavier_init(self.value_proj, distribution="uniform", bias=0.0)
        self._is_init = True

    def forward(self, query: torch.Tensor, key: Any = None, value: Any = None, identity: Any = None,
                query_pos: Any = None, key_padding_mask: Any = None, reference_points: Any = None,
                spatial_shapes: Any = None, level_start_index: Any = None, **kwargs: Any) -> torch.Tensor:
        """query: (bs, Q, C); value: (bs, HW, C); reference_points: (bs, Q, num_Z_anchors, 2) in [0, 1]."""
        if value is None:
            value = query
        if identity is None:
            identity = query
        if query_pos is not None:
            query = query + query_pos
        if not self.batch_first:
            query = query.permute(1, 0, 2)
            value = value.permute(1, 0, 2)
        bs, num_query, _ = query.shape
        bs, num_value, _ = value.shape
        assert (spatial_shapes[:, 0] * spatial_shapes[:, 1]).sum() == num_value

        value = self.value_proj(value)
        if key_padding_mask is not None:
            value = value.masked_fill(key_padding_mask[..., None], 0.0)
        value = value.view(bs, num_value, self.num_heads, -1)
        sampling_offsets = self.sampling_offsets(query).view(
            bs, num_query, self.num_heads, self.num_levels, self.num_points, 2)
        attention_weights = self.attention_weights(query).view(
            bs, num_query, self.num_heads, self.num_levels * self.num_points)
        attention_weights = attention_weights.softmax(-1)
        attention_weights = attention_weights.view(bs, num_query, self.num_heads, self.num_levels, self.num_points)

        if reference_points.shape[-1] == 2:
            # Each Z anchor gets num_points / num_Z_anchors of the points (anchor index fastest).
            offset_normalizer = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)  # (w, h)
            bs, num_query, num_z_anchors, xy = reference_points.shape
            reference_points = reference_points[:, :, None, None, None, :, :]
            sampling_offsets = sampling_offsets / offset_normalizer[None, None, None, :, None, :]
            bs, num_query, num_heads, num_levels, num_all_points, xy = sampling_offsets.shape
            sampling_offsets = sampling_offsets.view(
                bs, num_query, num_heads, num_levels, num_all_points // num_z_anchors, num_z_anchors, xy)
            sampling_locations = reference_points + sampling_offsets
            sampling_locations = sampling_locations.view(bs, num_query, num_heads, num_levels, num_all_points, xy)
        else:
            raise ValueError(f"reference_points must end in 2 coordinates, got {reference_points.shape[-1]}")

        if torch.cuda.is_available() and value.is_cuda:
            output = MultiScaleDeformableAttnFunction.apply(value, spatial_shapes, level_start_index,
                                                            sampling_locations, attention_weights, self.im2col_step)
        else:
            output = multi_scale_deformable_attn_pytorch(value, spatial_shapes, sampling_locations,
                                                         attention_weights)
        if not self.batch_first:
            output = output.permute(1, 0, 2)
        return output
