"""The multi-view training pipeline of BEVFormer-tiny, as mmcv 2.x ``BaseTransform`` s in ``TRANSFORMS``.

Published order: LoadMultiViewImageFromFiles (to float32) -> PhotoMetricDistortionMultiViewImage ->
LoadAnnotations3D -> ObjectRangeFilter -> ObjectNameFilter -> NormalizeMultiviewImage ->
RandomScaleImageMultiViewImage (0.5) -> PadMultiViewImage (divisor 32) -> format and collect.

The per-image work is the OpenMMLab library code a BEVFormer port calls: ``mmcv.imfrombytes`` to
decode each view, mmdet's ``PhotoMetricDistortion`` on each view, ``mmcv.imnormalize``,
``mmcv.imresize``, ``mmcv.impad_to_multiple``. Views are kept as separate contiguous arrays.
"""

from __future__ import annotations

from typing import Any

import mmcv
import numpy as np
import torch
from mmcv.transforms import BaseTransform
from mmdet.datasets.transforms import PhotoMetricDistortion
from mmengine.fileio import get
from mmengine.registry import TRANSFORMS


@TRANSFORMS.register_module()
class LoadMultiViewImageFromFiles(BaseTransform):
    """Read every camera's image of the sample (``img_filename``), decoded by ``mmcv.imfrombytes``."""

    def __init__(self, to_float32: bool = False, color_type: str = "unchanged") -> None:
        self.to_float32 = to_float32
        self.color_type = color_type

    def transform(self, results: dict) -> dict:
        imgs = [mmcv.imfrombytes(get(name), flag=self.color_type) for name in results["img_filename"]]
        if self.to_float32:
            imgs = [img.astype(np.float32) for img in imgs]
        results["filename"] = results["img_filename"]
        results["img"] = imgs
        results["img_shape"] = [img.shape for img in imgs]
        results["ori_shape"] = [img.shape for img in imgs]
        results["pad_shape"] = [img.shape for img in imgs]
        results["scale_factor"] = 1.0
        results["img_norm_cfg"] = dict(mean=np.zeros(3, np.float32), std=np.ones(3, np.float32), to_rgb=False)
        return results


@TRANSFORMS.register_module()
class PhotoMetricDistortionMultiViewImage(BaseTransform):
    """mmdet's PhotoMetricDistortion applied to each view on its own (own random draws per view)."""

    def __init__(self, brightness_delta: int = 32, contrast_range: tuple[float, float] = (0.5, 1.5),
                 saturation_range: tuple[float, float] = (0.5, 1.5), hue_delta: int = 18) -> None:
        self.distortion = PhotoMetricDistortion(brightness_delta=brightness_delta, contrast_range=contrast_range,
                                                saturation_range=saturation_range, hue_delta=hue_delta)

    def transform(self, results: dict) -> dict:
        out = []
        for img in results["img"]:
            assert img.dtype == np.float32, "PhotoMetricDistortion needs float32 images (to_float32=True)"
            out.append(self.distortion.transform({"img": img})["img"])
        results["img"] = out
        return results


@TRANSFORMS.register_module()
class LoadAnnotations3D(BaseTransform):
    """The sample's 3D boxes (gravity centre x, y, z, w, l, h, yaw, vx, vy; ego frame) and labels."""

    def __init__(self, with_bbox_3d: bool = True, with_label_3d: bool = True, with_attr_label: bool = False) -> None:
        self.with_bbox_3d, self.with_label_3d = with_bbox_3d, with_label_3d

    def transform(self, results: dict) -> dict:
        ann = results["ann_info"]
        if self.with_bbox_3d:
            results["gt_bboxes_3d"] = np.asarray(ann["gt_bboxes_3d"], np.float32).reshape(-1, 9)
        if self.with_label_3d:
            results["gt_labels_3d"] = np.asarray(ann["gt_labels_3d"], np.int64)
        return results


@TRANSFORMS.register_module()
class ObjectRangeFilter(BaseTransform):
    """Drop boxes whose centre lies outside the BEV range (x, y)."""

    def __init__(self, point_cloud_range: list[float]) -> None:
        self.pcd_range = np.asarray(point_cloud_range, np.float32)

    def transform(self, results: dict) -> dict:
        boxes, labels = results["gt_bboxes_3d"], results["gt_labels_3d"]
        keep = ((boxes[:, 0] > self.pcd_range[0]) & (boxes[:, 1] > self.pcd_range[1])
                & (boxes[:, 0] < self.pcd_range[3]) & (boxes[:, 1] < self.pcd_range[4]))
        results["gt_bboxes_3d"], results["gt_labels_3d"] = boxes[keep], labels[keep]
        return results


