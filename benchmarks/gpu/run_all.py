"""The GPU-relevant benchmarks in one run, one table (needs a CUDA device; exits 2 without one).

Cases, each in its own interpreter so a failing one does not hide the others:

- prefetch : ``benchmarks/gpu/data_prefetch.py`` (LOONGKIT_DATA_PREFETCH / MMENGINE_DATA_PREFETCH):
             step time of a loop whose step copies detection-sized batches to the GPU, plain vs prefetched.
- msda     : loongkit-ops' Triton multi-scale deformable attention (forward + backward, BEVFormer-tiny
             SCA shape) vs mmcv's ``multi_scale_deformable_attn_pytorch`` (the reference gather
             implementation when mmcv is absent); also prints the largest difference.
- tf32     : LOONGKIT_ALLOW_TF32's switch: fp32 matmul (4096^2) and 3x3 conv (ResNet stage shape) with
             TF32 off (baseline) and on; also prints the relative error of each against float64.
- compile  : torch.compile (inductor) of a ResNet-like conv net on the GPU, steady-state training
             step eager vs compiled, and the first (compiling) step.

    python benchmarks/gpu/run_all.py [--quick] [--cases prefetch,tf32] [--json out.json]

Prints ``BENCH``/``SKIP`` lines per case as they come, then the table ``loongkit bench`` prints.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CASES = ("prefetch", "msda", "tf32", "compile")


def cuda_timer(fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    """Median seconds of fn() over reps, each timed with CUDA events after warm-up."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def bench_line(name: str, baseline: float, ours: float) -> None:
    print(f"BENCH {name} baseline={baseline:.6f} ours={ours:.6f} ratio={baseline / ours:.2f}", flush=True)


def case_msda(quick: bool) -> None:
    import torch
    from loongkit_ops.kernels import ops, reference

    dev = torch.device("cuda")
    backend, why = ops.msda_backend(torch.empty(1, device=dev))
    if backend != "triton":
        print(f"SKIP gpu_msda: the Triton kernel is not used here ({why})", flush=True)
        return

    try:
        from mmcv.ops.multi_scale_deform_attn import multi_scale_deformable_attn_pytorch as upstream
        label = "mmcv multi_scale_deformable_attn_pytorch"
    except ImportError:
        upstream = None
        label = "loongkit_ops.kernels.reference (mmcv not importable)"
    g = torch.Generator(device=dev).manual_seed(0)
    # BEVFormer-tiny spatial cross-attention: 6 cameras x ~1000 queries, 15x25 map, 8 heads x 32, 8 points.
    bs, lq, heads, ch, points = 6, 1000, 8, 32, 8
    shapes = torch.tensor([[15, 25]], device=dev)
    starts = torch.tensor([0], device=dev)
    keys = 15 * 25
    value = torch.randn(bs, keys, heads, ch, device=dev, generator=g, requires_grad=True)
    loc = torch.rand(bs, lq, heads, 1, points, 2, device=dev, generator=g, requires_grad=True)
    attn = torch.rand(bs, lq, heads, 1, points, device=dev, generator=g).softmax(-1).requires_grad_()
    grad = torch.randn(bs, lq, heads * ch, device=dev, generator=g)

    def base() -> torch.Tensor:
        out = (upstream(value, shapes, loc, attn) if upstream is not None
               else reference.ms_deform_attn(value, shapes, starts, loc, attn))
        out.backward(grad)
        return out

    def ours() -> torch.Tensor:  # the op LOONGKIT_BEVFORMER installs: Triton on CUDA tensors
        out = ops.multi_scale_deformable_attn(value, shapes, starts, loc, attn)
        out.backward(grad)
        return out

    reps = 10 if quick else 50
    tb, to = cuda_timer(base, reps), cuda_timer(ours, reps)
    with torch.no_grad():
        diff = (base() - ours()).abs().max().item()
    print(f"  msda baseline = {label}; max |difference| of the forward = {diff:.2e}", flush=True)
    bench_line("gpu_msda_fwd_bwd", tb, to)


