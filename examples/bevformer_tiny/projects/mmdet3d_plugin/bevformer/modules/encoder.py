"""The BEV encoder: BEV queries, temporal self-attention, spatial cross-attention, FFN; three times.

Written for this example from the published BEVFormer architecture, registered in mmengine's
``MODELS``. ``BEVFormerEncoder.point_sampling`` projects each BEV pillar's 3D anchors into every
camera with ``lidar2img`` and keeps which land inside the image (``bev_mask``); ``BEVFormerLayer`` runs
``('self_attn', 'norm', 'cross_attn', 'norm', 'ffn', 'norm')`` with the previous BEV as the self-
attention's value.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import numpy as np
import torch
from mmcv.cnn.bricks.transformer import BaseTransformerLayer, TransformerLayerSequence
from mmengine.registry import MODELS


@MODELS.register_module()
class BEVFormerEncoder(TransformerLayerSequence):
    """Encoder layers over the BEV queries.

    Args:
        pc_range: [x_min, y_min, z_min, x_max, y_max, z_max] of the BEV volume (metres, ego frame).
        num_points_in_pillar: 3D anchors per BEV cell, spread over the height.
        return_intermediate: return every layer's BEV.
    """

    def __init__(self, *args: Any, pc_range: Any = None, num_points_in_pillar: int = 4,
                 return_intermediate: bool = False, dataset_type: str = "nuscenes", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.return_intermediate = return_intermediate
        self.num_points_in_pillar = num_points_in_pillar
        self.pc_range = pc_range
        self.fp16_enabled = False

    @staticmethod
    def get_reference_points(H: int, W: int, Z: float = 8, num_points_in_pillar: int = 4, dim: str = "3d",
                             bs: int = 1, device: Any = "cpu", dtype: torch.dtype = torch.float) -> torch.Tensor:
        """Cell centres in [0, 1]: '3d' (bs, pillar points, H*W, 3) for SCA, '2d' (bs, H*W, 1, 2) for TSA."""
        if dim == "3d":
            zs = torch.linspace(0.5, Z - 0.5, num_points_in_pillar, dtype=dtype, device=device).view(
                -1, 1, 1).expand(num_points_in_pillar, H, W) / Z
            xs = torch.linspace(0.5, W - 0.5, W, dtype=dtype, device=device).view(1, 1, W).expand(
                num_points_in_pillar, H, W) / W
            ys = torch.linspace(0.5, H - 0.5, H, dtype=dtype, device=device).view(1, H, 1).expand(
                num_points_in_pillar, H, W) / H
            ref_3d = torch.stack((xs, ys, zs), -1)
            ref_3d = ref_3d.permute(0, 3, 1, 2).flatten(2).permute(0, 2, 1)
            return ref_3d[None].repeat(bs, 1, 1, 1)
        ref_y, ref_x = torch.meshgrid(torch.linspace(0.5, H - 0.5, H, dtype=dtype, device=device),
                                      torch.linspace(0.5, W - 0.5, W, dtype=dtype, device=device), indexing="ij")
        ref_y = ref_y.reshape(-1)[None] / H
        ref_x = ref_x.reshape(-1)[None] / W
        ref_2d = torch.stack((ref_x, ref_y), -1)
        return ref_2d.repeat(bs, 1, 1).unsqueeze(2)

    def point_sampling(self, reference_points: torch.Tensor, pc_range: Any,
                       img_metas: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """Project the pillars' anchors into each camera: (cams, bs, HW, D, 2) in [0, 1] and the mask."""
        lidar2img = reference_points.new_tensor(np.asarray([meta["lidar2img"] for meta in img_metas]))  # (B, N, 4, 4)
        reference_points = reference_points.clone()
        reference_points[..., 0:1] = reference_points[..., 0:1] * (pc_range[3] - pc_range[0]) + pc_range[0]
        reference_points[..., 1:2] = reference_points[..., 1:2] * (pc_range[4] - pc_range[1]) + pc_range[1]
        reference_points[..., 2:3] = reference_points[..., 2:3] * (pc_range[5] - pc_range[2]) + pc_range[2]
        reference_points = torch.cat((reference_points, torch.ones_like(reference_points[..., :1])), -1)
        reference_points = reference_points.permute(1, 0, 2, 3)
        depth, batch, num_query = reference_points.size()[:3]
        num_cam = lidar2img.size(1)
        reference_points = reference_points.view(depth, batch, 1, num_query, 4).repeat(
            1, 1, num_cam, 1, 1).unsqueeze(-1)
        lidar2img = lidar2img.view(1, batch, num_cam, 1, 4, 4).repeat(depth, 1, 1, num_query, 1, 1)
        reference_points_cam = torch.matmul(lidar2img.to(torch.float32),
                                            reference_points.to(torch.float32)).squeeze(-1)
        eps = 1e-5
        bev_mask = reference_points_cam[..., 2:3] > eps  # in front of the camera
        reference_points_cam = reference_points_cam[..., 0:2] / torch.maximum(
            reference_points_cam[..., 2:3], torch.ones_like(reference_points_cam[..., 2:3]) * eps)
        reference_points_cam[..., 0] /= img_metas[0]["img_shape"][0][1]
        reference_points_cam[..., 1] /= img_metas[0]["img_shape"][0][0]
        bev_mask = (bev_mask & (reference_points_cam[..., 1:2] > 0.0) & (reference_points_cam[..., 1:2] < 1.0)
                    & (reference_points_cam[..., 0:1] < 1.0) & (reference_points_cam[..., 0:1] > 0.0))
        bev_mask = torch.nan_to_num(bev_mask)
        reference_points_cam = reference_points_cam.permute(2, 1, 3, 0, 4)
        bev_mask = bev_mask.permute(2, 1, 3, 0, 4).squeeze(-1)
        return reference_points_cam, bev_mask

    def forward(self, bev_query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                bev_h: int | None = None, bev_w: int | None = None, bev_pos: Any = None, spatial_shapes: Any = None,
                level_start_index: Any = None, valid_ratios: Any = None, prev_bev: Any = None, shift: Any = 0.0,
                **kwargs: Any) -> torch.Tensor:
        """bev_query: (HW, bs, C); key/value: (cams, HW_img, bs, C); prev_bev: (HW, bs, C) or None."""
        output = bev_query
        intermediate = []
        bs = bev_query.size(1)
        ref_3d = self.get_reference_points(bev_h, bev_w, self.pc_range[5] - self.pc_range[2],
                                           self.num_points_in_pillar, dim="3d", bs=bs, device=bev_query.device,
                                           dtype=bev_query.dtype)
        ref_2d = self.get_reference_points(bev_h, bev_w, dim="2d", bs=bs, device=bev_query.device,
                                           dtype=bev_query.dtype)
        reference_points_cam, bev_mask = self.point_sampling(ref_3d, self.pc_range, kwargs["img_metas"])

        # The previous BEV is looked up where the ego was: reference points shifted by the ego motion.
        shift_ref_2d = ref_2d.clone()
        shift_ref_2d += shift[:, None, None, :]
        bev_query = bev_query.permute(1, 0, 2)
        bev_pos = bev_pos.permute(1, 0, 2)
        bs, len_bev, num_bev_level, _ = ref_2d.shape
        if prev_bev is not None:
            prev_bev = prev_bev.permute(1, 0, 2)
            prev_bev = torch.stack([prev_bev, bev_query], 1).reshape(bs * 2, len_bev, -1)
            hybird_ref_2d = torch.stack([shift_ref_2d, ref_2d], 1).reshape(bs * 2, len_bev, num_bev_level, 2)
        else:
            hybird_ref_2d = torch.stack([ref_2d, ref_2d], 1).reshape(bs * 2, len_bev, num_bev_level, 2)

        for layer in self.layers:
            output = layer(bev_query, key, value, *args, bev_pos=bev_pos, ref_2d=hybird_ref_2d, ref_3d=ref_3d,
                           bev_h=bev_h, bev_w=bev_w, spatial_shapes=spatial_shapes,
                           level_start_index=level_start_index, reference_points_cam=reference_points_cam,
                           bev_mask=bev_mask, prev_bev=prev_bev, **kwargs)
            bev_query = output
            if self.return_intermediate:
                intermediate.append(output)
        if self.return_intermediate:
            return torch.stack(intermediate)
        return output


