"""PerceptionTransformer: BEV features from the cameras (encoder), then object queries on them (decoder).

Written for this example from the published BEVFormer architecture, registered in mmengine's
``MODELS``. The ego motion between frames (the can_bus entry of each sample's metadata: translation
and heading change) shifts the reference points TSA uses on the previous BEV and rotates the previous
BEV itself, and a small MLP adds the can_bus signals to every BEV query.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model import BaseModule, xavier_init
from mmengine.registry import MODELS
from torch.nn.init import normal_

from ...utils.phases import PHASES
from .decoder import CustomMSDeformableAttention
from .spatial_cross_attention import MSDeformableAttention3D
from .temporal_self_attention import TemporalSelfAttention


def rotate(img: torch.Tensor, angle: float, center: list[float]) -> torch.Tensor:
    """``img`` (C, H, W) rotated by ``angle`` degrees counter-clockwise about pixel ``center`` (x, y),
    nearest neighbour, zeros outside: torchvision's ``functional.rotate`` on tensors, without torchvision."""
    _, height, width = img.shape
    cx, cy = center[0] - width * 0.5, center[1] - height * 0.5
    rot = math.radians(-angle)
    # Inverse map from output to input pixel (origin at the image centre), as torchvision builds it.
    m = [math.cos(rot), math.sin(rot), 0.0, -math.sin(rot), math.cos(rot), 0.0]
    m[2] += m[0] * -cx + m[1] * -cy + cx
    m[5] += m[3] * -cx + m[4] * -cy + cy
    theta = torch.tensor(m, dtype=img.dtype, device=img.device).reshape(1, 2, 3)
    xs = torch.linspace(-width * 0.5 + 0.5, width * 0.5 - 0.5, width, dtype=img.dtype, device=img.device)
    ys = torch.linspace(-height * 0.5 + 0.5, height * 0.5 - 0.5, height, dtype=img.dtype, device=img.device)
    base = torch.stack([xs.expand(height, width), ys[:, None].expand(height, width), torch.ones_like(
        xs.expand(height, width))], -1)
    scale = torch.tensor([0.5 * width, 0.5 * height], dtype=img.dtype, device=img.device)
    grid = base.view(1, height * width, 3).bmm(theta.transpose(1, 2) / scale).view(1, height, width, 2)
    return F.grid_sample(img[None], grid, mode="nearest", padding_mode="zeros", align_corners=False)[0]


