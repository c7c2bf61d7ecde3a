"""BEVFormer: multi-camera images -> ResNet + FPN -> BEV encoder (with the previous BEV) -> 3D boxes.

Written for this example from the published BEVFormer architecture, as an mmengine ``BaseModel``
registered in ``MODELS`` (the OpenMMLab 2.x form of upstream's mmdet3d detector). Training sample:
a queue of frames of one sequence; the earlier frames give the previous BEV without gradients (model
in eval mode, as upstream's ``obtain_history_bev``), the last frame is trained on.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import torch
from mmengine.model import BaseDataPreprocessor, BaseModel
from mmengine.registry import MODELS

from ...utils.phases import PHASES


class GridMask:
    """BEVFormer's image augmentation: with probability ``prob`` zero a grid of stripes (mode 1 keeps
    the stripes' complement). Upstream's config rotates the grid by ``randint(1) == 0`` degrees, so the
    rotation is the identity here too."""

    def __init__(self, use_h: bool = True, use_w: bool = True, ratio: float = 0.5, mode: int = 1,
                 prob: float = 0.7) -> None:
        self.use_h, self.use_w, self.ratio, self.mode, self.prob = use_h, use_w, ratio, mode, prob

    def __call__(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        if np.random.rand() > self.prob or not training:
            return x
        n, c, h, w = x.size()
        x = x.view(-1, h, w)
        hh, ww = int(1.5 * h), int(1.5 * w)
        d = np.random.randint(2, h)
        length = min(max(int(d * self.ratio + 0.5), 1), d - 1)
        mask = np.ones((hh, ww), np.float32)
        st_h, st_w = np.random.randint(d), np.random.randint(d)
        if self.use_h:
            for i in range(hh // d):
                s = d * i + st_h
                mask[s:min(s + length, hh), :] *= 0
        if self.use_w:
            for i in range(ww // d):
                s = d * i + st_w
                mask[:, s:min(s + length, ww)] *= 0
        np.random.randint(1)  # upstream's rotation draw (always 0): kept so the random stream matches
        mask = mask[(hh - h) // 2:(hh - h) // 2 + h, (ww - w) // 2:(ww - w) // 2 + w]
        tensor = torch.from_numpy(np.ascontiguousarray(mask)).to(x.dtype).to(x.device)
        if self.mode == 1:
            tensor = 1 - tensor
        return (x * tensor.expand_as(x)).view(n, c, h, w)


@MODELS.register_module()
class BEVDataPreprocessor(BaseDataPreprocessor):
    """Stacks the samples' image queues (B, queue, cams, C, H, W); metadata and boxes stay lists."""

    def forward(self, data: dict, training: bool = False) -> dict:
        data = self.cast_data(data)
        return {"img": torch.stack(data["img"]), "img_metas": data["img_metas"],
                "gt_bboxes_3d": data.get("gt_bboxes_3d"), "gt_labels_3d": data.get("gt_labels_3d")}


