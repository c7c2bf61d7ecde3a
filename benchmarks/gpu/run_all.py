"""The GPU-relevant benchmarks in one run, one table (needs a CUDA device; exits 2 without one).

Cases, each in its own interpreter so a failing one does not hide the others:

- prefetch : ``benchmarks/gpu/data_prefetch.py`` (LOONGKIT_DATA_PREFETCH / MMENGINE_DATA_PREFETCH):
             step time of a loop whose step copies detection-sized batches to the GPU, plain vs prefetched.
- msda     : loongkit-ops' Triton multi-scale deformable attention (forward + backward, BEVFormer-tiny
             SCA shape) vs mmcv's ``multi_scale_deformable_attn_pytorch`` (the reference gather
             implementation when mmcv is absent); also prints the largest difference.
- msda_fused : loongkit-ops' Triton fused deformable attention (``loongkit::ms_deform_attn_fused``: softmax,
             sampling locations, sampling and the mean over the [previous, current] BEV in one kernel;
             forward + backward, BEVFormer-tiny TSA shape) vs the reference torch path
             (``msda_fused.reference``), and vs the same maths unfused in torch around the
             plain Triton MSDA op; prints the largest differences of the output and both gradients.
- daf      : the Triton deformable aggregation (forward + backward, Sparse4D v3: 6 cameras, 4 levels
             64x176..8x22, C=256, 8 groups, 13 points, 900 anchors) vs the reference gather path.
- bev_pool : the Triton BEV pooling (forward + backward, BEVFusion: ~2M points x 80 channels into
             360x360) vs the reference index_add path.
- voxelize : the Triton hard voxelization (nuScenes CenterPoint: ~300k points x 5, 10 points per
             voxel, 90k voxels) vs mmcv's CUDA hard_voxelize in deterministic mode (the sort-based
             reference when mmcv's ops are absent); prints whether the outputs are identical.
- dice     : the Triton Dice statistics (forward + backward, [4, 19, 256, 512] logits), mmseg 1.x
             ``dice_stats`` and mmseg 0.x ``dice_class_stats``, vs the reference torch formulas.
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
CASES = ("prefetch", "msda", "msda_fused", "daf", "bev_pool", "voxelize", "dice", "tf32", "compile")


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
    from loongkit_ops.kernels.ops import msda

    dev = torch.device("cuda")
    backend, why = msda.backend(torch.empty(1, device=dev))
    if backend != "triton":
        print(f"SKIP gpu_msda: the Triton kernel is not used here ({why})", flush=True)
        return

    try:
        from mmcv.ops.multi_scale_deform_attn import multi_scale_deformable_attn_pytorch as upstream
        label = "mmcv multi_scale_deformable_attn_pytorch"
    except ImportError:
        upstream = None
        label = "loongkit_ops.kernels.ops.msda.reference (mmcv not importable)"
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
               else msda.reference(value, shapes, starts, loc, attn))
        out.backward(grad)
        return out

    def ours() -> torch.Tensor:  # the op LOONGKIT_BEVFORMER installs: Triton on CUDA tensors
        out = msda.multi_scale_deformable_attn(value, shapes, starts, loc, attn)
        out.backward(grad)
        return out

    reps = 10 if quick else 50
    tb, to = cuda_timer(base, reps), cuda_timer(ours, reps)
    with torch.no_grad():
        diff = (base() - ours()).abs().max().item()
    print(f"  msda baseline = {label}; max |difference| of the forward = {diff:.2e}", flush=True)
    bench_line("gpu_msda_fwd_bwd", tb, to)


def triton_used(name: str, backend: tuple[str, str]) -> bool:
    """True when the op picks its Triton kernel on CUDA tensors; prints a SKIP line otherwise."""
    if backend[0] != "triton":
        print(f"SKIP gpu_{name}: the Triton kernel is not used here ({backend[1]})", flush=True)
        return False
    return True


def fwd_bwd(fn: Callable[..., Any], inputs: list[Any], grad: Any) -> Callable[[], Any]:
    """fn(*inputs) and its backward with grad; the inputs' .grad reset each call (no accumulation cost)."""

    def step() -> Any:
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        out.backward(grad)
        return out

    return step


