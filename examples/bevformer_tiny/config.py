"""The training config of the example: BEVFormer-tiny's published config, at two sizes.

``published`` is ``projects/configs/bevformer/bevformer_tiny.py`` of BEVFormer (R50 + FPN on six
800x450 cameras, 50x50 BEV, 256 channels, 3 encoder / 6 decoder layers, 900 queries, a queue of 3
frames). ``cpu`` is the same network scaled down for a 2-core CPU with every part divided alike, so
the split of the work between backbone, encoder and decoder stays the published one (``train.py
--flops`` measures both): images and BEV cells 1/9 as many, decoder queries 1/9, every width halved
(ResNet-50 with 32 base channels, 128 embedding channels, FFN 256). Layer counts, heads, sampling
points, pillar anchors, the queue, the losses and the optimiser recipe are the published ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from synthetic_scenes import CLASSES

POINT_CLOUD_RANGE = [-51.2, -51.2, -5.0, 51.2, 51.2, 3.0]
VOXEL_SIZE = [0.2, 0.2, 8]
IMG_NORM = dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375], to_rgb=True)


@dataclass(frozen=True)
class Size:
    """What the two presets change. ``image``: network input (w, h) after the pipeline's 0.5 rescale."""

    image: tuple[int, int]
    bev: int
    num_query: int
    embed_dims: int
    base_channels: int
    queue_length: int = 3
    encoder_layers: int = 3
    decoder_layers: int = 6


PRESETS = {
    "published": Size(image=(800, 450), bev=50, num_query=900, embed_dims=256, base_channels=64),
    "cpu": Size(image=(256, 144), bev=16, num_query=100, embed_dims=128, base_channels=32),
}


def size(preset: str, **overrides: Any) -> Size:
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})


