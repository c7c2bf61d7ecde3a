"""The RetinaNet example on the OpenMMLab 1.x stack: mmdet 2.x ``train_detector`` on mmcv-full 1.x.

The same detector and synthetic COCO data as ``examples/mmdet_retinanet`` (ResNet-18, no
pretrained weights), through the 1.x training path a 2022-era project runs: mmcv ``Config``,
``build_dataset``/``build_detector``, ``train_detector`` (which wraps the model in
``MMDataParallel`` and builds mmcv's ``IterBasedRunner``), a pipeline ending in
``DefaultFormatBundle``/``Collect`` (so batches are mmcv ``DataContainer``s, collated by mmcv's
``collate``), and ``TextLoggerHook`` printing every iteration (``time: ... data_time: ... loss: ...``,
4 decimals). This is the stack where LOONGKIT_DATA_CONTAINER, LOONGKIT_DATA_PREFETCH and
LOONGKIT_PYTORCH act. Single process (mmcv 1.x's ``init_dist`` needs CUDA).

    python examples/mmdet2_retinanet/train.py --iters 30
    loongkit compare -- python examples/mmdet2_retinanet/train.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: the shared data generator and model
from retinanet import arguments, retinanet
from synthetic_coco import CLASSES, make_dataset

MEAN, STD = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]


def build_config(data_root: Path, ann_file: Path, args: argparse.Namespace, device: str) -> dict[str, Any]:
    train_pipeline = [
        dict(type="LoadImageFromFile", to_float32=True),  # 2.x PhotoMetricDistortion takes float32 only
        dict(type="LoadAnnotations", with_bbox=True),
        dict(type="PhotoMetricDistortion"),
        dict(type="Resize", img_scale=(args.scale, args.scale), keep_ratio=True),
        dict(type="RandomFlip", flip_ratio=0.5),
        dict(type="Normalize", mean=MEAN, std=STD, to_rgb=True),
        dict(type="Pad", size_divisor=32),
        dict(type="DefaultFormatBundle"),  # tensors wrapped in DataContainer
        dict(type="Collect", keys=["img", "gt_bboxes", "gt_labels"]),
    ]
    test_pipeline = [
        dict(type="LoadImageFromFile"),
        dict(type="MultiScaleFlipAug", img_scale=(args.scale, args.scale), flip=False,
             transforms=[dict(type="Resize", keep_ratio=True), dict(type="RandomFlip"),
                         dict(type="Normalize", mean=MEAN, std=STD, to_rgb=True), dict(type="Pad", size_divisor=32),
                         dict(type="ImageToTensor", keys=["img"]), dict(type="Collect", keys=["img"])]),
    ]
    # val/test are never built (validate=False), but mmdet 2.x's compat_cfg (in train_detector) reads them.
    test_data = dict(type="CocoDataset", ann_file=str(ann_file), img_prefix=str(data_root) + "/", classes=CLASSES,
                     pipeline=test_pipeline, test_mode=True)
    model = retinanet(args.depth, len(CLASSES))
    return dict(
        model=model,
        data=dict(samples_per_gpu=args.batch_size, workers_per_gpu=args.workers,
                  train=dict(type="CocoDataset", ann_file=str(ann_file), img_prefix=str(data_root) + "/",
                             classes=CLASSES, pipeline=train_pipeline, filter_empty_gt=True),
                  val=test_data, test=test_data,
                  train_dataloader=dict(persistent_workers=args.workers > 0)),
        optimizer=dict(type="SGD", lr=args.lr, momentum=0.9, weight_decay=1e-4),
        optimizer_config=dict(grad_clip=dict(max_norm=35, norm_type=2)),
        lr_config=dict(policy="fixed", warmup="linear", warmup_iters=10, warmup_ratio=0.1, warmup_by_epoch=False,
                       by_epoch=False),
        runner=dict(type="IterBasedRunner", max_iters=args.iters),
        checkpoint_config=None,
        log_config=dict(interval=1, hooks=[dict(type="TextLoggerHook", by_epoch=False)]),
        workflow=[("train", 1)],
        work_dir=args.work_dir,
        gpu_ids=[0],
        device=device,
        seed=args.seed,
        resume_from=None,
        load_from=None,
        auto_resume=False,
        log_level="INFO",
    )


def main(argv: list[str] | None = None) -> None:
    args = arguments(__doc__.splitlines()[0], argv)

    import torch
    from mmcv import Config
    from mmdet.apis import set_random_seed, train_detector
    from mmdet.datasets import build_dataset
    from mmdet.models import build_detector

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="loongkit-mmdet2-") as tmp:
        data_root = Path(tmp) / "data"
        data_root.mkdir()
        ann_file = make_dataset(data_root, args.images, args.seed)
        args.work_dir = args.work_dir or str(Path(tmp) / "work")
        Path(args.work_dir).mkdir(parents=True, exist_ok=True)
        cfg = Config(build_config(data_root, ann_file, args, device))
        set_random_seed(args.seed, deterministic=True)
        model = build_detector(cfg.model)
        model.init_weights()
        dataset = build_dataset(cfg.data.train)
        model.CLASSES = dataset.CLASSES
        train_detector(model, [dataset], cfg, distributed=False, validate=False,
                       timestamp=time.strftime("%Y%m%d_%H%M%S", time.localtime()), meta=dict(seed=args.seed))


if __name__ == "__main__":
    main()
