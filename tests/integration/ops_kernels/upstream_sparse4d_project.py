"""A Sparse4D-style DeformableFeatureAggregation package for loongkit's tests and benchmarks (no OpenMMLab here).

``source()`` is the text of a vendored ``blocks.py`` (written for this project from the published
Sparse4D v3 algorithm: same public interface and maths, no upstream code): ``KeyPoints`` (7 fixed key
points on the box and learnable ones) and ``DeformableFeatureAggregation`` with both aggregation paths
(the CUDA extension ``DAF`` when ``use_deformable_func``, else one ``grid_sample`` per level, what runs
on CPU), registered in a ``MODELS`` registry: mmengine's (``registry="mmengine"``, the integration
tests) or a ``Registry("models")`` of the module the caller names (the mmcv 1.x double in
``benchmarks/models.py``, with ``nn.Module`` for mmengine's ``BaseModule``). ``write_project`` writes it
as a ``projects``-style package; ``cameras``/``inputs``/``build`` make Sparse4D v3-shaped inputs
(6 cameras, 4 levels 64x176 .. 8x22, 256 channels) and a randomised module.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import torch

LEVELS = [(64, 176), (32, 88), (16, 44), (8, 22)]

SOURCE = textwrap.dedent('''
    """Sparse4D-style blocks written for loongkit's tests (interface and maths of the published model)."""
    from typing import List, Optional

    import torch
    from torch import nn
    {imports}

    DAF = None  # the CUDA extension; tests may install a stand-in


    @MODELS.register_module(force=True)
    class KeyPoints(BaseModule):
        """7 fixed key points on the box (centre, +-x, +-y, +-z faces) and learnable ones."""

        def __init__(self, embed_dims=256, num_learnable_pts=6):
            super().__init__()
            fixed = [[0, 0, 0], [0.45, 0, 0], [-0.45, 0, 0], [0, 0.45, 0], [0, -0.45, 0], [0, 0, 0.45],
                     [0, 0, -0.45]]
            self.register_buffer("fixed", torch.tensor(fixed, dtype=torch.float32))
            self.num_learnable_pts = num_learnable_pts
            self.num_pts = len(fixed) + num_learnable_pts
            self.learnable_fc = nn.Linear(embed_dims, num_learnable_pts * 3)

        def forward(self, anchor, instance_feature):
            bs, num_anchor = anchor.shape[:2]
            learned = self.learnable_fc(instance_feature).reshape(bs, num_anchor, self.num_learnable_pts, 3)
            scale = torch.cat([self.fixed.to(anchor.dtype).expand(bs, num_anchor, -1, -1),
                               learned.sigmoid() - 0.5], dim=2)
            pts = scale * anchor[:, :, None, 3:6].exp()
            sin, cos = anchor[:, :, None, 6], anchor[:, :, None, 7]
            x = cos * pts[..., 0] - sin * pts[..., 1]
            y = sin * pts[..., 0] + cos * pts[..., 1]
            return torch.stack([x, y, pts[..., 2]], -1) + anchor[:, :, None, :3]


    @MODELS.register_module(force=True)
    class DeformableFeatureAggregation(BaseModule):
        def __init__(self, embed_dims=256, num_groups=8, num_levels=4, num_cams=6, proj_drop=0.0, attn_drop=0.0,
                     kps_generator=None, temporal_fusion_module=None, use_temporal_anchor_embed=True,
                     use_deformable_func=False, use_camera_embed=False, residual_mode="add"):
            super().__init__()
            self.group_dims = embed_dims // num_groups
            self.embed_dims = embed_dims
            self.num_levels = num_levels
            self.num_groups = num_groups
            self.num_cams = num_cams
            self.use_deformable_func = use_deformable_func
            self.attn_drop = attn_drop
            self.residual_mode = residual_mode
            self.proj_drop = nn.Dropout(proj_drop)
            self.kps_generator = MODELS.build({**kps_generator, "embed_dims": embed_dims})
            self.num_pts = self.kps_generator.num_pts
            self.output_proj = nn.Linear(embed_dims, embed_dims)
            self.camera_encoder = None
            self.weights_fc = nn.Linear(embed_dims, num_groups * num_cams * num_levels * self.num_pts)

        def forward(self, instance_feature, anchor, anchor_embed, feature_maps, metas, **kwargs):
            bs, num_anchor = instance_feature.shape[:2]
            key_points = self.kps_generator(anchor, instance_feature)
            weights = self._get_weights(instance_feature, anchor_embed, metas)
            if self.use_deformable_func:
                points_2d = self.project_points(key_points, metas["projection_mat"], metas.get("image_wh"))
                points_2d = points_2d.permute(0, 2, 3, 1, 4).reshape(bs, num_anchor, self.num_pts, self.num_cams, 2)
                weights = weights.permute(0, 1, 4, 2, 3, 5).contiguous().reshape(
                    bs, num_anchor, self.num_pts, self.num_cams, self.num_levels, self.num_groups)
                features = DAF(*feature_maps, points_2d, weights).reshape(bs, num_anchor, self.embed_dims)
            else:
                features = self.feature_sampling(feature_maps, key_points, metas["projection_mat"],
                                                 metas.get("image_wh"))
                features = self.multi_view_level_fusion(features, weights)
                features = features.sum(dim=2)
            output = self.proj_drop(self.output_proj(features))
            if self.residual_mode == "add":
                output = output + instance_feature
            elif self.residual_mode == "cat":
                output = torch.cat([output, instance_feature], dim=-1)
            return output

        def _get_weights(self, instance_feature, anchor_embed, metas=None):
            bs, num_anchor = instance_feature.shape[:2]
            logits = self.weights_fc(instance_feature + anchor_embed).reshape(bs, num_anchor, -1, self.num_groups)
            weights = logits.softmax(dim=-2).reshape(bs, num_anchor, self.num_cams, self.num_levels, self.num_pts,
                                                     self.num_groups)
            if self.training and self.attn_drop > 0:
                keep = torch.rand(bs, num_anchor, self.num_cams, 1, self.num_pts, 1).to(weights) > self.attn_drop
                weights = keep * weights / (1 - self.attn_drop)
            return weights

        @staticmethod
        def project_points(key_points, projection_mat, image_wh=None):
            homogeneous = torch.cat([key_points, torch.ones_like(key_points[..., :1])], dim=-1)
            points = torch.matmul(projection_mat[:, :, None, None], homogeneous[:, None, ..., None]).squeeze(-1)
            points_2d = points[..., :2] / torch.clamp(points[..., 2:3], min=1e-5)
            if image_wh is not None:
                points_2d = points_2d / image_wh[:, :, None, None]
            return points_2d

        @staticmethod
        def feature_sampling(feature_maps: List[torch.Tensor], key_points: torch.Tensor,
                             projection_mat: torch.Tensor, image_wh: Optional[torch.Tensor] = None) -> torch.Tensor:
            num_levels = len(feature_maps)
            num_cams = feature_maps[0].shape[1]
            bs, num_anchor, num_pts = key_points.shape[:3]
            grid = DeformableFeatureAggregation.project_points(key_points, projection_mat, image_wh) * 2 - 1
            grid = grid.flatten(end_dim=1)
            sampled = []
            for fm in feature_maps:
                sampled.append(torch.nn.functional.grid_sample(fm.flatten(end_dim=1), grid))
            sampled = torch.stack(sampled, dim=1)
            return sampled.reshape(bs, num_cams, num_levels, -1, num_anchor, num_pts).permute(0, 4, 1, 2, 5, 3)

        def multi_view_level_fusion(self, features, weights):
            bs, num_anchor = weights.shape[:2]
            features = weights[..., None] * features.reshape(features.shape[:-1] + (self.num_groups, self.group_dims))
            features = features.sum(dim=2).sum(dim=2)
            return features.reshape(bs, num_anchor, self.num_pts, self.embed_dims)