def model(s: Size) -> dict[str, Any]:
    dim = s.embed_dims
    return dict(
        type="BEVFormer",
        use_grid_mask=True,
        video_test_mode=True,
        # No pretrained weights here (no downloads): the published config loads torchvision's R50 and
        # freezes its BN; from scratch, BN trains (stage 1 stays frozen, as published).
        img_backbone=dict(type="ResNet", depth=50, base_channels=s.base_channels, num_stages=4, out_indices=(3,),
                          frozen_stages=1, norm_cfg=dict(type="BN", requires_grad=True), norm_eval=False,
                          style="pytorch"),
        img_neck=dict(type="FPN", in_channels=[s.base_channels * 32], out_channels=dim, start_level=0,
                      add_extra_convs="on_output", num_outs=1, relu_before_extra_convs=True),
        pts_bbox_head=dict(
            type="BEVFormerHead", bev_h=s.bev, bev_w=s.bev, num_query=s.num_query, num_classes=len(CLASSES),
            in_channels=dim, sync_cls_avg_factor=True, with_box_refine=True, as_two_stage=False,
            transformer=dict(
                type="PerceptionTransformer", rotate_prev_bev=True, use_shift=True, use_can_bus=True,
                embed_dims=dim, num_feature_levels=4, rotate_center=[s.bev // 2, s.bev // 2],
                encoder=dict(
                    type="BEVFormerEncoder", num_layers=s.encoder_layers, pc_range=POINT_CLOUD_RANGE,
                    num_points_in_pillar=4, return_intermediate=False,
                    transformerlayers=dict(
                        type="BEVFormerLayer",
                        attn_cfgs=[
                            dict(type="TemporalSelfAttention", embed_dims=dim, num_levels=1),
                            dict(type="SpatialCrossAttention", pc_range=POINT_CLOUD_RANGE, embed_dims=dim,
                                 deformable_attention=dict(type="MSDeformableAttention3D", embed_dims=dim,
                                                           num_points=8, num_levels=1)),
                        ],
                        feedforward_channels=dim * 2, ffn_dropout=0.1,
                        operation_order=("self_attn", "norm", "cross_attn", "norm", "ffn", "norm"))),
                decoder=dict(
                    type="DetectionTransformerDecoder", num_layers=s.decoder_layers, return_intermediate=True,
                    transformerlayers=dict(
                        type="BaseTransformerLayer",
                        attn_cfgs=[
                            dict(type="MultiheadAttention", embed_dims=dim, num_heads=8, dropout=0.1),
                            dict(type="CustomMSDeformableAttention", embed_dims=dim, num_levels=1),
                        ],
                        ffn_cfgs=dict(type="FFN", embed_dims=dim, feedforward_channels=dim * 2, num_fcs=2,
                                      ffn_drop=0.1, act_cfg=dict(type="ReLU", inplace=True)),
                        operation_order=("self_attn", "norm", "cross_attn", "norm", "ffn", "norm")))),
            bbox_coder=dict(type="NMSFreeCoder", post_center_range=[-61.2, -61.2, -10.0, 61.2, 61.2, 10.0],
                            pc_range=POINT_CLOUD_RANGE, max_num=300, voxel_size=VOXEL_SIZE,
                            num_classes=len(CLASSES)),
            positional_encoding=dict(type="LearnedPositionalEncoding", num_feats=dim // 2, row_num_embed=s.bev,
                                     col_num_embed=s.bev),
            loss_cls=dict(type="FocalLoss", use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=2.0),
            loss_bbox=dict(type="L1Loss", loss_weight=0.25),
            loss_iou=dict(type="GIoULoss", loss_weight=0.0)),
        train_cfg=dict(pts=dict(
            grid_size=[512, 512, 1], voxel_size=VOXEL_SIZE, point_cloud_range=POINT_CLOUD_RANGE, out_size_factor=4,
            assigner=dict(type="HungarianAssigner3D", cls_cost=dict(type="FocalLossCost", weight=2.0),
                          reg_cost=dict(type="BBox3DL1Cost", weight=0.25), iou_cost=dict(type="IoUCost", weight=0.0),
                          pc_range=POINT_CLOUD_RANGE))),
    )


def train_pipeline() -> list[dict[str, Any]]:
    return [
        dict(type="LoadMultiViewImageFromFiles", to_float32=True),
        dict(type="PhotoMetricDistortionMultiViewImage"),
        dict(type="LoadAnnotations3D", with_bbox_3d=True, with_label_3d=True, with_attr_label=False),
        dict(type="ObjectRangeFilter", point_cloud_range=POINT_CLOUD_RANGE),
        dict(type="ObjectNameFilter", classes=list(CLASSES)),
        dict(type="NormalizeMultiviewImage", **IMG_NORM),
        dict(type="RandomScaleImageMultiViewImage", scales=[0.5]),
        dict(type="PadMultiViewImage", size_divisor=32),
        dict(type="PackBEVInputs", keys=("gt_bboxes_3d", "gt_labels_3d", "img")),
    ]


def runner_config(s: Size, data_root: str, ann_file: str, iters: int, workers: int, lr: float, seed: int,
                  work_dir: str, phases: str | None) -> dict[str, Any]:
    # The published schedule's shape: linear warm-up from 1/3 of the rate (500 of ~84k iterations there;
    # an eighth of the run here), then cosine annealing to 1e-3 of it.
    warmup = max(1, iters // 8)
    # phases: None = off, "" = the table only, a path = the table and a JSON file.
    hooks = [dict(type="PhasesHook", warmup=5, json_path=phases or None)] if phases is not None else []
    return dict(
        default_scope="mmdet",
        model=model(s),
        work_dir=work_dir,
        train_dataloader=dict(
            batch_size=1, num_workers=workers, persistent_workers=workers > 0,
            sampler=dict(type="InfiniteSampler", shuffle=True), collate_fn=dict(type="bev_collate"),
            dataset=dict(type="SyntheticNuScenesDataset", data_root=data_root, ann_file=ann_file,
                         pipeline=train_pipeline(), classes=list(CLASSES), queue_length=s.queue_length,
                         bev_size=(s.bev, s.bev), test_mode=False, box_type_3d="LiDAR")),
        train_cfg=dict(type="IterBasedTrainLoop", max_iters=iters),
        optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=lr, weight_decay=0.01),
                           paramwise_cfg=dict(custom_keys={"img_backbone": dict(lr_mult=0.1)}),
                           clip_grad=dict(max_norm=35, norm_type=2)),
        param_scheduler=[
            dict(type="LinearLR", start_factor=1.0 / 3, by_epoch=False, begin=0, end=warmup),
            dict(type="CosineAnnealingLR", T_max=max(iters - warmup, 1), eta_min=lr * 1e-3, by_epoch=False,
                 begin=warmup, end=max(iters, warmup + 1)),
        ],
        # Log every iteration, unsmoothed (window 1), with enough digits to compare runs.
        default_hooks=dict(timer=dict(type="IterTimerHook"), logger=dict(type="LoggerHook", interval=1),
                           param_scheduler=dict(type="ParamSchedulerHook"), checkpoint=None,
                           sampler_seed=dict(type="DistSamplerSeedHook")),
        custom_hooks=hooks,
        log_processor=dict(type="LogProcessor", window_size=1, by_epoch=False, num_digits=7),
        randomness=dict(seed=seed, deterministic=True),
        env_cfg=dict(cudnn_benchmark=False, mp_cfg=dict(mp_start_method="fork", opencv_num_threads=0),
                     dist_cfg=dict(backend="gloo")),
        launcher="none",
        log_level="INFO",
    )
