"""Synthetic multi-camera driving sequences on disk, in the nuScenes layout BEVFormer's dataset reads.

Each sequence: an ego vehicle driving (speed, slow turn) among objects of the ten nuScenes classes
(parked and moving cars, trucks, buses, pedestrians, barriers, cones, ...), seen by six cameras
around the vehicle (nuScenes-like headings and fields of view). Every frame writes six JPEG images
(sky, ground, the objects' projected boxes filled in per-class colours, far to near) and one entry in
an annotation file (``infos.json``: ``metainfo`` + ``data_list``) with the cameras' intrinsics and
sensor-to-lidar poses, the ego pose, a can_bus vector and the 3D boxes in the lidar/ego frame
(gravity centre x, y, z, width, length, height, yaw, vx, vy). Seeded: same arguments, same files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

CLASSES = ("car", "truck", "construction_vehicle", "bus", "trailer", "barrier", "motorcycle", "bicycle",
           "pedestrian", "traffic_cone")
# (width, length, height) in metres, and how often each class appears.
SIZES = {"car": (1.9, 4.6, 1.7), "truck": (2.5, 7.0, 2.9), "construction_vehicle": (2.8, 6.5, 3.2),
         "bus": (2.9, 11.0, 3.5), "trailer": (2.5, 9.0, 3.7), "barrier": (2.2, 0.5, 1.0),
         "motorcycle": (0.8, 2.1, 1.5), "bicycle": (0.6, 1.8, 1.3), "pedestrian": (0.7, 0.7, 1.75),
         "traffic_cone": (0.4, 0.4, 1.0)}
FREQUENCY = (0.40, 0.08, 0.03, 0.04, 0.03, 0.12, 0.04, 0.04, 0.14, 0.08)
COLOURS = np.array([(60, 60, 220), (40, 140, 240), (0, 200, 255), (220, 120, 40), (150, 80, 150),
                    (200, 200, 200), (60, 220, 60), (220, 220, 60), (240, 60, 240), (0, 120, 255)], np.float32)
# nuScenes camera order, heading (deg, counter-clockwise from forward) and horizontal field of view.
CAMERAS = (("CAM_FRONT", 0.0, 70.0), ("CAM_FRONT_RIGHT", -55.0, 70.0), ("CAM_FRONT_LEFT", 55.0, 70.0),
           ("CAM_BACK", 180.0, 110.0), ("CAM_BACK_LEFT", 110.0, 70.0), ("CAM_BACK_RIGHT", -110.0, 70.0))
LIDAR_HEIGHT = 1.84  # lidar frame: origin at the lidar, ground at z = -LIDAR_HEIGHT
CAMERA_HEIGHT = 1.5
FRAME_DT = 0.5  # nuScenes key frames: 2 Hz


def camera_rigs(width: int, height: int) -> list[dict[str, Any]]:
    """Per camera: intrinsics (3x3) and the sensor-to-lidar rotation / translation."""
    rigs = []
    for name, heading, fov in CAMERAS:
        yaw = math.radians(heading)
        focal = width / 2.0 / math.tan(math.radians(fov) / 2.0)
        intrinsic = [[focal, 0.0, width / 2.0], [0.0, focal, height / 2.0], [0.0, 0.0, 1.0]]
        # Columns: the camera's x (right), y (down), z (forward) axes in the lidar frame.
        right = (math.sin(yaw), -math.cos(yaw), 0.0)
        forward = (math.cos(yaw), math.sin(yaw), 0.0)
        rotation = [[right[i], 0.0 if i < 2 else -1.0, forward[i]] for i in range(3)]
        translation = [1.0 * forward[0], 1.0 * forward[1], CAMERA_HEIGHT - LIDAR_HEIGHT]
        rigs.append({"name": name, "cam_intrinsic": intrinsic, "sensor2lidar_rotation": rotation,
                     "sensor2lidar_translation": translation})
    return rigs


def box_corners(box: np.ndarray) -> np.ndarray:
    """(8, 3) corners of (x, y, z, w, l, h, yaw): length along the heading."""
    x, y, z, w, length, h, yaw = box[:7]
    local = np.array([[sx * length / 2, sy * w / 2, sz * h / 2] for sx in (-1, 1) for sy in (-1, 1) for sz in (-1, 1)])
    c, s = math.cos(yaw), math.sin(yaw)
    rot = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
    return local @ rot.T + np.array([x, y, z])


def render(rig: dict[str, Any], boxes: np.ndarray, labels: np.ndarray, shades: np.ndarray, width: int, height: int,
           rng: np.random.Generator) -> np.ndarray:
    """One camera image (BGR uint8): sky and ground, then the objects far to near as filled hulls."""
    import cv2

    rotation = np.asarray(rig["sensor2lidar_rotation"])
    translation = np.asarray(rig["sensor2lidar_translation"])
    k = np.asarray(rig["cam_intrinsic"])
    horizon = int(k[1, 2])
    img = np.empty((height, width, 3), np.float32)
    rows = np.arange(height, dtype=np.float32)[:, None]
    sky = np.clip(1.0 - rows / max(horizon, 1), 0, 1)
    img[..., 0] = 200 * sky + 90 * (1 - sky)
    img[..., 1] = 170 * sky + 95 * (1 - sky)
    img[..., 2] = 140 * sky + 100 * (1 - sky)
    img += rng.normal(0.0, 6.0, (height // 4 + 1, width // 4 + 1, 1)).repeat(4, 0).repeat(4, 1)[:height, :width]
    cam_points = []
    for box in boxes:
        corners = (box_corners(box) - translation) @ rotation  # lidar -> camera coordinates
        cam_points.append(corners)
    order = np.argsort([-np.linalg.norm(p.mean(0)) for p in cam_points]) if cam_points else []
    for i in order:
        corners = cam_points[i]
        if (corners[:, 2] < 0.5).any():
            continue  # behind or too close to this camera
        uv = corners @ k.T
        uv = uv[:, :2] / uv[:, 2:3]
        if (uv[:, 0].max() < 0 or uv[:, 0].min() >= width or uv[:, 1].max() < 0 or uv[:, 1].min() >= height
                or np.abs(uv).max() > 8 * (width + height)):
            continue
        hull = cv2.convexHull(uv.astype(np.float32)).astype(np.int32)
        colour = COLOURS[labels[i]] * shades[i]
        cv2.fillConvexPoly(img, hull, colour.tolist())
        top = uv[[1, 3, 7, 5]].astype(np.int32)  # z = +h/2 face: lighter, a depth cue
        cv2.fillConvexPoly(img, cv2.convexHull(top), np.minimum(colour * 1.25 + 20, 255).tolist())
        cv2.polylines(img, [hull], True, (colour * 0.5).tolist(), 2)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_dataset(root: Path, scenes: int, frames: int, width: int, height: int, seed: int,
                 objects: int = 24) -> Path:
    """Write ``scenes`` x ``frames`` frames of six ``width`` x ``height`` images under ``root``; return
    the annotation file."""
    import cv2

    rng = np.random.default_rng(seed)
    rigs = camera_rigs(width, height)
    data_list = []
    (root / "samples").mkdir(parents=True, exist_ok=True)
    for scene in range(scenes):
        token = f"scene-{scene:04d}"
        ego_xy = rng.uniform(-200.0, 200.0, 2)
        ego_yaw = rng.uniform(-math.pi, math.pi)
        speed, yaw_rate = rng.uniform(2.0, 8.0), rng.uniform(-0.08, 0.08)
        # Objects in the global frame: class, position near the ego's path, heading, velocity.
        labels = rng.choice(len(CLASSES), size=objects, p=FREQUENCY)
        along = rng.uniform(-30.0, 30.0 + speed * frames * FRAME_DT, objects)
        across = rng.uniform(-25.0, 25.0, objects)
        heading = np.array([math.cos(ego_yaw), math.sin(ego_yaw)])
        normal = np.array([-heading[1], heading[0]])
        positions = ego_xy + along[:, None] * heading + across[:, None] * normal
        yaws = np.where(rng.random(objects) < 0.6, ego_yaw + rng.choice([0.0, math.pi], objects),
                        rng.uniform(-math.pi, math.pi, objects))
        moving = np.isin(labels, [0, 1, 3, 6, 7, 8]) & (rng.random(objects) < 0.5)
        speeds = np.where(moving, rng.uniform(0.5, 6.0, objects), 0.0) * np.where(labels == 8, 0.25, 1.0)
        velocities = np.stack([np.cos(yaws), np.sin(yaws)], 1) * speeds[:, None]
        sizes = np.array([SIZES[CLASSES[c]] for c in labels]) * rng.uniform(0.9, 1.1, (objects, 1))
        shades = rng.uniform(0.55, 1.0, objects)
        for frame in range(frames):
            t = frame * FRAME_DT
            yaw = ego_yaw + yaw_rate * t
            mid = ego_yaw + yaw_rate * t / 2  # straight chord of the arc driven so far
            xy = ego_xy + speed * t * np.array([math.cos(mid), math.sin(mid)])
            c, s = math.cos(yaw), math.sin(yaw)
            to_ego = np.array([[c, s], [-s, c]])  # global -> ego (rotation by -yaw)
            local_xy = (positions + velocities * t - xy) @ to_ego.T
            local_v = velocities @ to_ego.T
            boxes = np.concatenate([local_xy, (sizes[:, 2:3] / 2 - LIDAR_HEIGHT), sizes[:, 0:1], sizes[:, 1:2],
                                    sizes[:, 2:3], (yaws - yaw)[:, None], local_v], 1)
            boxes[:, 6] = (boxes[:, 6] + math.pi) % (2 * math.pi) - math.pi
            sample = f"{token}-{frame:03d}"
            cams = {}
            for rig in rigs:
                img = render(rig, boxes, labels, shades, width, height, rng)
                path = f"samples/{sample}__{rig['name']}.jpg"
                ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
                assert ok
                (root / path).write_bytes(buf.tobytes())
                cams[rig["name"]] = {"data_path": path, **{k: v for k, v in rig.items() if k != "name"}}
            accel = [0.0, 0.0, 9.81]
            can_bus = [0.0] * 18  # translation, rotation (filled by the dataset), accel, rates, velocity, yaw
            can_bus[7:10] = accel
            can_bus[12] = yaw_rate
            can_bus[13:16] = [speed, 0.0, 0.0]
            data_list.append({
                "token": sample, "scene_token": token, "frame_idx": frame, "timestamp": int(t * 1e6),
                "prev": f"{token}-{frame - 1:03d}" if frame else "", "next": f"{token}-{frame + 1:03d}"
                if frame + 1 < frames else "",
                "ego2global_translation": [float(xy[0]), float(xy[1]), 0.0],
                "ego2global_rotation": [math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2)],
                "can_bus": can_bus, "cams": cams,
                "gt_boxes": boxes.astype(np.float32).round(4).tolist(), "gt_labels": labels.tolist()})
    ann = root / "infos.json"
    ann.write_text(json.dumps({"metainfo": {"classes": list(CLASSES), "dataset": "synthetic nuScenes-format"},
                               "data_list": data_list}))
    return ann
