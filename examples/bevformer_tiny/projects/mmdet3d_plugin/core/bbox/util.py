"""3D box encodings: (x, y, z, w, l, h, yaw, vx, vy) <-> the regression targets the head predicts."""

from __future__ import annotations

import torch


def normalize_bbox(bboxes: torch.Tensor, pc_range: list[float] | None = None) -> torch.Tensor:
    """(cx, cy, log w, log l, cz, log h, sin yaw, cos yaw[, vx, vy]): the head's code order."""
    cx, cy, cz = bboxes[..., 0:1], bboxes[..., 1:2], bboxes[..., 2:3]
    w, length, h = bboxes[..., 3:4].log(), bboxes[..., 4:5].log(), bboxes[..., 5:6].log()
    rot = bboxes[..., 6:7]
    parts = [cx, cy, w, length, cz, h, rot.sin(), rot.cos()]
    if bboxes.size(-1) > 7:
        parts += [bboxes[..., 7:8], bboxes[..., 8:9]]
    return torch.cat(parts, dim=-1)


def denormalize_bbox(normalized: torch.Tensor, pc_range: list[float] | None = None) -> torch.Tensor:
    rot = torch.atan2(normalized[..., 6:7], normalized[..., 7:8])
    cx, cy, cz = normalized[..., 0:1], normalized[..., 1:2], normalized[..., 4:5]
    w, length, h = normalized[..., 2:3].exp(), normalized[..., 3:4].exp(), normalized[..., 5:6].exp()
    parts = [cx, cy, cz, w, length, h, rot]
    if normalized.size(-1) > 8:
        parts += [normalized[..., 8:9], normalized[..., 9:10]]
    return torch.cat(parts, dim=-1)