@MODELS.register_module()
class MyCustomBaseTransformerLayer(BaseTransformerLayer):
    """mmcv's BaseTransformerLayer, batch-first by default, taking the FFN settings as BEVFormer's
    configs give them (``feedforward_channels``, ``ffn_dropout``, ``ffn_num_fcs``)."""

    def __init__(self, attn_cfgs: Any = None, ffn_cfgs: Any = None, operation_order: Any = None,
                 norm_cfg: Any = None, init_cfg: Any = None, batch_first: bool = True, **kwargs: Any) -> None:
        ffn = dict(type="FFN", feedforward_channels=1024, num_fcs=2, ffn_drop=0.0,  # embed_dims: the attentions'
                   act_cfg=dict(type="ReLU", inplace=True))
        ffn.update(ffn_cfgs or {})
        for old, new in (("feedforward_channels", "feedforward_channels"), ("ffn_dropout", "ffn_drop"),
                         ("ffn_num_fcs", "num_fcs"), ("act_cfg", "act_cfg")):
            if old in kwargs:
                ffn[new] = kwargs.pop(old)
        if kwargs:
            warnings.warn(f"{type(self).__name__} ignores {sorted(kwargs)}", stacklevel=2)
        super().__init__(attn_cfgs=copy.deepcopy(attn_cfgs), ffn_cfgs=ffn, operation_order=operation_order,
                         norm_cfg=norm_cfg or dict(type="LN"), init_cfg=init_cfg, batch_first=batch_first)