@TRANSFORMS.register_module()
class ObjectNameFilter(BaseTransform):
    """Keep the boxes of the trained classes."""

    def __init__(self, classes: list[str]) -> None:
        self.classes = classes

    def transform(self, results: dict) -> dict:
        labels = results["gt_labels_3d"]
        keep = (labels >= 0) & (labels < len(self.classes))
        results["gt_bboxes_3d"], results["gt_labels_3d"] = results["gt_bboxes_3d"][keep], labels[keep]
        return results


@TRANSFORMS.register_module()
class NormalizeMultiviewImage(BaseTransform):
    """``mmcv.imnormalize`` on each view."""

    def __init__(self, mean: list[float], std: list[float], to_rgb: bool = True) -> None:
        self.mean = np.array(mean, dtype=np.float32)
        self.std = np.array(std, dtype=np.float32)
        self.to_rgb = to_rgb

    def transform(self, results: dict) -> dict:
        results["img"] = [mmcv.imnormalize(img, self.mean, self.std, self.to_rgb) for img in results["img"]]
        results["img_norm_cfg"] = dict(mean=self.mean, std=self.std, to_rgb=self.to_rgb)
        return results


@TRANSFORMS.register_module()
class RandomScaleImageMultiViewImage(BaseTransform):
    """Resize every view by one of ``scales`` (BEVFormer-tiny: 0.5) and scale lidar2img to match."""

    def __init__(self, scales: list[float]) -> None:
        self.scales = scales
        assert len(self.scales) == 1

    def transform(self, results: dict) -> dict:
        rand_scale = self.scales[np.random.permutation(len(self.scales))[0]]
        y_size = [int(img.shape[0] * rand_scale) for img in results["img"]]
        x_size = [int(img.shape[1] * rand_scale) for img in results["img"]]
        scale_factor = np.eye(4)
        scale_factor[0, 0] *= rand_scale
        scale_factor[1, 1] *= rand_scale
        results["img"] = [mmcv.imresize(img, (x_size[i], y_size[i]), return_scale=False)
                          for i, img in enumerate(results["img"])]
        results["lidar2img"] = [scale_factor @ l2i for l2i in results["lidar2img"]]
        results["img_shape"] = [img.shape for img in results["img"]]
        results["ori_shape"] = [img.shape for img in results["img"]]
        return results


@TRANSFORMS.register_module()
class PadMultiViewImage(BaseTransform):
    """Pad every view to a multiple of ``size_divisor`` (bottom/right), as upstream: img_shape := padded."""

    def __init__(self, size: Any = None, size_divisor: int | None = None, pad_val: float = 0) -> None:
        self.size, self.size_divisor, self.pad_val = size, size_divisor, pad_val
        assert (size is None) != (size_divisor is None)

    def transform(self, results: dict) -> dict:
        if self.size is not None:
            padded = [mmcv.impad(img, shape=self.size, pad_val=self.pad_val) for img in results["img"]]
        else:
            padded = [mmcv.impad_to_multiple(img, self.size_divisor, pad_val=self.pad_val) for img in results["img"]]
        results["ori_shape"] = [img.shape for img in results["img"]]
        results["img"] = padded
        results["img_shape"] = [img.shape for img in padded]
        results["pad_shape"] = [img.shape for img in padded]
        results["pad_fixed_size"] = self.size
        results["pad_size_divisor"] = self.size_divisor
        return results


@TRANSFORMS.register_module()
class PackBEVInputs(BaseTransform):
    """DefaultFormatBundle3D + CustomCollect3D: views to one (cams, C, H, W) tensor, boxes and labels
    to tensors, the listed ``meta_keys`` into ``img_metas``."""

    META_KEYS = ("filename", "ori_shape", "img_shape", "lidar2img", "pad_shape", "scale_factor", "img_norm_cfg",
                 "sample_idx", "prev_idx", "next_idx", "scene_token", "can_bus", "frame_idx")

    def __init__(self, keys: tuple[str, ...] = ("gt_bboxes_3d", "gt_labels_3d", "img"),
                 meta_keys: tuple[str, ...] = META_KEYS) -> None:
        self.keys, self.meta_keys = keys, meta_keys

    def transform(self, results: dict) -> dict:
        imgs = np.ascontiguousarray(np.stack([img.transpose(2, 0, 1) for img in results["img"]], axis=0))
        packed: dict[str, Any] = {"img": torch.from_numpy(imgs)}
        if "gt_bboxes_3d" in self.keys:
            packed["gt_bboxes_3d"] = torch.from_numpy(results["gt_bboxes_3d"])
        if "gt_labels_3d" in self.keys:
            packed["gt_labels_3d"] = torch.from_numpy(results["gt_labels_3d"])
        packed["img_metas"] = {key: results[key] for key in self.meta_keys if key in results}
        return packed