''')


def source(registry: str = "mmengine") -> str:
    """blocks.py registering in mmengine's MODELS, or in ``Registry("models")`` of module ``registry``."""
    if registry == "mmengine":
        imports = "from mmengine.model import BaseModule\nfrom mmengine.registry import MODELS"
    else:
        imports = (f"from torch.nn import Module as BaseModule\nfrom {registry} import Registry\n\n"
                   'MODELS = Registry("models")')
    return SOURCE.replace("{imports}", imports)


def write_project(root: Path, package: str, blocks: str) -> str:
    """projects/<package>/models/blocks.py under ``root``; returns the module name to import."""
    models = root / package / "models"
    models.mkdir(parents=True)
    (root / package / "__init__.py").write_text("from . import models\n")
    (models / "__init__.py").write_text("from .blocks import DeformableFeatureAggregation, KeyPoints\n")
    (models / "blocks.py").write_text(blocks)
    return f"{package}.models.blocks"


def cameras(bs: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Six cameras around the ego car (yaw 0, 60, ... 300 degrees), 704x256 images, 4x4 projections."""
    w, h = 704.0, 256.0
    mats = []
    for cam in range(6):
        yaw = math.radians(60 * cam) + float(torch.rand((), generator=gen)) * 0.1
        forward = torch.tensor([math.cos(yaw), math.sin(yaw), 0.0])
        right = torch.tensor([math.sin(yaw), -math.cos(yaw), 0.0])
        down = torch.tensor([0.0, 0.0, -1.0])
        rot = torch.stack([right, down, forward])  # lidar -> camera axes (x right, y down, z forward)
        extrinsic = torch.eye(4)
        extrinsic[:3, :3] = rot
        extrinsic[:3, 3] = -rot @ torch.tensor([0.5, 0.0, 1.6])
        intrinsic = torch.eye(4)
        intrinsic[0, 0] = intrinsic[1, 1] = 0.55 * w
        intrinsic[0, 2], intrinsic[1, 2] = w / 2, h / 2
        mats.append(intrinsic @ extrinsic)
    projection = torch.stack(mats).to(dtype).expand(bs, -1, -1, -1).contiguous()
    image_wh = torch.tensor([w, h], dtype=dtype).expand(bs, 6, 2).contiguous()
    return {"projection_mat": projection, "image_wh": image_wh}


def inputs(bs: int, anchors: int, dtype: torch.dtype, gen: torch.Generator, channels: int = 256,
           levels: list[tuple[int, int]] = LEVELS) -> dict[str, Any]:
    """Anchors within 40 m (Sparse4D's 11-dim boxes), random feature maps, :func:`cameras`."""
    anchor = torch.zeros(bs, anchors, 11, dtype=dtype)
    anchor[..., :2] = torch.rand(bs, anchors, 2, generator=gen, dtype=dtype) * 80 - 40
    anchor[..., 2] = torch.rand(bs, anchors, generator=gen, dtype=dtype) * 2 - 1
    anchor[..., 3:6] = torch.rand(bs, anchors, 3, generator=gen, dtype=dtype) * 2
    yaw = torch.rand(bs, anchors, generator=gen, dtype=dtype) * 2 * math.pi
    anchor[..., 6], anchor[..., 7] = yaw.sin(), yaw.cos()
    return {
        "instance_feature": torch.randn(bs, anchors, channels, generator=gen, dtype=dtype),
        "anchor": anchor,
        "anchor_embed": torch.randn(bs, anchors, channels, generator=gen, dtype=dtype),
        "feature_maps": [torch.randn(bs, 6, channels, h, w, generator=gen, dtype=dtype) for h, w in levels],
        "metas": cameras(bs, dtype, gen),
    }


def build(module: Any, dtype: torch.dtype, gen: torch.Generator, **cfg: Any) -> Any:
    """The package's DeformableFeatureAggregation with KeyPoints, parameters random (std 0.05)."""
    dfa = module.DeformableFeatureAggregation(kps_generator={"type": "KeyPoints"}, **cfg).to(dtype)
    with torch.no_grad():  # upstream init zeroes weights_fc: randomise so every weight matters
        for p in dfa.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.05)
    return dfa