def max_difference(base: Callable[[], Any], ours: Callable[[], Any]) -> float:
    """Largest |difference| of the two steps' forward outputs."""
    out_b, out_o = base().detach().float(), ours().detach().float()
    return (out_b - out_o).abs().max().item() if out_b.numel() else 0.0


def case_msda_fused(quick: bool) -> None:
    import torch
    from loongkit_ops.kernels.ops import msda, msda_fused

    dev = torch.device("cuda")
    if not triton_used("msda_fused", msda.backend(torch.empty(1, device=dev))):
        return
    g = torch.Generator(device=dev).manual_seed(0)
    # BEVFormer-tiny temporal self-attention: a 50x50 BEV (2500 queries, one level), [previous, current]
    # queue of 2, 8 heads x 32 channels, 4 points, one reference point per level.
    bs, queue, side, heads, ch, points = 1, 2, 50, 8, 32, 4
    q = side * side
    shapes = torch.tensor([[side, side]], device=dev)
    starts = torch.tensor([0], device=dev)
    value = torch.randn(bs * queue, q, heads, ch, device=dev, generator=g, requires_grad=True)
    ref = torch.rand(bs * queue, q, 1, 2, device=dev, generator=g)
    n = heads * queue * points
    proj = torch.randn(bs, q, 3 * n, device=dev, generator=g)
    proj[..., :2 * n] *= 2  # offsets of a few pixels
    proj.requires_grad_()
    grad = torch.randn(bs, q, heads * ch, device=dev, generator=g)

    def unfused(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """The reference's softmax, locations and mean in torch, its sampling on the plain Triton MSDA op."""
        return msda_fused.reference(v, shapes, starts, ref, p, True, queue, sample=msda.op)

    base = fwd_bwd(lambda v, p: msda_fused.reference(v, shapes, starts, ref, p, True, queue),
                   [value, proj], grad)
    split = fwd_bwd(unfused, [value, proj], grad)
    ours = fwd_bwd(lambda v, p: msda_fused.ms_deform_attn_fused(v, shapes, starts, ref, p, True, queue), [value, proj],
                   grad)
    reps = 10 if quick else 50
    tb, ts, to = cuda_timer(base, reps), cuda_timer(split, reps), cuda_timer(ours, reps)
    mine = (ours().detach(), value.grad.clone(), proj.grad.clone())
    theirs = (base().detach(), value.grad.clone(), proj.grad.clone())
    # The offsets' gradient jumps at pixel borders, so a sample within rounding of one can differ by O(1)
    # however right the kernel is: the relative L2 difference and the count of such elements say more.
    diffs = []
    for name, a, b in zip(("output", "grad value", "grad projection"), mine, theirs, strict=True):
        d, top = (a - b).abs(), b.abs().max().item()
        diffs.append(f"{name}: max {d.max().item():.2e} (largest value {top:.2e}), relative L2 "
                     f"{(d.norm() / b.norm()).item():.2e}, {int((d > 1e-3 * top).sum())}/{d.numel()} beyond 1e-3")
    print(f"  msda_fused baseline = loongkit_ops.kernels.ops.msda_fused.reference; |difference| of "
          f"{'; '.join(diffs)}", flush=True)
    bench_line("gpu_msda_fused_fwd_bwd", tb, to)
    print("  msda_fused vs unfused: the same maths in torch around the plain Triton MSDA op", flush=True)
    bench_line("gpu_msda_fused_vs_unfused_fwd_bwd", ts, to)


def case_daf(quick: bool) -> None:
    import torch
    from loongkit_ops.kernels.ops import daf

    dev = torch.device("cuda")
    if not triton_used("daf", daf.backend(torch.empty(1, device=dev))):
        return
    g = torch.Generator(device=dev).manual_seed(0)
    # Sparse4D v3: 6 cameras, 4 levels 64x176..8x22, C=256, 8 groups, 13 points, 900 anchors.
    bs, anchors, pts, cams, ch, groups = 1, 900 if not quick else 300, 13, 6, 256, 8
    levels = [(64, 176), (32, 88), (16, 44), (8, 22)]
    shapes = torch.tensor([levels] * cams, device=dev)
    areas = (shapes[..., 0] * shapes[..., 1]).flatten()
    starts = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]]).reshape(cams, len(levels))
    feat = torch.randn(bs, int(areas.sum()), ch, device=dev, generator=g, requires_grad=True)
    loc = torch.rand(bs, anchors, pts, cams, 2, device=dev, generator=g, requires_grad=True)
    w = torch.rand(bs, anchors, pts, cams, len(levels), groups, device=dev, generator=g).requires_grad_()
    grad = torch.randn(bs, anchors, ch, device=dev, generator=g)
    base = fwd_bwd(lambda f, lc, ww: daf.reference(f, shapes, starts, lc, ww, True),
                   [feat, loc, w], grad)
    ours = fwd_bwd(lambda f, lc, ww: daf.deformable_aggregation(f, shapes, starts, lc, ww, True), [feat, loc, w],
                   grad)
    reps = 10 if quick else 50
    tb, to = cuda_timer(base, reps), cuda_timer(ours, reps)
    print(f"  daf baseline = loongkit_ops.kernels.ops.daf.reference; max |difference| of the "
          f"forward = {max_difference(base, ours):.2e}", flush=True)
    bench_line("gpu_daf_fwd_bwd", tb, to)


