"""RetinaNet (ResNet-18, no pretrained weights) trained by mmengine's Runner on a synthetic COCO dataset.

A real mmdet 3.x training job that knows nothing about loongkit: the dataset (coloured squares,
discs and triangles on noisy backgrounds, a few per image) is generated into a temporary
directory as JPEG files plus a COCO ``instances`` JSON, and read back through mmdet's own
pipeline (LoadImageFromFile, LoadAnnotations, PhotoMetricDistortion, Resize, RandomFlip,
PackDetInputs; Normalize runs in the DetDataPreprocessor, or with ``--normalize pipeline`` as mmcv's
Normalize transform in the workers). Seeded and deterministic, so two runs
print the same losses. mmengine logs every iteration: ``... time: ... data_time: ... loss: ...``.

    python examples/mmdet_retinanet/train.py --iters 30
    LOONGKIT_ALL=1 loongkit-run python examples/mmdet_retinanet/train.py
    loongkit compare -- python examples/mmdet_retinanet/train.py
    torchrun --nproc-per-node 2 examples/mmdet_retinanet/train.py   # DDP (gloo on CPU, nccl on GPU)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: the shared data generator and model
from retinanet import arguments, retinanet
from synthetic_coco import CLASSES, make_dataset

MEAN, STD = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]


def build_config(data_root: Path, ann_file: Path, args: argparse.Namespace) -> dict[str, Any]:
    # --normalize pipeline: mmcv's Normalize transform (mmcv.imnormalize) in the DataLoader workers, as
    # mmdet 2.x and many 3.x ports do, instead of the DetDataPreprocessor on the main process.
    in_pipeline = args.normalize == "pipeline"
    train_pipeline = [
        dict(type="LoadImageFromFile"),
        dict(type="LoadAnnotations", with_bbox=True),
        dict(type="PhotoMetricDistortion"),
        dict(type="Resize", scale=(args.scale, args.scale), keep_ratio=True),
        dict(type="RandomFlip", prob=0.5),
        *([dict(type="mmcv.Normalize", mean=MEAN, std=STD, to_rgb=True)] if in_pipeline else []),
        dict(type="PackDetInputs"),
    ]
    preprocessor = (dict(type="DetDataPreprocessor", pad_size_divisor=32) if in_pipeline else
                    dict(type="DetDataPreprocessor", mean=MEAN, std=STD, bgr_to_rgb=True, pad_size_divisor=32))
    model = retinanet(args.depth, len(CLASSES), data_preprocessor=preprocessor,
                      train_cfg=dict(sampler=dict(type="PseudoSampler")))
    return dict(
        default_scope="mmdet",
        model=model,
        work_dir=args.work_dir,
        train_dataloader=dict(
            batch_size=args.batch_size, num_workers=args.workers, persistent_workers=args.workers > 0,
            sampler=dict(type="InfiniteSampler", shuffle=True),
            dataset=dict(type="CocoDataset", data_root=str(data_root), ann_file=ann_file.name,
                         data_prefix=dict(img=""), metainfo=dict(classes=CLASSES),
                         filter_cfg=dict(filter_empty_gt=True, min_size=8), pipeline=train_pipeline)),
        train_cfg=dict(type="IterBasedTrainLoop", max_iters=args.iters),
        # Plain SGD (momentum, weight decay) as in mmdet's RetinaNet schedules; clipping keeps the
        # randomly initialised network stable at this learning rate.
        optim_wrapper=dict(type="OptimWrapper",
                           optimizer=dict(type="SGD", lr=args.lr, momentum=0.9, weight_decay=1e-4),
                           clip_grad=dict(max_norm=35, norm_type=2)),
        param_scheduler=[dict(type="LinearLR", start_factor=0.1, by_epoch=False, begin=0, end=10)],
        # Log every iteration, unsmoothed (window 1), with enough digits to compare runs.
        default_hooks=dict(timer=dict(type="IterTimerHook"), logger=dict(type="LoggerHook", interval=1),
                           param_scheduler=dict(type="ParamSchedulerHook"), checkpoint=None,
                           sampler_seed=dict(type="DistSamplerSeedHook")),
        log_processor=dict(type="LogProcessor", window_size=1, by_epoch=False, num_digits=7),
        randomness=dict(seed=args.seed, deterministic=True),
        env_cfg=dict(cudnn_benchmark=False, mp_cfg=dict(mp_start_method="fork", opencv_num_threads=0),
                     dist_cfg=dict(backend="nccl" if _cuda() else "gloo")),
        launcher="pytorch" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else "none",
        # DDP of a CPU module takes no device_ids (mmengine passes LOCAL_RANK by default).
        **({} if _cuda() else {"model_wrapper_cfg": dict(type="MMDistributedDataParallel", device_ids=None)}),
        log_level="INFO",
    )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> None:
    args = arguments(__doc__.splitlines()[0], argv,
                     normalize=("preprocessor", "pipeline"))

    if _cuda():
        from mmcv.ops import get_compiling_cuda_version

        if get_compiling_cuda_version() == "not available":
            # RetinaNet's FocalLoss calls mmcv's CUDA kernel for CUDA tensors; a CPU-ops build has none.
            raise SystemExit("this mmcv was built without CUDA ops (FORCE_CUDA=0): rebuild it with CUDA to train "
                             "on the GPU, or hide the GPU (CUDA_VISIBLE_DEVICES=) to train on the CPU")
        # torch.use_deterministic_algorithms (randomness.deterministic) needs this for cuBLAS
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from mmengine.config import Config
    from mmengine.runner import Runner

    if "RANK" in os.environ and not _cuda():
        # mmengine 0.10's init_dist calls torch.cuda.set_device, which a CPU build of torch lacks; a
        # process group that already exists is used as is (gloo on the CPU).
        import torch.distributed as dist

        dist.init_process_group("gloo")

    with tempfile.TemporaryDirectory(prefix="loongkit-mmdet-") as tmp:
        data_root = Path(tmp) / "data"
        data_root.mkdir()
        # Every rank writes the same files from the same seed into its own directory: no barrier needed.
        ann_file = make_dataset(data_root, args.images, args.seed)
        args.work_dir = args.work_dir or str(Path(tmp) / "work")
        runner = Runner.from_cfg(Config(build_config(data_root, ann_file, args)))
        runner.train()


if __name__ == "__main__":
    main()
