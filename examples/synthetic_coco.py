"""A synthetic COCO-format detection dataset, written to disk, shared by the detection examples.

Coloured squares, discs and triangles (1-4 per image) on noisy backgrounds, as JPEG files plus a COCO
``instances`` JSON: what mmdet's CocoDataset and LoadImageFromFile read, with nothing to download.
The same seed gives the same files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

CLASSES = ("square", "disc", "triangle")


def make_dataset(root: Path, images: int, seed: int, size: tuple[int, int] = (320, 240)) -> Path:
    """Write ``images`` JPEGs with 1-4 shapes each and their COCO annotations; returns the JSON path."""
    import cv2

    rng = np.random.default_rng(seed)
    width, height = size
    coco: dict[str, list[dict[str, Any]]] = {
        "images": [], "annotations": [],
        "categories": [{"id": i + 1, "name": name} for i, name in enumerate(CLASSES)],
    }
    for image_id in range(1, images + 1):
        img = rng.integers(0, 90, (height, width, 3), dtype=np.uint8)
        for _ in range(int(rng.integers(1, 5))):
            label = int(rng.integers(len(CLASSES)))
            side = int(rng.integers(28, 90))
            x, y = int(rng.integers(0, width - side)), int(rng.integers(0, height - side))
            colour = tuple(int(c) for c in rng.integers(120, 256, 3))
            if CLASSES[label] == "square":
                cv2.rectangle(img, (x, y), (x + side - 1, y + side - 1), colour, thickness=-1)
            elif CLASSES[label] == "disc":
                cv2.circle(img, (x + side // 2, y + side // 2), side // 2, colour, thickness=-1)
            else:
                points = np.array([[x + side // 2, y], [x, y + side - 1], [x + side - 1, y + side - 1]], np.int32)
                cv2.fillPoly(img, [points], colour)
            coco["annotations"].append({
                "id": len(coco["annotations"]) + 1, "image_id": image_id, "category_id": label + 1,
                "bbox": [x, y, side, side], "area": side * side, "iscrowd": 0,
            })
        name = f"{image_id:05d}.jpg"
        cv2.imwrite(str(root / name), img, [cv2.IMWRITE_JPEG_QUALITY, 95])
        coco["images"].append({"id": image_id, "file_name": name, "width": width, "height": height})
    ann_file = root / "instances_train.json"
    ann_file.write_text(json.dumps(coco))
    return ann_file