def case_bev_pool(quick: bool) -> None:
    import torch
    from loongkit_ops.kernels.ops import bev_pool

    dev = torch.device("cuda")
    if not triton_used("bev_pool", bev_pool.backend(torch.empty(1, device=dev))):
        return
    g = torch.Generator(device=dev).manual_seed(0)
    # BEVFusion camera branch: ~2M frustum points x 80 channels pooled into a 360x360 BEV grid.
    n, ch, b, z, x, y = (200_000 if quick else 2_000_000), 80, 1, 1, 360, 360
    feats = torch.randn(n, ch, device=dev, generator=g, requires_grad=True)
    coords = torch.stack([torch.randint(0, d, (n,), device=dev, generator=g) for d in (x, y, z, b)], 1)
    grad = torch.randn(b, ch, z, x, y, device=dev, generator=g)
    base = fwd_bwd(lambda f: bev_pool.reference(f, coords, b, z, x, y), [feats], grad)
    ours = fwd_bwd(lambda f: bev_pool.op(f, coords, b, z, x, y), [feats], grad)
    reps = 10 if quick else 50
    tb, to = cuda_timer(base, reps), cuda_timer(ours, reps)
    print(f"  bev_pool baseline = loongkit_ops.kernels.ops.bev_pool.reference (index_add); max |difference| of the "
          f"forward = {max_difference(base, ours):.2e}", flush=True)
    bench_line("gpu_bev_pool_fwd_bwd", tb, to)


