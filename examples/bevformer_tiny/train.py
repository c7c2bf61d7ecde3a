"""BEVFormer-tiny (multi-camera 3D detection) trained by mmengine's Runner on synthetic driving scenes.

A BEVFormer training job as its users build one, knowing nothing about loongkit: the model lives in a
``projects/mmdet3d_plugin`` package whose modules register into the OpenMMLab registries
(TemporalSelfAttention, SpatialCrossAttention / MSDeformableAttention3D, CustomMSDeformableAttention,
the encoder, decoder, head and detector, the multi-view pipeline, the temporal dataset); the config is
BEVFormer-tiny's (``config.py``: ``--preset cpu`` scales it for a 2-core CPU, ``published`` is the
paper's size). Six-camera sequences are generated into a temporary directory as JPEG files plus an
annotation file and read back by DataLoader workers through the pipeline (multi-view loading,
PhotoMetricDistortion and Normalize per view, rescale, padding, packing). AdamW with the published
warm-up + cosine schedule. Seeded and deterministic; mmengine logs every iteration
(``time: ... data_time: ... loss: ...``).

    python examples/bevformer_tiny/train.py --iters 24
    loongkit compare -- python examples/bevformer_tiny/train.py          # README command 1
    python examples/bevformer_tiny/train.py --phases out.json             # per-phase times
    python examples/bevformer_tiny/train.py --flops                       # FLOP split, both presets
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the projects/ package, the scene generator and the config

import config  # noqa: E402
from synthetic_scenes import make_dataset  # noqa: E402


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=24, help="iterations (24: 20 losses compared + warm-up)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--preset", choices=sorted(config.PRESETS), default="cpu")
    parser.add_argument("--scenes", type=int, default=4, help="synthetic sequences to generate")
    parser.add_argument("--frames", type=int, default=10, help="frames per sequence")
    parser.add_argument("--bev", type=int, default=None, help="BEV grid side (default: the preset's)")
    parser.add_argument("--queries", type=int, default=None, help="decoder queries (default: the preset's)")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phases", nargs="?", const="", default=None, metavar="JSON",
                        help="time backbone / encoder / decoder / loss / optimizer / data wait per step; "
                             "print the table at the end (and write it to JSON if a path is given)")
    parser.add_argument("--flops", action="store_true",
                        help="print the FLOP split (backbone / encoder / decoder / head) of one training step "
                             "for the published and the cpu preset, then exit")
    parser.add_argument("--work-dir", default=None, help="work dir (default: a temporary one)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    import projects.mmdet3d_plugin  # noqa: F401  (registers the classes, as a config's plugin_dir would)

    if args.flops:
        from flops import report

        report(args)
        return
    from mmengine.config import Config
    from mmengine.runner import Runner

    s = config.size(args.preset, bev=args.bev, num_query=args.queries)
    with tempfile.TemporaryDirectory(prefix="loongkit-bevformer-") as tmp:
        data_root = Path(tmp) / "data"
        # Raw images twice the network input: the published pipeline rescales by 0.5.
        ann = make_dataset(data_root, args.scenes, args.frames, s.image[0] * 2, s.image[1] * 2, args.seed)
        work_dir = args.work_dir or str(Path(tmp) / "work")
        phases = None if args.phases is None else (os.path.abspath(args.phases) if args.phases else "")
        cfg: dict[str, Any] = config.runner_config(s, str(data_root), ann.name, args.iters, args.workers, args.lr,
                                                   args.seed, work_dir, phases)
        Runner.from_cfg(Config(cfg)).train()


if __name__ == "__main__":
    main()
