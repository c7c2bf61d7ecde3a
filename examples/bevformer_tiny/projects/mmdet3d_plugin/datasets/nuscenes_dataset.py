"""A nuScenes-format temporal dataset: each training sample is a queue of frames of one sequence.

BEVFormer's ``CustomNuScenesDataset`` behaviour on an mmengine ``BaseDataset`` (``DATASETS``): the
annotation file lists frames (``data_list``) with their cameras (image path, intrinsics,
sensor-to-lidar pose), ego pose, can_bus vector and 3D boxes; ``get_data_info`` derives lidar2img and
the can_bus heading entries; a sample is ``queue_length`` frames (the last one and a random choice of
earlier ones, as upstream draws them), each through the pipeline, then joined by ``union2one``: images
stacked (queue, cams, C, H, W), can_bus made relative to the previous frame of the same sequence.
"""

from __future__ import annotations

import copy
import math
import os
import random
from typing import Any

import numpy as np
from mmengine.dataset import BaseDataset
from mmengine.registry import DATASETS, FUNCTIONS


def quaternion_yaw(q: list[float]) -> float:
    """Heading (rad) of a (w, x, y, z) rotation about the vertical axis."""
    w, x, y, z = q
    return math.atan2(2.0 * (w * z + x * y), 1.0 - 2.0 * (y * y + z * z))


@DATASETS.register_module()
class SyntheticNuScenesDataset(BaseDataset):
    """Args: queue_length (frames per sample, BEVFormer-tiny: 3), bev_size, classes, plus BaseDataset's."""

    def __init__(self, *args: Any, queue_length: int = 4, bev_size: tuple[int, int] = (200, 200),
                 classes: Any = None, modality: Any = None, use_valid_flag: bool = False,
                 box_type_3d: str = "LiDAR", filter_empty_gt: bool = True, **kwargs: Any) -> None:
        self.queue_length = queue_length
        self.bev_size = bev_size
        self.filter_empty_gt = filter_empty_gt
        kwargs.setdefault("metainfo", dict(classes=classes))
        kwargs.setdefault("data_prefix", {})  # camera paths are joined to data_root in get_data_info
        super().__init__(*args, **kwargs)

    def get_data_info(self, idx: int) -> dict:
        info = super().get_data_info(idx)
        input_dict: dict[str, Any] = dict(
            sample_idx=info["token"], ego2global_translation=info["ego2global_translation"],
            ego2global_rotation=info["ego2global_rotation"], prev_idx=info["prev"], next_idx=info["next"],
            scene_token=info["scene_token"], can_bus=np.asarray(info["can_bus"], np.float64),
            frame_idx=info["frame_idx"], timestamp=info["timestamp"] / 1e6)
        image_paths, lidar2img_rts, lidar2cam_rts, cam_intrinsics = [], [], [], []
        for cam_info in info["cams"].values():
            image_paths.append(os.path.join(self.data_root, cam_info["data_path"]))
            lidar2cam_r = np.linalg.inv(np.asarray(cam_info["sensor2lidar_rotation"]))
            lidar2cam_t = np.asarray(cam_info["sensor2lidar_translation"]) @ lidar2cam_r.T
            lidar2cam_rt = np.eye(4)
            lidar2cam_rt[:3, :3] = lidar2cam_r.T
            lidar2cam_rt[3, :3] = -lidar2cam_t
            intrinsic = np.asarray(cam_info["cam_intrinsic"])
            viewpad = np.eye(4)
            viewpad[:intrinsic.shape[0], :intrinsic.shape[1]] = intrinsic
            lidar2img_rts.append(viewpad @ lidar2cam_rt.T)
            cam_intrinsics.append(viewpad)
            lidar2cam_rts.append(lidar2cam_rt.T)
        input_dict.update(img_filename=image_paths, lidar2img=lidar2img_rts, cam_intrinsic=cam_intrinsics,
                          lidar2cam=lidar2cam_rts)
        input_dict["ann_info"] = dict(gt_bboxes_3d=info["gt_boxes"], gt_labels_3d=info["gt_labels"])
        # can_bus: absolute ego position, rotation, and the heading in rad (-2) and degrees (-1).
        can_bus = input_dict["can_bus"]
        can_bus[:3] = input_dict["ego2global_translation"]
        can_bus[3:7] = input_dict["ego2global_rotation"]
        patch_angle = quaternion_yaw(input_dict["ego2global_rotation"]) / np.pi * 180
        if patch_angle < 0:
            patch_angle += 360
        can_bus[-2] = patch_angle / 180 * np.pi
        can_bus[-1] = patch_angle
        return input_dict

    def prepare_data(self, idx: int) -> Any:
        queue = []
        index_list = list(range(idx - self.queue_length, idx))
        random.shuffle(index_list)
        index_list = sorted(index_list[1:])
        index_list.append(idx)
        for i in index_list:
            example = self.pipeline(self.get_data_info(max(0, i)))
            if self.filter_empty_gt and (example is None or not (example["gt_labels_3d"] != -1).any()):
                return None
            queue.append(example)
        return self.union2one(queue)

    def union2one(self, queue: list[dict]) -> dict:
        import torch

        imgs_list = [each["img"] for each in queue]
        metas_map = {}
        prev_scene_token = prev_pos = prev_angle = None
        for i, each in enumerate(queue):
            metas_map[i] = each["img_metas"]
            if metas_map[i]["scene_token"] != prev_scene_token:
                metas_map[i]["prev_bev_exists"] = False
                prev_scene_token = metas_map[i]["scene_token"]
                prev_pos = copy.deepcopy(metas_map[i]["can_bus"][:3])
                prev_angle = copy.deepcopy(metas_map[i]["can_bus"][-1])
                metas_map[i]["can_bus"][:3] = 0
                metas_map[i]["can_bus"][-1] = 0
            else:
                metas_map[i]["prev_bev_exists"] = True
                tmp_pos = copy.deepcopy(metas_map[i]["can_bus"][:3])
                tmp_angle = copy.deepcopy(metas_map[i]["can_bus"][-1])
                metas_map[i]["can_bus"][:3] -= prev_pos
                metas_map[i]["can_bus"][-1] -= prev_angle
                prev_pos, prev_angle = copy.deepcopy(tmp_pos), copy.deepcopy(tmp_angle)
        sample = queue[-1]
        sample["img"] = torch.stack(imgs_list)
        sample["img_metas"] = metas_map
        return sample


@FUNCTIONS.register_module()
def bev_collate(batch: list[dict]) -> dict[str, list]:
    """Samples side by side (no tensor stacking: the data preprocessor stacks the images)."""
    return {key: [sample[key] for sample in batch] for key in batch[0]}
