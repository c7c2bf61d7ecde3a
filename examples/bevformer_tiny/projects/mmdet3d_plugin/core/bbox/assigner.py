"""One-to-one matching of predictions to ground-truth boxes (DETR's Hungarian matching), in 3D.

Costs as BEVFormer-tiny's config weighs them: focal classification cost (weight 2.0) plus the L1
distance of the first eight box codes (weight 0.25); the matching itself is scipy's
``linear_sum_assignment`` on the CPU, as upstream does it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from mmengine.registry import TASK_UTILS
from scipy.optimize import linear_sum_assignment

from .util import normalize_bbox


@dataclass
class AssignResult:
    num_gts: int
    gt_inds: torch.Tensor  # 0: background, i > 0: matched to gt i - 1
    labels: torch.Tensor  # -1: background


def focal_loss_cost(cls_pred: torch.Tensor, gt_labels: torch.Tensor, weight: float, alpha: float = 0.25,
                    gamma: float = 2.0, eps: float = 1e-12) -> torch.Tensor:
    """(num_query, num_gt): focal loss of predicting each gt's class, minus that of not predicting it."""
    prob = cls_pred.sigmoid()
    neg = -(1 - prob + eps).log() * (1 - alpha) * prob.pow(gamma)
    pos = -(prob + eps).log() * alpha * (1 - prob).pow(gamma)
    return (pos[:, gt_labels] - neg[:, gt_labels]) * weight


@TASK_UTILS.register_module()
class HungarianAssigner3D:
    """Match each ground-truth box to one query, minimising classification + box L1 cost.

    Args:
        cls_cost: ``dict(type='FocalLossCost', weight=...)``.
        reg_cost: ``dict(type='BBox3DL1Cost', weight=...)``.
        iou_cost: accepted for configs that pass it; weight 0 in BEVFormer (unused).
        pc_range: the BEV volume (box codes are not normalised by it in BEVFormer).
    """

    def __init__(self, cls_cost: Any = None, reg_cost: Any = None, iou_cost: Any = None,
                 pc_range: Any = None) -> None:
        self.cls_weight = float((cls_cost or {}).get("weight", 1.0))
        self.reg_weight = float((reg_cost or {}).get("weight", 1.0))
        self.pc_range = pc_range

    def assign(self, bbox_pred: torch.Tensor, cls_pred: torch.Tensor, gt_bboxes: torch.Tensor,
               gt_labels: torch.Tensor) -> AssignResult:
        num_gts, num_bboxes = gt_bboxes.size(0), bbox_pred.size(0)
        gt_inds = bbox_pred.new_zeros((num_bboxes,), dtype=torch.long)
        labels = bbox_pred.new_full((num_bboxes,), -1, dtype=torch.long)
        if num_gts == 0 or num_bboxes == 0:
            return AssignResult(num_gts, gt_inds, labels)
        with torch.no_grad():
            cls_cost = focal_loss_cost(cls_pred, gt_labels, self.cls_weight)
            normalized_gt = normalize_bbox(gt_bboxes, self.pc_range)
            reg_cost = torch.cdist(bbox_pred[:, :8], normalized_gt[:, :8], p=1) * self.reg_weight
            cost = (cls_cost + reg_cost).cpu()
        rows, cols = linear_sum_assignment(cost.numpy())
        rows_t = torch.from_numpy(rows).to(bbox_pred.device)
        cols_t = torch.from_numpy(cols).to(bbox_pred.device)
        gt_inds[rows_t] = cols_t + 1
        labels[rows_t] = gt_labels[cols_t]
        return AssignResult(num_gts, gt_inds, labels)