@MODELS.register_module()
class BEVFormerLayer(MyCustomBaseTransformerLayer):
    """One encoder layer: TSA (value: [previous BEV, current BEV]), SCA into the cameras, FFN."""

    def __init__(self, attn_cfgs: Any, feedforward_channels: int, ffn_dropout: float = 0.0,
                 operation_order: Any = None, act_cfg: Any = None, norm_cfg: Any = None, ffn_num_fcs: int = 2,
                 **kwargs: Any) -> None:
        super().__init__(attn_cfgs=attn_cfgs, feedforward_channels=feedforward_channels, ffn_dropout=ffn_dropout,
                         operation_order=operation_order, act_cfg=act_cfg or dict(type="ReLU", inplace=True),
                         norm_cfg=norm_cfg or dict(type="LN"), ffn_num_fcs=ffn_num_fcs, **kwargs)
        self.fp16_enabled = False
        assert len(operation_order) == 6
        assert set(operation_order) == {"self_attn", "norm", "cross_attn", "ffn"}

    def forward(self, query: torch.Tensor, key: Any = None, value: Any = None, bev_pos: Any = None,
                query_pos: Any = None, key_pos: Any = None, attn_masks: Any = None,
                query_key_padding_mask: Any = None, key_padding_mask: Any = None, ref_2d: Any = None,
                ref_3d: Any = None, bev_h: int | None = None, bev_w: int | None = None,
                reference_points_cam: Any = None, mask: Any = None, spatial_shapes: Any = None,
                level_start_index: Any = None, prev_bev: Any = None, **kwargs: Any) -> torch.Tensor:
        norm_index = attn_index = ffn_index = 0
        identity = query
        if attn_masks is None:
            attn_masks = [None for _ in range(self.num_attn)]
        for layer in self.operation_order:
            if layer == "self_attn":
                query = self.attentions[attn_index](
                    query, prev_bev, prev_bev, identity if self.pre_norm else None, query_pos=bev_pos,
                    key_pos=bev_pos, attn_mask=attn_masks[attn_index], key_padding_mask=query_key_padding_mask,
                    reference_points=ref_2d, spatial_shapes=torch.tensor([[bev_h, bev_w]], device=query.device),
                    level_start_index=torch.tensor([0], device=query.device), **kwargs)
                attn_index += 1
                identity = query
            elif layer == "norm":
                query = self.norms[norm_index](query)
                norm_index += 1
            elif layer == "cross_attn":
                query = self.attentions[attn_index](
                    query, key, value, identity if self.pre_norm else None, query_pos=query_pos, key_pos=key_pos,
                    reference_points=ref_3d, reference_points_cam=reference_points_cam, mask=mask,
                    attn_mask=attn_masks[attn_index], key_padding_mask=key_padding_mask,
                    spatial_shapes=spatial_shapes, level_start_index=level_start_index, **kwargs)
                attn_index += 1
                identity = query
            elif layer == "ffn":
                query = self.ffns[ffn_index](query, identity if self.pre_norm else None)
                ffn_index += 1
        return query