def case_voxelize(quick: bool) -> None:
    import torch
    from loongkit_ops.kernels.ops import voxelize

    dev = torch.device("cuda")
    if not triton_used("voxelize", voxelize.backend(torch.empty(1, device=dev))):
        return
    g = torch.Generator(device=dev).manual_seed(0)
    # nuScenes CenterPoint: ~300k points x 5 (x, y, z, intensity, time), 0.075 m voxels, 10 points each.
    n = 30_000 if quick else 300_000
    size, rng, max_points, max_voxels = [0.075, 0.075, 0.2], [-54.0, -54.0, -5.0, 54.0, 54.0, 3.0], 10, 90_000
    points = torch.randn(n, 5, device=dev, generator=g) * torch.tensor([20.0, 20.0, 1.5, 1.0, 1.0], device=dev)
    upstream: Callable[..., Any] = voxelize.hard_reference
    label = "loongkit_ops.kernels.ops.voxelize.hard_reference"
    try:  # mmcv may import yet lack its CUDA ops: try one small call
        from mmcv.ops.voxelize import voxelization as mmcv_voxelization

        mmcv_voxelization(points[:16], size, rng, max_points, max_voxels, True)
        upstream = lambda *a: tuple(mmcv_voxelization(*a, True))  # noqa: E731  (deterministic mode)
        label = "mmcv hard_voxelize (CUDA, deterministic)"
    except Exception as exc:
        label += f" (mmcv's op unusable: {type(exc).__name__}: {exc})"

    reps = 10 if quick else 30
    tb = cuda_timer(lambda: upstream(points, size, rng, max_points, max_voxels), reps)
    to = cuda_timer(lambda: voxelize.hard_op(points, size, rng, max_points, max_voxels), reps)
    theirs = upstream(points, size, rng, max_points, max_voxels)
    mine = voxelize.hard_op(points, size, rng, max_points, max_voxels)
    same = all(a.shape == b.shape and torch.equal(a.to(b.dtype), b) for a, b in zip(mine, theirs, strict=True))
    dyn_same = torch.equal(voxelize.dynamic_op(points, size, rng), voxelize.dynamic_reference(points, size, rng))
    print(f"  voxelize baseline = {label}; {mine[0].shape[0]} voxels; identical output: {same}; dynamic "
          f"identical to the reference: {dyn_same}", flush=True)
    bench_line("gpu_hard_voxelize", tb, to)


def case_dice(quick: bool) -> None:
    import torch
    from loongkit_ops.kernels.ops import dice_class_stats, dice_stats

    dev = torch.device("cuda")
    if not triton_used("dice", dice_stats.backend(torch.empty(1, device=dev))):
        return
    g = torch.Generator(device=dev).manual_seed(0)
    # Cityscapes-like batch: [4, 19, 256, 512] logits, labels with 255 ignored pixels.
    n, c, h, w = (2, 19, 128, 256) if quick else (4, 19, 256, 512)
    logits = torch.randn(n, c, h * w, device=dev, generator=g, requires_grad=True)
    target = torch.randint(0, c, (n, h * w), device=dev, generator=g)
    target[:, ::13] = 255
    reps = 10 if quick else 50
    for name, ref, op, shape in (
            ("dice_stats", lambda x: dice_stats.reference(x, target, 2, 255, False),
             lambda x: dice_stats.op(x, target, 2, 255, False), (n, 3)),
            ("dice_class_stats", lambda x: dice_class_stats.reference(x, target, 255, 2.0),
             lambda x: dice_class_stats.op(x, target, 255, 2.0), (n, c, 3))):
        grad = torch.randn(shape, device=dev, generator=g)
        base, ours = fwd_bwd(ref, [logits], grad), fwd_bwd(op, [logits], grad)
        tb, to = cuda_timer(base, reps), cuda_timer(ours, reps)
        scale = base().detach().abs().max().item()
        print(f"  {name} baseline = loongkit_ops.kernels.ops.{name}.reference; max |difference| of the forward = "
              f"{max_difference(base, ours):.2e} (largest value {scale:.2e})", flush=True)
        bench_line(f"gpu_{name}_fwd_bwd", tb, to)


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
    elif case == "msda_fused":
        case_msda_fused(quick)
    elif case == "daf":
        case_daf(quick)
    elif case == "bev_pool":
        case_bev_pool(quick)
    elif case == "voxelize":
        case_voxelize(quick)
    elif case == "dice":
        case_dice(quick)
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
