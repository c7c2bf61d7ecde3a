"""Allocation-heavy data-pipeline calls in a DataLoader worker: glibc defaults vs LOONGKIT_PYTORCH tuning,
and vs jemalloc / tcmalloc preloaded.

Each case runs in a forked DataLoader worker (num_workers=1), one call per dataset item, the way a
training pipeline runs them. The script starts itself under the loongkit prelude for each case, with
LOONGKIT_PYTORCH=0 (baseline: glibc defaults) and =1 (ours: the worker gets the mallopt tuning at
start and its heap bound after each batch), then, for each installed allocator library, preloaded the
way ``LOONGKIT_MALLOC=1 LOONGKIT_MALLOC_ALLOCATOR=<kind>`` under ``loongkit-run`` preloads it for a job
(the plugin's own library lookup and variables: ``LD_PRELOAD``, and jemalloc's ``MALLOC_CONF`` as
torch's run_cpu sets it), with LOONGKIT_PYTORCH=1 and LOONGKIT_MALLOC=1; all alternating per case, in
the same run. Upstream calls (mmcv
imnormalize, mmdet PhotoMetricDistortion, mmcv Voxelization, mmseg DiceLoss, mmcv
multi_scale_deformable_attn_pytorch) are used when importable
(the mm stack venv); otherwise pure-torch/numpy equivalents with the same large temporaries, and
the script says which.

    python benchmarks/allocator.py [--quick] [--cases a,b] [--variants ours,jemalloc,tcmalloc]

``--quick``: 5 calls per case and only the goal's cases, imnormalize and Voxelization (Voxelization has
the tuned worker's largest peak RSS), to stay under a minute with four variants (each child imports
torch and the case's mm package: 4-8 s here); the full run does 20 calls of all five cases.

Prints ``BENCH <case> baseline=<s> ours=<s> ratio=<baseline/ours>`` per case (median seconds per
call, wall and, as ``<case>_cpu``, the worker's CPU time, which a loaded machine distorts far less),
minor faults per call and the worker's peak RSS (``BENCH allocator_<case>_rss`` and, the largest of them,
``BENCH allocator_peak_rss baseline=<bytes> ours=<bytes> ...``), and how often the worker's heap bound
(loongkit_data.allocator.HeapBound) trimmed. The allocator variants print the same lines with their
name after the case's, ``ours`` being the preloaded library: ``BENCH allocator_voxelization_jemalloc``,
``..._jemalloc_cpu``, ``..._jemalloc_rss``, ``BENCH allocator_peak_rss_jemalloc``. Goals (issue 18):
imnormalize and Voxelization >= 3x, peak RSS at most 1.25x the default's; a goal line per variant.
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
QUICK_CASES = ("imnormalize", "voxelization")  # the goal's cases
ALLOCATORS = ("jemalloc", "tcmalloc")
VARIANTS = ("ours", *ALLOCATORS)  # each compared with the baseline (glibc defaults, LOONGKIT_PYTORCH=0)


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
        state = _worker_state()
        bound = state.get("heap_bound")
        return {"seconds": seconds, "cpu": cpu, "faults": usage.ru_minflt - before, "maxrss": usage.ru_maxrss * 1024,
                "source": self.source, "bound": bound.to_json() if bound is not None else None,
                "allocator": _loaded_allocator(), "malloc": state.get("malloc"), "jemalloc": state.get("jemalloc")}


def _worker_state() -> dict[str, Any]:
    """What LOONGKIT_PYTORCH's worker callback did in this worker (its HeapBound, as of the batches
    before this one, and its malloc result); empty without the feature."""
    try:
        from loongkit_data.pytorch_memory import worker_state
    except ImportError:
        return {}
    return worker_state


def _loaded_allocator() -> str:
    """The malloc this worker runs on: jemalloc / tcmalloc when loaded, else glibc."""
    from loongkit_data import allocator

    return allocator.preloaded_allocator() or "glibc"


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
                         "bound": items[-1]["bound"], "allocator": items[-1]["allocator"],
                         "malloc": items[-1]["malloc"], "jemalloc": items[-1]["jemalloc"]}
    print("RESULT " + json.dumps(results))


def variant_environ(variant: str, environ: dict[str, str], library: str | None = None) -> dict[str, str]:
    """The child's environment: the prelude on PYTHONPATH, no LOONGKIT_* of the caller's, the variant's
    switches; an allocator variant gets ``library`` preloaded with the variables LOONGKIT_MALLOC's
    launcher hook exports for it (``allocator.preload_environ``)."""
    from loongkit_core.prelude import PATH

    env = {k: v for k, v in environ.items() if not k.startswith("LOONGKIT_")}
    env["PYTHONPATH"] = os.pathsep.join([PATH, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env["LOONGKIT_PYTORCH"] = "0" if variant == "baseline" else "1"
    env["LOONGKIT_LOGDIR"] = "stderr"
    if variant in ALLOCATORS:
        from loongkit_data import allocator

        assert library is not None
        env.update(allocator.preload_environ(library, variant, env))
        env.update(LOONGKIT_MALLOC="1", LOONGKIT_MALLOC_ALLOCATOR=variant)
    return env


def run(variant: str, n: int, cases: list[str], library: str | None = None) -> dict[str, Any]:
    env = variant_environ(variant, dict(os.environ), library)
    proc = subprocess.run([sys.executable, __file__, "--child", "--n", str(n), "--cases", ",".join(cases)],
                          env=env, capture_output=True, text=True, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    results: dict[str, Any] = json.loads(line[len("RESULT "):])
    expected = variant if variant in ALLOCATORS else "glibc"
    for case, result in results.items():  # a variant that did not run on its allocator measures nothing
        if result["allocator"] != expected:
            raise SystemExit(f"{case}, {variant}: the worker runs on {result['allocator']}, not {expected}")
    return results


def report(case: str, name: str, b: dict[str, Any], o: dict[str, Any]) -> tuple[float, float]:
    """Print one variant's lines for one case (``name`` "" for ours); (wall ratio, CPU ratio)."""
    suffix = f"_{name}" if name else ""
    bound = o.get("bound") or {}
    notes = ""
    if bound:
        notes = (f"; bound: held {bound['held'] / 2**20:,.0f} MiB after a clean batch "
                 f"(+{bound['working_set'] / 2**20:,.0f} MiB for the batch), trimmed {bound['trims']} time(s) "
                 f"in {bound['batches']} batches")
    if name:
        malloc = o.get("malloc") or {}
        notes += f"; worker on {o['allocator']}, glibc tuning: {malloc.get('skipped', malloc) or 'none'}"
        if o.get("jemalloc"):
            notes += f"; jemalloc: {o['jemalloc']}"
    print(f"# {case}{' ' + name if name else ''}: {b['source']}; minor faults per call {b['faults']:,.0f} -> "
          f"{o['faults']:,.0f}; worker peak RSS {b['maxrss'] / 2**20:,.0f} -> {o['maxrss'] / 2**20:,.0f} MiB{notes}")
    wall, cpu = b["seconds"] / o["seconds"], b["cpu"] / o["cpu"]
    print(f"BENCH allocator_{case}{suffix} baseline={b['seconds']:.5f} ours={o['seconds']:.5f} ratio={wall:.2f}")
    print(f"BENCH allocator_{case}{suffix}_cpu baseline={b['cpu']:.5f} ours={o['cpu']:.5f} ratio={cpu:.2f}")
    print(f"BENCH allocator_{case}{suffix}_rss baseline={b['maxrss']} ours={o['maxrss']} "
          f"ratio={b['maxrss'] / o['maxrss']:.2f}")
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"5 calls per case, cases {','.join(QUICK_CASES)} (< 1 min)")
    parser.add_argument("--n", type=int, default=0)
    parser.add_argument("--cases", default="")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="compared with the baseline, in this order")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    n = args.n or (5 if args.quick else 20)
    cases = args.cases.split(",") if args.cases else list(QUICK_CASES if args.quick else CASES)
    if args.child:
        child(n, cases)
        return
    from loongkit_data import allocator

    variants: list[str] = []
    libraries: dict[str, str] = {}
    for variant in args.variants.split(","):
        path = allocator.find_library(variant) if variant in ALLOCATORS else None
        if variant in ALLOCATORS and path is None:
            print(f"# {variant}: not installed, not measured")
            continue
        if path is not None:
            libraries[variant] = path
        variants.append(variant)
    # One child per case and variant, all variants of a case in a row: a shared machine's load drifts over
    # the run, and a case's figures should see the same one.
    results: dict[str, dict[str, Any]] = {v: {} for v in ("baseline", *variants)}
    for case in cases:
        for variant in ("baseline", *variants):
            results[variant].update(run(variant, n, [case], libraries.get(variant)))
    base = results["baseline"]
    for variant in variants:
        name = "" if variant == "ours" else variant
        suffix = f"_{name}" if name else ""
        ours = results[variant]
        if name:
            print(f"# {variant}: {libraries[variant]}, "
                  + ", ".join(f"{k}={v}" for k, v in allocator.preload_environ(libraries[variant], variant, {}).items()
                              if k != "LD_PRELOAD"))
        ratios: dict[str, float] = {}
        cpu_ratios: dict[str, float] = {}  # CPU time of the call in the worker: far less noisy on a loaded machine
        for case in cases:
            ratios[case], cpu_ratios[case] = report(case, name, base[case], ours[case])
        peak_b = max(v["maxrss"] for v in base.values())
        peak_o = max(v["maxrss"] for v in ours.values())
        print(f"BENCH allocator_peak_rss{suffix} baseline={peak_b} ours={peak_o} ratio={peak_b / peak_o:.2f}")
        fast = [c for c in ("imnormalize", "voxelization") if c in ratios]
        worst = max(ours[c]["maxrss"] / base[c]["maxrss"] for c in cases)
        for label, r in (("wall", ratios), ("CPU", cpu_ratios)):
            met = all(r[c] >= 3 for c in fast) and peak_o <= 1.25 * peak_b
            print(f"# goal (issue 18), {variant}, {label} time: {', '.join(f'{c} {r[c]:.2f}x' for c in fast)} "
                  f"(>= 3x); peak RSS {peak_o / peak_b:.2f}x the default's (<= 1.25x; the worst case alone "
                  f"{worst:.2f}x): {'met' if met else 'MISSED'}; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
