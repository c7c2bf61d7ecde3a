"""Allocation-heavy data-pipeline calls in a DataLoader worker: glibc defaults vs LOONGKIT_PYTORCH tuning.

Each case runs in a forked DataLoader worker (num_workers=1), one call per dataset item, the way a
training pipeline runs them. The script starts itself under the loongkit prelude for each case, with
LOONGKIT_PYTORCH=0 (baseline: glibc defaults) and =1 (ours: the worker gets the mallopt tuning at
start and its heap bound after each batch), alternating, in the same run. Upstream calls (mmcv
imnormalize, mmdet PhotoMetricDistortion, mmcv Voxelization, mmseg DiceLoss, mmcv
multi_scale_deformable_attn_pytorch) are used when importable
(the mm stack venv); otherwise pure-torch/numpy equivalents with the same large temporaries, and
the script says which.

    python benchmarks/allocator.py [--quick]

Prints ``BENCH <case> baseline=<s> ours=<s> ratio=<baseline/ours>`` per case (median seconds per
call, wall and, as ``<case>_cpu``, the worker's CPU time, which a loaded machine distorts far less),
minor faults per call and the worker's peak RSS (``BENCH allocator_<case>_rss`` and, the largest of them,
``BENCH allocator_peak_rss baseline=<bytes> ours=<bytes> ...``), and how often the worker's heap bound
(loongkit_data.allocator.HeapBound) trimmed. Goals (issue 18): imnormalize and Voxelization >= 3x,
peak RSS at most 1.25x the default's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

CASES = ("imnormalize", "photometric_distortion", "voxelization", "dice_loss", "msda_pytorch")


# -- the calls (built inside the worker's process) ---------------------------------------------------
def build(case: str, seed: int) -> tuple[Callable[[], Any], str]:
    import numpy as np
    import torch

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    if case == "imnormalize":
        img = rng.integers(0, 256, (900, 1600, 3), dtype=np.uint8)
        mean = np.array([123.675, 116.28, 103.53], np.float32)
        std = np.array([58.395, 57.12, 57.375], np.float32)
        try:
            import cv2
            import mmcv

            cv2.setNumThreads(1)
            return (lambda: mmcv.imnormalize(img, mean, std, True)), "mmcv.imnormalize"
        except ImportError:
            return (lambda: (img[..., ::-1].astype(np.float32) - mean) / std), "numpy equivalent"
    if case == "photometric_distortion":
        img = rng.integers(0, 256, (900, 1600, 3), dtype=np.uint8).astype(np.float32)
        try:
            from mmdet.datasets.transforms import PhotoMetricDistortion

            transform = PhotoMetricDistortion()
            return (lambda: transform({"img": img.copy()})), "mmdet PhotoMetricDistortion"
        except ImportError:
            def distort() -> Any:
                out = img + rng.uniform(-32, 32)
                out = out * rng.uniform(0.5, 1.5)
                gray = out.mean(axis=2, keepdims=True)
                return np.clip(gray + (out - gray) * rng.uniform(0.5, 1.5), 0, 255)[..., rng.permutation(3)]

            return distort, "numpy equivalent"
    if case == "voxelization":
        # CenterPoint nuScenes config: a 1024x1024x40 grid, whose voxel-index table the kernel allocates per call.
        lo, hi = torch.tensor([-51.2, -51.2, -5.0]), torch.tensor([51.2, 51.2, 3.0])
        points = torch.cat([torch.rand(300_000, 3) * (hi - lo) + lo, torch.rand(300_000, 1)], 1)
        try:
            from mmcv.ops import Voxelization

            vox = Voxelization([0.1, 0.1, 0.2], [-51.2, -51.2, -5.0, 51.2, 51.2, 3.0], 10, 90000)
            return (lambda: vox(points)), "mmcv.ops.Voxelization"
        except ImportError:
            size = torch.tensor([0.1, 0.1, 0.2])

            def voxelize() -> Any:
                coords = ((points[:, :3] - lo) / size).long()
                table = torch.full((40, 1024, 1024), -1, dtype=torch.int32)  # the kernel's index table
                table[coords[:, 2], coords[:, 1], coords[:, 0]] = torch.arange(len(points), dtype=torch.int32)
                keys = (coords[:, 2] * 1024 + coords[:, 1]) * 1024 + coords[:, 0]
                uniq, counts = torch.unique(keys, return_counts=True)
                return uniq[:90000], counts, table

            return voxelize, "torch equivalent"
    if case == "dice_loss":
        pred = torch.randn(4, 19, 256, 512)
        target = torch.randint(0, 19, (4, 256, 512))
        try:
            from mmseg.models.losses import DiceLoss

            loss = DiceLoss(use_sigmoid=False)
            return (lambda: loss(pred, target)), "mmseg DiceLoss"
        except ImportError:
            def dice() -> Any:
                p = pred.softmax(1)
                one_hot = torch.nn.functional.one_hot(target, 19).permute(0, 3, 1, 2).float()
                inter = (p * one_hot).flatten(2).sum(2)
                return (1 - (2 * inter + 1e-3) / (p.flatten(2).sum(2) + one_hot.flatten(2).sum(2) + 1e-3)).mean()

            return dice, "torch equivalent"
    if case == "msda_pytorch":
        # BEVFormer-tiny spatial cross-attention: 6 cameras, one 15x25 level, 8 heads x 32, 2500 queries.
        value = torch.randn(6, 375, 8, 32)
        shapes = torch.tensor([[15, 25]])
        locations = torch.rand(6, 2500, 8, 1, 8, 2)
        weights = torch.rand(6, 2500, 8, 1, 8).softmax(-1)
        try:
            from mmcv.ops.multi_scale_deform_attn import multi_scale_deformable_attn_pytorch as msda

            return (lambda: msda(value, shapes, locations, weights)), "mmcv multi_scale_deformable_attn_pytorch"
        except ImportError:
            def msda_torch() -> Any:
                bs, _, heads, dim = value.shape
                _, queries, _, levels, points, _ = locations.shape
                grid = 2 * locations - 1
                v = value.flatten(2).transpose(1, 2).reshape(bs * heads, dim, 15, 25)
                g = grid[:, :, :, 0].transpose(1, 2).flatten(0, 1)
                sampled = torch.nn.functional.grid_sample(v, g, mode="bilinear", padding_mode="zeros",
                                                          align_corners=False)
                w = weights.transpose(1, 2).reshape(bs * heads, 1, queries, levels * points)
                return (sampled * w).sum(-1).view(bs, heads * dim, queries).transpose(1, 2)

            return msda_torch, "torch equivalent"
    raise ValueError(case)


class Calls:
    """A map-style dataset: item i runs the case's call once in the worker and reports it."""

    def __init__(self, case: str, n: int) -> None:
        self.case, self.n, self.fn, self.source = case, n, None, ""

    def __len__(self) -> int:
        return self.n + 1  # item 0 warms up

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.fn is None:
            import torch

            torch.set_num_threads(1)
            self.fn, self.source = build(self.case, 0)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start, cpu = time.perf_counter(), time.process_time()
        self.fn()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        usage = resource.getrusage(resource.RUSAGE_SELF)
        bound = _bound()
        return {"seconds": seconds, "cpu": cpu, "faults": usage.ru_minflt - before, "maxrss": usage.ru_maxrss * 1024,
                "source": self.source, "bound": bound.to_json() if bound is not None else None}


