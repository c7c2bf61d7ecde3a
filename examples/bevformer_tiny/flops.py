"""``train.py --flops``: where one training step's FLOPs go, published BEVFormer-tiny vs the CPU preset.

One sample (a queue of three frames, six cameras) through the training forward (history frames
without gradients, as in training) and the backward, counted by ``torch.utils.flop_counter``'s
formulas (matmuls and convolutions; the bilinear sampling's few FLOPs are not counted), each
operation attributed to the phase running it, as ``--phases`` times them (forward: the model's
phase blocks; backward: split where the gradients of the decoder output, the BEV features and the
image features complete). Phases: backbone = ResNet + FPN (and GridMask); encoder = BEV queries,
can_bus MLP, BEVFormerEncoder (TSA, SCA, FFNs); decoder = DetectionTransformerDecoder (with the box
refinement branches); loss = the head's class / box branches and the losses.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import config
from synthetic_scenes import make_dataset

PARTS = ("backbone", "encoder", "decoder", "loss", "other")


def _phase_counter() -> type:
    from projects.mmdet3d_plugin.utils.phases import PHASES
    from torch.utils.flop_counter import FlopCounterMode

    class PhaseFlops(FlopCounterMode):
        """FlopCounterMode whose counts go to the phase running each operation."""

        def __init__(self) -> None:
            super().__init__(display=False)
            self.by_phase: dict[str, int] = {}

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            if func_packet in self.flop_registry:
                flops = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
                self.by_phase[PHASES.current] = self.by_phase.get(PHASES.current, 0) + flops
            return out

    return PhaseFlops


def count(preset: str, seed: int) -> dict[str, float]:
    """GFLOPs per part of one training step (forward + backward) of ``preset``."""
    import torch
    from mmengine.logging import MMLogger
    from mmengine.registry import DATASETS, MODELS, DefaultScope
    from projects.mmdet3d_plugin.utils.phases import PHASES

    PhaseFlops = _phase_counter()
    s = config.size(preset)
    with tempfile.TemporaryDirectory(prefix="loongkit-bevformer-flops-") as tmp:
        ann = make_dataset(Path(tmp), 1, s.queue_length + 1, s.image[0] * 2, s.image[1] * 2, seed, objects=24)
        MMLogger.get_instance("bev-flops", log_level="WARNING")  # no per-parameter init_weights report
        scope = DefaultScope.get_instance(f"bev-flops-{preset}", scope_name="mmdet")
        assert scope is not None
        torch.manual_seed(seed)
        model = MODELS.build(config.model(s))
        model.init_weights()
        model.train()
        dataset = DATASETS.build(dict(type="SyntheticNuScenesDataset", data_root=tmp, ann_file=ann.name,
                                      pipeline=config.train_pipeline(), classes=None, queue_length=s.queue_length,
                                      bev_size=(s.bev, s.bev), test_mode=False))
        sample = dataset[len(dataset) - 1]
        batch = model.data_preprocessor({k: [v] for k, v in sample.items()}, True)
        PHASES.enabled = True
        PHASES.start_step()
        try:
            with PhaseFlops() as counter:
                losses = model(**batch, mode="loss")
                loss, _ = model.parse_losses(losses)
                PHASES.backward(loss.backward)
        finally:
            PHASES.enabled = False
    total = sum(counter.by_phase.values())
    out = {part: counter.by_phase.get(part, 0) / 1e9 for part in PARTS}
    out["total"] = total / 1e9
    return out


def report(args: argparse.Namespace) -> None:
    rows = {preset: count(preset, args.seed) for preset in ("published", "cpu")}
    parts = list(PARTS)
    print("FLOPs of one training step (forward + backward; history frames forward only), GFLOP and share")
    print(f"{'preset':<11}" + "".join(f"{p:>18}" for p in parts) + f"{'total':>10}")
    for preset, row in rows.items():
        cells = "".join(f"{row[p]:>9.2f} ({row[p] / row['total']:>5.1%})" for p in parts)
        print(f"{preset:<11}{cells}{row['total']:>10.1f}")