@MODELS.register_module()
class BEVFormer(BaseModel):
    """Args: img_backbone / img_neck (mmdet's ResNet and FPN), pts_bbox_head (BEVFormerHead),
    use_grid_mask, video_test_mode (kept from the published config), data_preprocessor."""

    def __init__(self, use_grid_mask: bool = False, img_backbone: Any = None, img_neck: Any = None,
                 pts_bbox_head: Any = None, train_cfg: Any = None, test_cfg: Any = None, pretrained: Any = None,
                 video_test_mode: bool = False, data_preprocessor: Any = None, init_cfg: Any = None) -> None:
        super().__init__(data_preprocessor=data_preprocessor or dict(type="BEVDataPreprocessor"), init_cfg=init_cfg)
        self.img_backbone = MODELS.build(img_backbone)
        self.img_neck = MODELS.build(img_neck) if img_neck else None
        if train_cfg is not None:
            pts_bbox_head = dict(pts_bbox_head, train_cfg=train_cfg.get("pts", train_cfg))
        self.pts_bbox_head = MODELS.build(pts_bbox_head)
        self.grid_mask = GridMask(True, True, ratio=0.5, mode=1, prob=0.7)
        self.use_grid_mask = use_grid_mask
        self.fp16_enabled = False
        self.video_test_mode = video_test_mode

    @property
    def with_img_neck(self) -> bool:
        return self.img_neck is not None

    def extract_img_feat(self, img: torch.Tensor, img_metas: Any, len_queue: int | None = None) -> list[torch.Tensor]:
        """(B[*queue], cams, C, H, W) -> per level (B[, queue], cams, C', H', W')."""
        B = img.size(0)
        if img.dim() == 5:
            B, N, C, H, W = img.size()
            img = img.reshape(B * N, C, H, W)
        if self.use_grid_mask:
            img = self.grid_mask(img, self.training)
        img_feats = self.img_backbone(img)
        if isinstance(img_feats, dict):
            img_feats = list(img_feats.values())
        if self.with_img_neck:
            img_feats = self.img_neck(img_feats)
        reshaped = []
        for img_feat in img_feats:
            BN, C, H, W = img_feat.size()
            if len_queue is not None:
                reshaped.append(img_feat.view(int(B / len_queue), len_queue, int(BN / B), C, H, W))
            else:
                reshaped.append(img_feat.view(B, int(BN / B), C, H, W))
        return reshaped

    def extract_feat(self, img: torch.Tensor, img_metas: Any = None,
                     len_queue: int | None = None) -> list[torch.Tensor]:
        with PHASES.forward("backbone"):
            feats = self.extract_img_feat(img, img_metas, len_queue=len_queue)
        for feat in feats:
            PHASES.mark("img_feats", feat)
        return feats

    def obtain_history_bev(self, imgs_queue: torch.Tensor, img_metas_list: list[list[dict]]) -> Any:
        """The previous BEV from the earlier frames, frame by frame, in eval mode and without gradients."""
        self.eval()
        with torch.no_grad():
            prev_bev = None
            bs, len_queue, num_cams, C, H, W = imgs_queue.shape
            imgs_queue = imgs_queue.reshape(bs * len_queue, num_cams, C, H, W)
            img_feats_list = self.extract_feat(img=imgs_queue, len_queue=len_queue)
            for i in range(len_queue):
                img_metas = [each[i] for each in img_metas_list]
                if not img_metas[0]["prev_bev_exists"]:
                    prev_bev = None
                img_feats = [each_scale[:, i] for each_scale in img_feats_list]
                prev_bev = self.pts_bbox_head(img_feats, img_metas, prev_bev, only_bev=True)
        self.train()
        return prev_bev

    def forward_train(self, img_metas: list[list[dict]], gt_bboxes_3d: list[torch.Tensor],
                      gt_labels_3d: list[torch.Tensor], img: torch.Tensor) -> dict[str, torch.Tensor]:
        len_queue = img.size(1)
        prev_img = img[:, :-1, ...]
        img = img[:, -1, ...]
        prev_img_metas = copy.deepcopy(img_metas)
        prev_bev = self.obtain_history_bev(prev_img, prev_img_metas) if len_queue > 1 else None
        img_metas = [each[len_queue - 1] for each in img_metas]
        if not img_metas[0]["prev_bev_exists"]:
            prev_bev = None
        img_feats = self.extract_feat(img=img, img_metas=img_metas)
        outs = self.pts_bbox_head(img_feats, img_metas, prev_bev)
        return self.pts_bbox_head.loss(gt_bboxes_3d, gt_labels_3d, outs, img_metas=img_metas)

    def forward(self, img: torch.Tensor, img_metas: Any = None, gt_bboxes_3d: Any = None, gt_labels_3d: Any = None,
                mode: str = "loss") -> Any:
        if mode == "loss":
            return self.forward_train(img_metas, gt_bboxes_3d, gt_labels_3d, img)
        if mode == "tensor":  # the raw head outputs of the last frame (no history), e.g. for FLOP counting
            feats = self.extract_feat(img=img[:, -1])
            return self.pts_bbox_head(feats, [each[-1] for each in img_metas], None)
        raise ValueError(f"mode {mode!r}: this example trains only ('loss') or returns raw outputs ('tensor')")

    def train_step(self, data: Any, optim_wrapper: Any) -> dict[str, torch.Tensor]:
        """BaseModel.train_step; with --phases, the backward and the optimizer step timed apart."""
        if not PHASES.enabled:
            return super().train_step(data, optim_wrapper)
        with optim_wrapper.optim_context(self):
            data = self.data_preprocessor(data, True)
            losses = self._run_forward(data, mode="loss")
        parsed_losses, log_vars = self.parse_losses(losses)
        # OptimWrapper.update_params, step by step.
        loss = optim_wrapper.scale_loss(parsed_losses)
        PHASES.backward(lambda: optim_wrapper.backward(loss))
        start = time.perf_counter()
        if optim_wrapper.should_update():
            optim_wrapper.step()
            optim_wrapper.zero_grad()
        PHASES.add("optimizer", time.perf_counter() - start)
        return log_vars
