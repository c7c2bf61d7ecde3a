"""The RetinaNet both detection examples train: one config dict, valid in mmdet 2.x and 3.x, and
the command line both take.

ResNet (no pretrained weights) + FPN + a narrower RetinaHead (128 channels instead of the paper's
256: a CPU-sized head). mmdet 3.x adds its data preprocessor and an explicit sampler (see
:func:`retinanet`'s keywords); mmdet 2.x normalises in the pipeline instead.
"""

from __future__ import annotations

import argparse
from typing import Any


def retinanet(depth: int, num_classes: int, channels: int = 128, **extra: Any) -> dict[str, Any]:
    """The model dict; ``extra`` entries are added (``data_preprocessor``) or merged (``train_cfg``)."""
    train_cfg: dict[str, Any] = dict(
        assigner=dict(type="MaxIoUAssigner", pos_iou_thr=0.5, neg_iou_thr=0.4, min_pos_iou=0, ignore_iof_thr=-1),
        allowed_border=-1, pos_weight=-1, debug=False)
    train_cfg.update(extra.pop("train_cfg", {}))
    return dict(
        type="RetinaNet",
        **extra,
        backbone=dict(type="ResNet", depth=depth, num_stages=4, out_indices=(0, 1, 2, 3), frozen_stages=-1,
                      norm_cfg=dict(type="BN", requires_grad=True), norm_eval=False, style="pytorch",
                      init_cfg=None),
        neck=dict(type="FPN", in_channels=[64, 128, 256, 512] if depth < 50 else [256, 512, 1024, 2048],
                  out_channels=channels, start_level=1, add_extra_convs="on_input", num_outs=5),
        bbox_head=dict(
            type="RetinaHead", num_classes=num_classes, in_channels=channels, stacked_convs=2,
            feat_channels=channels,
            anchor_generator=dict(type="AnchorGenerator", octave_base_scale=4, scales_per_octave=3,
                                  ratios=[0.5, 1.0, 2.0], strides=[8, 16, 32, 64, 128]),
            bbox_coder=dict(type="DeltaXYWHBBoxCoder", target_means=[0.0] * 4, target_stds=[1.0] * 4),
            loss_cls=dict(type="FocalLoss", use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=1.0),
            loss_bbox=dict(type="L1Loss", loss_weight=1.0)),
        train_cfg=train_cfg,
        test_cfg=dict(nms_pre=1000, min_bbox_size=0, score_thr=0.05, nms=dict(type="nms", iou_threshold=0.5),
                      max_per_img=100),
    )


def arguments(description: str, argv: list[str] | None = None,
              normalize: tuple[str, ...] | None = None) -> argparse.Namespace:
    """The detection examples' command line (same flags for mmdet 2.x and 3.x; ``normalize`` offers a
    ``--normalize`` choice, the first being the default)."""
    parser = argparse.ArgumentParser(description=description)
    if normalize:
        parser.add_argument("--normalize", choices=normalize, default=normalize[0],
                            help="where images are normalised")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--images", type=int, default=48, help="synthetic images to generate")
    parser.add_argument("--scale", type=int, default=320, help="Resize target (longer side bound)")
    parser.add_argument("--depth", type=int, default=18, choices=(18, 34, 50), help="ResNet depth")
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default=None, help="work dir (default: a temporary one)")
    return parser.parse_args(argv)