def case_tf32(quick: bool) -> None:
    import torch

    dev = torch.device("cuda")
    torch.manual_seed(0)
    n = 2048 if quick else 4096
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    exact = (a.double() @ b.double())
    x = torch.randn(32, 256, 56, 56, device=dev)
    conv = torch.nn.Conv2d(256, 256, 3, padding=1, bias=False).to(dev)
    with torch.no_grad():
        exact_conv = torch.nn.functional.conv2d(x.double(), conv.weight.double(), padding=1)
    reps = 10 if quick else 50
    results: dict[str, dict[str, float]] = {}
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        with torch.no_grad():
            t_mm = cuda_timer(lambda: a @ b, reps)
            t_conv = cuda_timer(lambda: conv(x), reps)
            err_mm = ((a @ b).double() - exact).norm().item() / exact.norm().item()
            err_conv = (conv(x).double() - exact_conv).norm().item() / exact_conv.norm().item()
        results["tf32" if tf32 else "fp32"] = {"mm": t_mm, "conv": t_conv, "err_mm": err_mm, "err_conv": err_conv}
    f, t = results["fp32"], results["tf32"]
    print(f"  tf32 relative error vs float64: matmul {f['err_mm']:.1e} (fp32) -> {t['err_mm']:.1e} (tf32); "
          f"conv {f['err_conv']:.1e} -> {t['err_conv']:.1e}", flush=True)
    bench_line(f"gpu_tf32_matmul_{n}", f["mm"], t["mm"])
    bench_line("gpu_tf32_conv3x3_32x256x56x56", f["conv"], t["conv"])


def train_step(fwd: Any, opt: Any, x: Any, y: Any) -> Callable[[], None]:
    import torch

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(fwd(x), y).backward()
        opt.step()

    return step


def case_compile(quick: bool) -> None:
    import torch
    from torch import nn

    dev = torch.device("cuda")
    torch.manual_seed(0)

    def block(cin: int, cout: int, stride: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                             nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(block(3, 64, 2), block(64, 128, 2), block(128, 256, 2), block(256, 512, 2),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10)).to(dev)

    batch = 16 if quick else 64
    x = torch.randn(batch, 3, 224, 224, device=dev)
    y = torch.randint(10, (batch,), device=dev)
    timings = {}
    for name in ("eager", "compiled"):
        net = model()
        fwd = torch.compile(net) if name == "compiled" else net
        step = train_step(fwd, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9), x, y)
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        timings[name] = {"first": first, "step": cuda_timer(step, 10 if quick else 50)}
    bench_line("gpu_compile_convnet_step", timings["eager"]["step"], timings["compiled"]["step"])
    bench_line("gpu_compile_convnet_first_step", timings["eager"]["first"], timings["compiled"]["first"])


def run_case(case: str, quick: bool) -> int:
    if case == "msda":
        case_msda(quick)
    elif case == "tf32":
        case_tf32(quick)
    elif case == "compile":
        case_compile(quick)
    else:
        raise SystemExit(f"unknown case {case}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer repetitions")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per case")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child process for one case
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        sys.stderr.write("benchmarks/gpu/run_all.py needs a CUDA device: torch.cuda.is_available() is False "
                         f"(torch {torch.__version__}, CUDA build {torch.version.cuda}). Run it on a GPU machine; "
                         "the CPU benchmarks are `loongkit bench`.\n")
        return 2
    if args.case:
        return run_case(args.case, args.quick)

    from loongkit_core.bench import render_table, run_script

    chosen = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(CASES))
    if unknown:
        sys.stderr.write(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}\n")
        return 2
    print(f"GPU: {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})", flush=True)
    quick = ["--quick"] if args.quick else []
    runs = []
    for case in chosen:
        if case == "prefetch":
            run = run_script(case, HERE / "data_prefetch.py", quick, sys.executable, args.timeout, echo=True)
        else:
            run = run_script(case, Path(__file__).resolve(), [*quick, "--case", case], sys.executable,
                             args.timeout, echo=True)
        runs.append(run)
    print(render_table(runs), end="")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "runs": [asdict(r) for r in runs]}, indent=2))
    return 1 if any(r.returncode for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