@MODELS.register_module()
class PerceptionTransformer(BaseModule):
    """Encoder (BEV from images) and decoder (boxes from the BEV).

    Args:
        num_feature_levels: image feature levels.
        num_cams: cameras.
        encoder / decoder: layer-sequence configs.
        embed_dims: channels.
        rotate_prev_bev / use_shift / use_can_bus / can_bus_norm / use_cams_embeds: BEVFormer's switches
            for the ego-motion compensation and the camera embeddings.
        rotate_center: pixel about which the previous BEV is rotated.
    """

    def __init__(self, num_feature_levels: int = 4, num_cams: int = 6, two_stage_num_proposals: int = 300,
                 encoder: Any = None, decoder: Any = None, embed_dims: int = 256, rotate_prev_bev: bool = True,
                 use_shift: bool = True, use_can_bus: bool = True, can_bus_norm: bool = True,
                 use_cams_embeds: bool = True, rotate_center: Any = (100, 100), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.encoder = MODELS.build(encoder)
        self.decoder = MODELS.build(decoder)
        self.embed_dims = embed_dims
        self.num_feature_levels = num_feature_levels
        self.num_cams = num_cams
        self.fp16_enabled = False
        self.rotate_prev_bev = rotate_prev_bev
        self.use_shift = use_shift
        self.use_can_bus = use_can_bus
        self.can_bus_norm = can_bus_norm
        self.use_cams_embeds = use_cams_embeds
        self.two_stage_num_proposals = two_stage_num_proposals
        self.init_layers()
        self.rotate_center = list(rotate_center)

    def init_layers(self) -> None:
        self.level_embeds = nn.Parameter(torch.Tensor(self.num_feature_levels, self.embed_dims))
        self.cams_embeds = nn.Parameter(torch.Tensor(self.num_cams, self.embed_dims))
        self.reference_points = nn.Linear(self.embed_dims, 3)
        self.can_bus_mlp = nn.Sequential(
            nn.Linear(18, self.embed_dims // 2), nn.ReLU(inplace=True),
            nn.Linear(self.embed_dims // 2, self.embed_dims), nn.ReLU(inplace=True))
        if self.can_bus_norm:
            self.can_bus_mlp.add_module("norm", nn.LayerNorm(self.embed_dims))

    def init_weights(self) -> None:
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        # The deformable attentions' own initialisation (sampling directions) after the generic one.
        for m in self.modules():
            if isinstance(m, (MSDeformableAttention3D, TemporalSelfAttention, CustomMSDeformableAttention)):
                m.init_weights()
        normal_(self.level_embeds)
        normal_(self.cams_embeds)
        xavier_init(self.reference_points, distribution="uniform", bias=0.0)
        xavier_init(self.can_bus_mlp, distribution="uniform", bias=0.0)

    def get_bev_features(self, mlvl_feats: list[torch.Tensor], bev_queries: torch.Tensor, bev_h: int, bev_w: int,
                         grid_length: Any = (0.512, 0.512), bev_pos: Any = None, prev_bev: Any = None,
                         **kwargs: Any) -> torch.Tensor:
        """BEV features (bs, H*W, C) of one frame from its camera features and the previous BEV."""
        with PHASES.forward("encoder"):
            bs = mlvl_feats[0].size(0)
            bev_queries = bev_queries.unsqueeze(1).repeat(1, bs, 1)
            bev_pos = bev_pos.flatten(2).permute(2, 0, 1)

            # Ego motion since the previous frame, in BEV cells: where the previous BEV's content now is.
            metas = kwargs["img_metas"]
            delta_x = np.array([each["can_bus"][0] for each in metas])
            delta_y = np.array([each["can_bus"][1] for each in metas])
            ego_angle = np.array([each["can_bus"][-2] / np.pi * 180 for each in metas])
            grid_length_y, grid_length_x = grid_length[0], grid_length[1]
            translation_length = np.sqrt(delta_x**2 + delta_y**2)
            translation_angle = np.arctan2(delta_y, delta_x) / np.pi * 180
            bev_angle = ego_angle - translation_angle
            shift_y = translation_length * np.cos(bev_angle / 180 * np.pi) / grid_length_y / bev_h
            shift_x = translation_length * np.sin(bev_angle / 180 * np.pi) / grid_length_x / bev_w
            shift_y = shift_y * self.use_shift
            shift_x = shift_x * self.use_shift
            shift = bev_queries.new_tensor(np.stack([shift_x, shift_y])).permute(1, 0)  # (bs, xy)

            if prev_bev is not None:
                if prev_bev.shape[1] == bev_h * bev_w:
                    prev_bev = prev_bev.permute(1, 0, 2)
                if self.rotate_prev_bev:
                    for i in range(bs):
                        rotation_angle = float(metas[i]["can_bus"][-1])
                        tmp_prev_bev = prev_bev[:, i].reshape(bev_h, bev_w, -1).permute(2, 0, 1)
                        tmp_prev_bev = rotate(tmp_prev_bev, rotation_angle, center=self.rotate_center)
                        tmp_prev_bev = tmp_prev_bev.permute(1, 2, 0).reshape(bev_h * bev_w, 1, -1)
                        prev_bev[:, i] = tmp_prev_bev[:, 0]

            can_bus = bev_queries.new_tensor(np.asarray([each["can_bus"] for each in metas]))
            can_bus = self.can_bus_mlp(can_bus)[None, :, :]
            bev_queries = bev_queries + can_bus * self.use_can_bus

            feat_flatten = []
            spatial_shapes = []
            for lvl, feat in enumerate(mlvl_feats):
                bs, _, _, h, w = feat.shape
                spatial_shapes.append((h, w))
                feat = feat.flatten(3).permute(1, 0, 3, 2)  # (cams, bs, hw, c)
                if self.use_cams_embeds:
                    feat = feat + self.cams_embeds[:, None, None, :].to(feat.dtype)
                feat = feat + self.level_embeds[None, None, lvl:lvl + 1, :].to(feat.dtype)
                feat_flatten.append(feat)
            feat_flatten = torch.cat(feat_flatten, 2)
            spatial_shapes = torch.as_tensor(spatial_shapes, dtype=torch.long, device=bev_pos.device)
            level_start_index = torch.cat((spatial_shapes.new_zeros((1,)), spatial_shapes.prod(1).cumsum(0)[:-1]))
            feat_flatten = feat_flatten.permute(0, 2, 1, 3)  # (cams, hw, bs, c)

            bev_embed = self.encoder(bev_queries, feat_flatten, feat_flatten, bev_h=bev_h, bev_w=bev_w,
                                     bev_pos=bev_pos, spatial_shapes=spatial_shapes,
                                     level_start_index=level_start_index, prev_bev=prev_bev, shift=shift, **kwargs)
        PHASES.mark("bev_embed", bev_embed)
        return bev_embed

    def forward(self, mlvl_feats: list[torch.Tensor], bev_queries: torch.Tensor, object_query_embed: torch.Tensor,
                bev_h: int, bev_w: int, grid_length: Any = (0.512, 0.512), bev_pos: Any = None,
                reg_branches: Any = None, cls_branches: Any = None, prev_bev: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        bev_embed = self.get_bev_features(mlvl_feats, bev_queries, bev_h, bev_w, grid_length=grid_length,
                                          bev_pos=bev_pos, prev_bev=prev_bev, **kwargs)
        with PHASES.forward("decoder"):
            bs = mlvl_feats[0].size(0)
            query_pos, query = torch.split(object_query_embed, self.embed_dims, dim=1)
            query_pos = query_pos.unsqueeze(0).expand(bs, -1, -1)
            query = query.unsqueeze(0).expand(bs, -1, -1)
            reference_points = self.reference_points(query_pos).sigmoid()
            init_reference_out = reference_points
            query = query.permute(1, 0, 2)
            query_pos = query_pos.permute(1, 0, 2)
            bev_embed = bev_embed.permute(1, 0, 2)
            inter_states, inter_references = self.decoder(
                query=query, key=None, value=bev_embed, query_pos=query_pos, reference_points=reference_points,
                reg_branches=reg_branches, cls_branches=cls_branches,
                spatial_shapes=torch.tensor([[bev_h, bev_w]], device=query.device),
                level_start_index=torch.tensor([0], device=query.device), **kwargs)
        PHASES.mark("decoder_out", inter_states)
        return bev_embed, inter_states, init_reference_out, inter_references
