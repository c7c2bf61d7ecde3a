"""BEVFormerHead: BEV queries and object queries into the transformer; class and box per decoder layer.

Written for this example from the published BEVFormer architecture (a DETR-style head with box
refinement), registered in mmengine's ``MODELS`` for an OpenMMLab 2.x stack. Training loss per
decoder layer: Hungarian matching (:class:`HungarianAssigner3D`), sigmoid focal loss on the classes
(mmdet's ``FocalLoss``) and L1 on the box codes (mmdet's ``L1Loss``, per-code weights), averaged over
the matched boxes; the last layer's terms are ``loss_cls`` / ``loss_bbox``, the others ``d<i>.*``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
from mmengine.model import BaseModule, bias_init_with_prob
from mmengine.registry import MODELS, TASK_UTILS

from ...core.bbox.util import normalize_bbox
from ...utils.phases import PHASES
from ..modules.decoder import inverse_sigmoid


@MODELS.register_module()
class BEVFormerHead(BaseModule):
    """Args (BEVFormer's): bev_h/bev_w BEV grid; num_query object queries; num_classes; in_channels
    (= embed dims); with_box_refine (a regression branch per decoder layer refines its reference
    points); transformer; positional_encoding (of the BEV grid); loss_cls / loss_bbox; code_size /
    code_weights of the box codes; train_cfg with the assigner; pc_range of the BEV volume."""

    def __init__(self, *args: Any, num_classes: int = 10, in_channels: int = 256, num_query: int = 900,
                 num_reg_fcs: int = 2, with_box_refine: bool = False, as_two_stage: bool = False,
                 transformer: Any = None, bbox_coder: Any = None, num_cls_fcs: int = 2, code_weights: Any = None,
                 bev_h: int = 30, bev_w: int = 30, positional_encoding: Any = None, loss_cls: Any = None,
                 loss_bbox: Any = None, loss_iou: Any = None, train_cfg: Any = None, test_cfg: Any = None,
                 sync_cls_avg_factor: bool = False, code_size: int = 10, init_cfg: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(init_cfg)
        self.bev_h, self.bev_w = bev_h, bev_w
        self.fp16_enabled = False
        self.with_box_refine = with_box_refine
        self.as_two_stage = as_two_stage
        self.code_size = code_size
        self.code_weights_list = code_weights or [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.2, 0.2]
        self.pc_range = (bbox_coder or {}).get("pc_range", [-51.2, -51.2, -5.0, 51.2, 51.2, 3.0])
        self.real_w = self.pc_range[3] - self.pc_range[0]
        self.real_h = self.pc_range[4] - self.pc_range[1]
        self.num_classes = num_classes
        self.cls_out_channels = num_classes  # sigmoid classification: no background channel
        self.embed_dims = in_channels
        self.num_query = num_query
        self.num_reg_fcs = num_reg_fcs
        self.sync_cls_avg_factor = sync_cls_avg_factor
        self.bg_cls_weight = 0.0
        self.loss_cls = MODELS.build(loss_cls)
        self.loss_bbox = MODELS.build(loss_bbox)
        self.assigner = TASK_UTILS.build((train_cfg or {})["assigner"])
        self.positional_encoding = MODELS.build(positional_encoding)
        self.transformer = MODELS.build(transformer)
        self.code_weights = nn.Parameter(torch.tensor(self.code_weights_list), requires_grad=False)
        self._init_layers()

    def _init_layers(self) -> None:
        cls_branch: list[nn.Module] = []
        for _ in range(self.num_reg_fcs):
            cls_branch += [nn.Linear(self.embed_dims, self.embed_dims), nn.LayerNorm(self.embed_dims),
                           nn.ReLU(inplace=True)]
        cls_branch.append(nn.Linear(self.embed_dims, self.cls_out_channels))
        fc_cls = nn.Sequential(*cls_branch)
        reg_branch: list[nn.Module] = []
        for _ in range(self.num_reg_fcs):
            reg_branch += [nn.Linear(self.embed_dims, self.embed_dims), nn.ReLU()]
        reg_branch.append(nn.Linear(self.embed_dims, self.code_size))
        fc_reg = nn.Sequential(*reg_branch)
        num_pred = self.transformer.decoder.num_layers
        if self.with_box_refine:  # one branch per decoder layer
            self.cls_branches = nn.ModuleList([copy.deepcopy(fc_cls) for _ in range(num_pred)])
            self.reg_branches = nn.ModuleList([copy.deepcopy(fc_reg) for _ in range(num_pred)])
        else:
            self.cls_branches = nn.ModuleList([fc_cls for _ in range(num_pred)])
            self.reg_branches = nn.ModuleList([fc_reg for _ in range(num_pred)])
        self.bev_embedding = nn.Embedding(self.bev_h * self.bev_w, self.embed_dims)
        self.query_embedding = nn.Embedding(self.num_query, self.embed_dims * 2)

    def init_weights(self) -> None:
        self.transformer.init_weights()
        bias_init = bias_init_with_prob(0.01)
        for m in self.cls_branches:
            nn.init.constant_(m[-1].bias, bias_init)

    def forward(self, mlvl_feats: list[torch.Tensor], img_metas: list[dict], prev_bev: Any = None,
                only_bev: bool = False) -> Any:
        """mlvl_feats: [(bs, cams, C, H, W)]. only_bev: the encoder only (history frames)."""
        bs = mlvl_feats[0].shape[0]
        dtype = mlvl_feats[0].dtype
        object_query_embeds = self.query_embedding.weight.to(dtype)
        bev_queries = self.bev_embedding.weight.to(dtype)
        bev_mask = torch.zeros((bs, self.bev_h, self.bev_w), device=bev_queries.device).to(dtype)
        bev_pos = self.positional_encoding(bev_mask).to(dtype)
        grid_length = (self.real_h / self.bev_h, self.real_w / self.bev_w)
        if only_bev:
            return self.transformer.get_bev_features(mlvl_feats, bev_queries, self.bev_h, self.bev_w,
                                                     grid_length=grid_length, bev_pos=bev_pos,
                                                     img_metas=img_metas, prev_bev=prev_bev)
        bev_embed, hs, init_reference, inter_references = self.transformer(
            mlvl_feats, bev_queries, object_query_embeds, self.bev_h, self.bev_w, grid_length=grid_length,
            bev_pos=bev_pos, reg_branches=self.reg_branches if self.with_box_refine else None,
            cls_branches=self.cls_branches if self.as_two_stage else None, img_metas=img_metas, prev_bev=prev_bev)
        with PHASES.forward("loss"):
            hs = hs.permute(0, 2, 1, 3)
            outputs_classes, outputs_coords = [], []
            for lvl in range(hs.shape[0]):
                reference = inverse_sigmoid(init_reference if lvl == 0 else inter_references[lvl - 1])
                outputs_class = self.cls_branches[lvl](hs[lvl])
                tmp = self.reg_branches[lvl](hs[lvl])
                assert reference.shape[-1] == 3
                # Centre (x, y) and height z relative to the layer's reference point, then metres.
                xy = (tmp[..., 0:2] + reference[..., 0:2]).sigmoid()
                z = (tmp[..., 4:5] + reference[..., 2:3]).sigmoid()
                x = xy[..., 0:1] * (self.pc_range[3] - self.pc_range[0]) + self.pc_range[0]
                y = xy[..., 1:2] * (self.pc_range[4] - self.pc_range[1]) + self.pc_range[1]
                z = z * (self.pc_range[5] - self.pc_range[2]) + self.pc_range[2]
                outputs_coords.append(torch.cat([x, y, tmp[..., 2:4], z, tmp[..., 5:]], -1))
                outputs_classes.append(outputs_class)
        return {"bev_embed": bev_embed, "all_cls_scores": torch.stack(outputs_classes),
                "all_bbox_preds": torch.stack(outputs_coords), "enc_cls_scores": None, "enc_bbox_preds": None}

    def _get_target_single(self, cls_score: torch.Tensor, bbox_pred: torch.Tensor, gt_labels: torch.Tensor,
                           gt_bboxes: torch.Tensor) -> tuple[torch.Tensor, ...]:
        num_bboxes = bbox_pred.size(0)
        gt_c = gt_bboxes.shape[-1]
        assign = self.assigner.assign(bbox_pred, cls_score, gt_bboxes, gt_labels)
        pos_inds = torch.nonzero(assign.gt_inds > 0, as_tuple=False).squeeze(-1)
        neg_inds = torch.nonzero(assign.gt_inds == 0, as_tuple=False).squeeze(-1)
        pos_gt = assign.gt_inds[pos_inds] - 1
        labels = gt_bboxes.new_full((num_bboxes,), self.num_classes, dtype=torch.long)
        labels[pos_inds] = gt_labels[pos_gt]
        label_weights = gt_bboxes.new_ones(num_bboxes)
        bbox_targets = torch.zeros_like(bbox_pred)[..., :gt_c]
        bbox_weights = torch.zeros_like(bbox_pred)
        bbox_weights[pos_inds] = 1.0
        bbox_targets[pos_inds] = gt_bboxes[pos_gt]
        return labels, label_weights, bbox_targets, bbox_weights, pos_inds, neg_inds

    def loss_single(self, cls_scores: torch.Tensor, bbox_preds: torch.Tensor, gt_bboxes_list: list[torch.Tensor],
                    gt_labels_list: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Losses of one decoder layer's predictions (bs, num_query, ...)."""
        num_imgs = cls_scores.size(0)
        targets = [self._get_target_single(cls_scores[i], bbox_preds[i], gt_labels_list[i], gt_bboxes_list[i])
                   for i in range(num_imgs)]
        labels = torch.cat([t[0] for t in targets])
        label_weights = torch.cat([t[1] for t in targets])
        bbox_targets = torch.cat([t[2] for t in targets])
        bbox_weights = torch.cat([t[3] for t in targets])
        num_total_pos = sum(t[4].numel() for t in targets)
        num_total_neg = sum(t[5].numel() for t in targets)

        cls_scores = cls_scores.reshape(-1, self.cls_out_channels)
        cls_avg_factor = max(num_total_pos * 1.0 + num_total_neg * self.bg_cls_weight, 1.0)
        loss_cls = self.loss_cls(cls_scores, labels, label_weights, avg_factor=cls_avg_factor)
        num_total_pos = max(float(num_total_pos), 1.0)

        bbox_preds = bbox_preds.reshape(-1, bbox_preds.size(-1))
        normalized_bbox_targets = normalize_bbox(bbox_targets, self.pc_range)
        isnotnan = torch.isfinite(normalized_bbox_targets).all(dim=-1)  # unmatched rows: log(0) sizes
        bbox_weights = bbox_weights * self.code_weights
        loss_bbox = self.loss_bbox(bbox_preds[isnotnan, :10], normalized_bbox_targets[isnotnan, :10],
                                   bbox_weights[isnotnan, :10], avg_factor=num_total_pos)
        return torch.nan_to_num(loss_cls), torch.nan_to_num(loss_bbox)

    def loss(self, gt_bboxes_list: list[torch.Tensor], gt_labels_list: list[torch.Tensor], preds_dicts: dict,
             img_metas: Any = None) -> dict[str, torch.Tensor]:
        with PHASES.forward("loss"):
            all_cls_scores = preds_dicts["all_cls_scores"]
            all_bbox_preds = preds_dicts["all_bbox_preds"]
            loss_dict: dict[str, torch.Tensor] = {}
            num_dec_layers = len(all_cls_scores)
            for i in range(num_dec_layers):
                loss_cls, loss_bbox = self.loss_single(all_cls_scores[i], all_bbox_preds[i], gt_bboxes_list,
                                                       gt_labels_list)
                prefix = "" if i == num_dec_layers - 1 else f"d{i}."
                loss_dict[f"{prefix}loss_cls"] = loss_cls
                loss_dict[f"{prefix}loss_bbox"] = loss_bbox
        return loss_dict
