"""The detection decoder: object queries attend to the BEV through deformable attention.

Written for this example from the published BEVFormer architecture (class names, constructor
parameters, forward signatures), registered in mmengine's ``MODELS``. ``DetectionTransformerDecoder``
refines 3D reference points layer by layer with the head's regression branches (box refinement);
``CustomMSDeformableAttention`` is Deformable DETR's attention on the BEV plane.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from mmcv.cnn.bricks.transformer import TransformerLayerSequence
from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttnFunction, multi_scale_deformable_attn_pytorch
from mmengine.model import BaseModule, constant_init, xavier_init
from mmengine.registry import MODELS
from mmengine.utils import deprecated_api_warning

from .temporal_self_attention import deformable_offsets_init, warn_head_width


def inverse_sigmoid(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    x = x.clamp(min=0, max=1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


@MODELS.register_module()
class DetectionTransformerDecoder(TransformerLayerSequence):
    """Decoder layers with iterative 3D reference-point refinement.

    Args:
        return_intermediate: return every layer's output (the head predicts from each).
    """

    def __init__(self, *args: Any, return_intermediate: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.return_intermediate = return_intermediate
        self.fp16_enabled = False

    def forward(self, query: torch.Tensor, *args: Any, reference_points: Any = None, reg_branches: Any = None,
                key_padding_mask: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """query: (num_query, bs, C); reference_points: (bs, num_query, 3), sigmoid space."""
        output = query
        intermediate = []
        intermediate_reference_points = []
        for lid, layer in enumerate(self.layers):
            reference_points_input = reference_points[..., :2].unsqueeze(2)  # (bs, Q, levels=1, 2)
            output = layer(output, *args, reference_points=reference_points_input,
                           key_padding_mask=key_padding_mask, **kwargs)
            output = output.permute(1, 0, 2)
            if reg_branches is not None:
                tmp = reg_branches[lid](output)
                assert reference_points.shape[-1] == 3
                new_reference_points = torch.zeros_like(reference_points)
                new_reference_points[..., :2] = tmp[..., :2] + inverse_sigmoid(reference_points[..., :2])
                new_reference_points[..., 2:3] = tmp[..., 4:5] + inverse_sigmoid(reference_points[..., 2:3])
                # Each layer refines the previous layer's points; no gradient through the chain.
                reference_points = new_reference_points.sigmoid().detach()
            output = output.permute(1, 0, 2)
            if self.return_intermediate:
                intermediate.append(output)
                intermediate_reference_points.append(reference_points)
        if self.return_intermediate:
            return torch.stack(intermediate), torch.stack(intermediate_reference_points)
        return output, reference_points


@MODELS.register_module()
class CustomMSDeformableAttention(BaseModule):
    """Deformable DETR's multi-scale deformable attention, as BEVFormer's decoder uses it.

    Args:
        embed_dims: channels.
        num_heads: attention heads.
        num_levels: feature levels (1: the BEV plane).
        num_points: sampling points per query, head and level.
        im2col_step: mmcv CUDA kernel's step.
        dropout: dropout on the output before the residual.
        batch_first: query / value are (bs, n, c) rather than (n, bs, c).
    """

    def __init__(self, embed_dims: int = 256, num_heads: int = 8, num_levels: int = 4, num_points: int = 4,
                 im2col_step: int = 64, dropout: float = 0.1, batch_first: bool = False, norm_cfg: Any = None,
                 init_cfg: Any = None) -> None:
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
        self.sampling_offsets = nn.Linear(embed_dims, num_heads * num_levels * num_points * 2)
        self.attention_weights = nn.Linear(embed_dims, num_heads * num_levels * num_points)
        self.value_proj = nn.Linear(embed_dims, embed_dims)
        self.output_proj = nn.Linear(embed_dims, embed_dims)
        self.init_weights()

    def init_weights(self) -> None:
        deformable_offsets_init(self.sampling_offsets, self.num_heads, self.num_levels, self.num_points)
        constant_init(self.attention_weights, val=0.0, bias=0.0)
        xavier_init(self.value_proj, distribution="uniform", bias=0.0)
        xavier_init(self.output_proj, distribution="uniform", bias=0.0)
        self._is_init = True

    @deprecated_api_warning({"residual": "identity"}, cls_name="MultiScaleDeformableAttention")
    def forward(self, query: torch.Tensor, key: Any = None, value: Any = None, identity: Any = None,
                query_pos: Any = None, key_padding_mask: Any = None, reference_points: Any = None,
                spatial_shapes: Any = None, level_start_index: Any = None, flag: str = "decoder",
                **kwargs: Any) -> torch.Tensor:
        """query: (Q, bs, C) unless batch_first; value: the BEV, (HW, bs, C); reference_points:
        (bs, Q, levels, 2) or (bs, Q, levels, 4) boxes."""
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
            offset_normalizer = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)  # (w, h)
            sampling_locations = (reference_points[:, :, None, :, None, :]
                                  + sampling_offsets / offset_normalizer[None, None, None, :, None, :])
        elif reference_points.shape[-1] == 4:
            sampling_locations = (reference_points[:, :, None, :, None, :2] + sampling_offsets / self.num_points
                                  * reference_points[:, :, None, :, None, 2:] * 0.5)
        else:
            raise ValueError(f"reference_points must end in 2 or 4 coordinates, got {reference_points.shape[-1]}")

        if torch.cuda.is_available() and value.is_cuda:
            output = MultiScaleDeformableAttnFunction.apply(value, spatial_shapes, level_start_index,
                                                            sampling_locations, attention_weights, self.im2col_step)
        else:
            output = multi_scale_deformable_attn_pytorch(value, spatial_shapes, sampling_locations,
                                                         attention_weights)
        output = self.output_proj(output)
        if not self.batch_first:
            output = output.permute(1, 0, 2)
        return self.dropout(output) + identity