def _bound() -> Any:
    """The worker's HeapBound (LOONGKIT_PYTORCH=1), as of the batches before this one; None untuned."""
    try:
        from loongkit_data.pytorch_memory import worker_state
    except ImportError:
        return None
    return worker_state.get("heap_bound")


def child(n: int, cases: list[str]) -> None:
    from torch.utils.data import DataLoader

    results = {}
    for case in cases:
        loader = DataLoader(Calls(case, n), batch_size=None, num_workers=1, multiprocessing_context="fork")
        items = list(loader)[1:]
        times = sorted(item["seconds"] for item in items)
        cpus = sorted(item["cpu"] for item in items)
        results[case] = {"seconds": times[len(times) // 2], "cpu": cpus[len(cpus) // 2],
                         "faults": sum(i["faults"] for i in items) / len(items),
                         "maxrss": max(i["maxrss"] for i in items), "source": items[0]["source"],
                         "bound": items[-1]["bound"]}
    print("RESULT " + json.dumps(results))


def run(variant: str, n: int, cases: list[str]) -> dict[str, Any]:
    from loongkit_core.prelude import PATH

    env = {k: v for k, v in os.environ.items() if not k.startswith("LOONGKIT_")}
    env["PYTHONPATH"] = os.pathsep.join([PATH, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env["LOONGKIT_PYTORCH"] = "1" if variant == "ours" else "0"
    env["LOONGKIT_LOGDIR"] = "stderr"
    proc = subprocess.run([sys.executable, __file__, "--child", "--n", str(n), "--cases", ",".join(cases)],
                          env=env, capture_output=True, text=True, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 calls per case (< 1 min)")
    parser.add_argument("--n", type=int, default=0)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    n = args.n or (5 if args.quick else 20)
    cases = args.cases.split(",")
    if args.child:
        child(n, cases)
        return
    # One child per case and variant, baseline and ours alternating: a shared machine's load drifts over
    # the run, and a case's two figures should see the same one.
    base: dict[str, Any] = {}
    ours: dict[str, Any] = {}
    for case in cases:
        base.update(run("baseline", n, [case]))
        ours.update(run("ours", n, [case]))
    ratios: dict[str, float] = {}
    cpu_ratios: dict[str, float] = {}  # CPU time of the call in the worker: far less noisy on a loaded machine
    for case in cases:
        b, o = base[case], ours[case]
        bound = o.get("bound") or {}
        trims = ""
        if bound:
            trims = (f"; bound: held {bound['held'] / 2**20:,.0f} MiB after a clean batch "
                     f"(+{bound['working_set'] / 2**20:,.0f} MiB for the batch), trimmed {bound['trims']} time(s) "
                     f"in {bound['batches']} batches")
        print(f"# {case}: {b['source']}; minor faults per call {b['faults']:,.0f} -> {o['faults']:,.0f}; "
              f"worker peak RSS {b['maxrss'] / 2**20:,.0f} -> {o['maxrss'] / 2**20:,.0f} MiB{trims}")
        ratios[case] = b["seconds"] / o["seconds"]
        cpu_ratios[case] = b["cpu"] / o["cpu"]
        print(f"BENCH allocator_{case} baseline={b['seconds']:.5f} ours={o['seconds']:.5f} "
              f"ratio={ratios[case]:.2f}")
        print(f"BENCH allocator_{case}_cpu baseline={b['cpu']:.5f} ours={o['cpu']:.5f} "
              f"ratio={cpu_ratios[case]:.2f}")
        print(f"BENCH allocator_{case}_rss baseline={b['maxrss']} ours={o['maxrss']} "
              f"ratio={b['maxrss'] / o['maxrss']:.2f}")
    peak_b = max(v["maxrss"] for v in base.values())
    peak_o = max(v["maxrss"] for v in ours.values())
    print(f"BENCH allocator_peak_rss baseline={peak_b} ours={peak_o} ratio={peak_b / peak_o:.2f}")
    fast = [c for c in ("imnormalize", "voxelization") if c in ratios]
    worst = max(ours[c]["maxrss"] / base[c]["maxrss"] for c in cases)
    for name, r in (("wall", ratios), ("CPU", cpu_ratios)):
        met = all(r[c] >= 3 for c in fast) and peak_o <= 1.25 * peak_b
        print(f"# goal (issue 18), {name} time: {', '.join(f'{c} {r[c]:.2f}x' for c in fast)} (>= 3x); peak RSS "
              f"{peak_o / peak_b:.2f}x the default's (<= 1.25x; the worst case alone {worst:.2f}x): "
              f"{'met' if met else 'MISSED'}; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
