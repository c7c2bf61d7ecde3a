"""The GPU proof kit: every Triton kernel checked and timed, and the GPU-relevant benchmarks, in one run.

Needs a CUDA device (exits 2 without one) unless ``--dry-run``. Each kernel case first prints one
``CHECK <kernel> ok|FAIL ...`` line per Triton kernel (forward and backward in fp32, fp16 and bf16 vs
the fp64 torch reference, see ``checks.py``), then its ``BENCH`` line(s); the BENCH name ends in
``_vs_mmcv_cuda`` when the baseline is mmcv's CUDA op and ``_vs_torch_ref`` when it is the torch
reference path (mmcv absent or built without CUDA). A failed check makes the case, and the run, exit 1.

Cases, each in its own interpreter so a failing one does not hide the others (kernels first):

- prefetch : ``benchmarks/gpu/data_prefetch.py`` (LOONGKIT_DATA_PREFETCH / MMENGINE_DATA_PREFETCH):
             step time of a loop whose step copies detection-sized batches to the GPU, plain vs prefetched.
- msda     : loongkit-ops' Triton multi-scale deformable attention (forward + backward, BEVFormer-tiny
             SCA shape) vs mmcv's CUDA ``MultiScaleDeformableAttnFunction`` (an installed mmcv with CUDA
             ops, else mmcv 2.1.0's carried sources built here), else the torch reference
             (``msda.reference``); also prints the largest difference.
- msda_fused : loongkit-ops' Triton fused deformable attention (``loongkit::ms_deform_attn_fused``: softmax,
             sampling locations, sampling and the mean over the [previous, current] BEV in one kernel;
             forward + backward, BEVFormer-tiny TSA shape) vs the reference torch path
             (``msda_fused.reference``), and vs the same maths unfused in torch around the
             plain Triton MSDA op; prints the largest differences of the output and both gradients.
- daf      : the Triton deformable aggregation (forward + backward, Sparse4D v3 shapes: 6 cameras, 4 levels
             64x176..8x22, C=256, 8 groups, 13 points, 900 anchors) vs loongkit-ops' own reference gather
             path (``daf.reference``): no registry package ships a CUDA deformable aggregation.
- bev_pool : the Triton BEV pooling (forward + backward, BEVFusion: ~2M points x 80 channels into
             360x360) vs the reference index_add path.
- voxelize : the Triton hard voxelization (nuScenes CenterPoint: ~300k points x 5, 10 points per
             voxel, 90k voxels) vs mmcv's CUDA hard_voxelize in deterministic mode (installed or carried
             mmcv; the sort-based reference when neither runs); prints whether the outputs are identical,
             and whether the dynamic voxelization equals mmcv's dynamic_voxelize (or the reference).
- dice     : the Triton Dice statistics (forward + backward, [4, 19, 256, 512] logits), mmseg 1.x
             ``dice_stats`` and mmseg 0.x ``dice_class_stats``, vs the reference torch formulas.
- tf32     : LOONGKIT_ALLOW_TF32's switch: fp32 matmul (4096^2) and 3x3 conv (ResNet stage shape) with
             TF32 off (baseline) and on; also prints the relative error of each against float64.
- compile  : torch.compile (inductor) of a ResNet-like conv net on the GPU, steady-state training
             step eager vs compiled, and the first (compiling) step.

    python benchmarks/gpu/run_all.py [--quick] [--cases prefetch,tf32] [--json out.json] [--budget S]
        [--build-baselines | --no-build-baselines] [--build-time S]
    TRITON_INTERPRET=1 python benchmarks/gpu/run_all.py --dry-run [--self-test-break]

Prints ``CHECK``/``BENCH``/``SKIP`` lines per case as they come, then the table ``loongkit bench`` prints.
``--budget`` (seconds, 330 with --quick) bounds the whole run, the baselines' build included (at most
``--build-time`` s, 150 by default, and never less than 120 s left for the cases): each case gets what
is left, so ``--quick`` ends within 6 minutes even if a case hangs. ``--dry-run`` is the CI guard against rot:
the kernel cases in this process on the CPU, Triton's interpreter (TRITON_INTERPRET=1, set if
absent) running the kernels (each op's backend forced to 'triton'), tiny shapes, one repetition;
its timings mean nothing. ``--self-test-break`` replaces every reference with a wrong one, to show
that the checks can fail.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

# benchmarks/_timing.py (the CPU benchmarks' timer and BENCH line) travels with the tree like this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import bench_line, median_time

HERE = Path(__file__).resolve().parent
KERNEL_CASES = ("msda", "msda_fused", "daf", "bev_pool", "voxelize", "dice")
CASES = (*KERNEL_CASES, "prefetch", "tf32", "compile")
# The device the cases run on and whether this is the CPU dry run (set by configure()).
DEV: Any = None
DRY = False
SEED = 0


def configure(dry: bool) -> None:
    """Pick the device; in a dry run, route every op's CPU tensors through its Triton branch (interpreted)."""
    global DEV, DRY
    import torch

    DRY, DEV = dry, torch.device("cpu" if dry else "cuda")
    if dry:
        from loongkit_ops.kernels.ops import bev_pool, daf, dice_class_stats, dice_stats, msda, msda_fused, voxelize

        for mod in (msda, msda_fused, daf, bev_pool, dice_stats, dice_class_stats, voxelize):
            mod.backend = lambda t: ("triton", "")  # type: ignore[attr-defined]


def pick(full: Any, quick: Any, dry: Any, is_quick: bool) -> Any:
    """The size for this run: tiny in a dry run (the interpreter runs one program at a time)."""
    return dry if DRY else (quick if is_quick else full)


def reps_for(quick: bool, full: int = 50) -> int:
    return 1 if DRY else (10 if quick else full)


def check(case: str) -> bool:
    """The case's CHECK line(s); shapes a little larger on a GPU (more blocks, more tails)."""
    from checks import CHECKS

    return CHECKS[case](DEV, DRY, SEED)


def cuda_timer(fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    """Median seconds of fn() over reps, each timed with CUDA events after warm-up (wall clock in a dry run)."""
    import torch

    if DRY:  # no warm-up: the interpreter compiles nothing, and every call costs seconds
        return median_time(fn, reps)
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


def mmcv_msda() -> tuple[Callable[..., Any] | None, str]:
    """mmcv's CUDA MSDA op: an installed mmcv's when its CUDA ops run, else the carried build's; else
    (None, why). Returns (fn(value, shapes, starts, loc, attn), label or why)."""
    if DEV.type != "cuda":
        return None, "not on a CUDA device"
    import torch

    tiny = (torch.zeros(1, 4, 1, 2, device=DEV), torch.tensor([[2, 2]], device=DEV), torch.tensor([0], device=DEV),
            torch.zeros(1, 1, 1, 1, 1, 2, device=DEV), torch.ones(1, 1, 1, 1, 1, device=DEV))
    try:
        from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttnFunction

        def run(v: Any, shapes: Any, starts: Any, loc: Any, attn: Any) -> Any:
            return MultiScaleDeformableAttnFunction.apply(v, shapes, starts, loc, attn, 64)

        run(*tiny)  # mmcv may import yet lack its CUDA ops: one tiny call says
        return run, "mmcv MultiScaleDeformableAttnFunction (installed mmcv's CUDA op)"
    except Exception as exc:
        installed = f"installed mmcv unusable: {type(exc).__name__}: {exc}"[:160]
    import build_baselines

    carried, why = build_baselines.mmcv_msda()
    if carried is None:
        return None, f"{installed}; carried mmcv 2.1.0: {why}"
    try:
        carried(*tiny)
    except Exception as exc:
        return None, f"{installed}; carried mmcv 2.1.0 fails: {type(exc).__name__}: {exc}"[:300]
    return carried, "mmcv 2.1.0 MultiScaleDeformableAttnFunction's CUDA op (carried sources built here)"


def case_msda(quick: bool) -> bool:
    import torch
    from loongkit_ops.kernels.ops import msda

    dev = DEV
    if not triton_used("msda", msda.backend(torch.empty(1, device=dev))):
        return True
    ok = check("msda")

    upstream, why = mmcv_msda()
    if upstream is not None:
        label, suffix = why, "vs_mmcv_cuda"
    else:
        label, suffix = f"torch reference msda.reference (mmcv's CUDA op unusable: {why})", "vs_torch_ref"
    g = torch.Generator(device=dev).manual_seed(0)
    # BEVFormer-tiny spatial cross-attention: 6 cameras x ~1000 queries, 15x25 map, 8 heads x 32, 8 points.
    bs, lq, heads, ch, points = pick((6, 1000, 8, 32, 8), (6, 1000, 8, 32, 8), (1, 2, 1, 4, 2), quick)
    side = pick((15, 25), (15, 25), (2, 3), quick)
    shapes = torch.tensor([side], device=dev)
    starts = torch.tensor([0], device=dev)
    keys = side[0] * side[1]
    value = torch.randn(bs, keys, heads, ch, device=dev, generator=g, requires_grad=True)
    loc = torch.rand(bs, lq, heads, 1, points, 2, device=dev, generator=g, requires_grad=True)
    attn = torch.rand(bs, lq, heads, 1, points, device=dev, generator=g).softmax(-1).requires_grad_()
    grad = torch.randn(bs, lq, heads * ch, device=dev, generator=g)

    def base() -> torch.Tensor:
        out = (upstream(value, shapes, starts, loc, attn) if upstream is not None
               else msda.reference(value, shapes, starts, loc, attn))
        out.backward(grad)
        return out

    def ours() -> torch.Tensor:  # the op LOONGKIT_BEVFORMER installs: Triton on CUDA tensors
        out = msda.multi_scale_deformable_attn(value, shapes, starts, loc, attn)
        out.backward(grad)
        return out

    reps = reps_for(quick)
    tb, to = cuda_timer(base, reps), cuda_timer(ours, reps)
    diff = (base().detach() - ours().detach()).abs().max().item()
    print(f"  msda baseline = {label}; max |difference| of the forward = {diff:.2e}", flush=True)
    bench_line(f"gpu_msda_fwd_bwd_{suffix}", tb, to)
    return ok


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


def case_msda_fused(quick: bool) -> bool:
    import torch
    from loongkit_ops.kernels.ops import msda, msda_fused

    dev = DEV
    if not triton_used("msda_fused", msda_fused.backend(torch.empty(1, device=dev))):
        return True
    ok = check("msda_fused")
    g = torch.Generator(device=dev).manual_seed(0)
    # BEVFormer-tiny temporal self-attention: a 50x50 BEV (2500 queries, one level), [previous, current]
    # queue of 2, 8 heads x 32 channels, 4 points, one reference point per level.
    bs, queue, side, heads, ch, points = pick((1, 2, 50, 8, 32, 4), (1, 2, 50, 8, 32, 4), (1, 2, 2, 1, 4, 2), quick)
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
    reps = reps_for(quick)
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
    print(f"  msda_fused baseline = torch reference msda_fused.reference (no mmcv counterpart); |difference| of "
          f"{'; '.join(diffs)}", flush=True)
    bench_line("gpu_msda_fused_fwd_bwd_vs_torch_ref", tb, to)
    print("  msda_fused vs unfused: the same maths in torch around the plain Triton MSDA op", flush=True)
    bench_line("gpu_msda_fused_fwd_bwd_vs_unfused_triton", ts, to)
    return ok


def case_daf(quick: bool) -> bool:
    import torch
    from loongkit_ops.kernels.ops import daf

    dev = DEV
    if not triton_used("daf", daf.backend(torch.empty(1, device=dev))):
        return True
    ok = check("daf")
    g = torch.Generator(device=dev).manual_seed(0)
    # Sparse4D v3: 6 cameras, 4 levels 64x176..8x22, C=256, 8 groups, 13 points, 900 anchors.
    bs, anchors, pts, cams, ch, groups = pick((1, 900, 13, 6, 256, 8), (1, 300, 13, 6, 256, 8), (1, 2, 2, 1, 4, 2),
                                              quick)
    levels = pick([(64, 176), (32, 88), (16, 44), (8, 22)], [(64, 176), (32, 88), (16, 44), (8, 22)],
                  [(2, 3)], quick)
    shapes = torch.tensor([levels] * cams, device=dev)
    areas = (shapes[..., 0] * shapes[..., 1]).flatten()
    starts = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]]).reshape(cams, len(levels))
    feat = torch.randn(bs, int(areas.sum()), ch, device=dev, generator=g, requires_grad=True)
    loc = torch.rand(bs, anchors, pts, cams, 2, device=dev, generator=g, requires_grad=True)
    w = torch.rand(bs, anchors, pts, cams, len(levels), groups, device=dev, generator=g).requires_grad_()
    grad = torch.randn(bs, anchors, ch, device=dev, generator=g)
    # The baseline is the project's own reference path (inside-only sampling, as ours with True): no
    # registry package ships a CUDA deformable aggregation, and the kit builds nothing from a repository.
    base = fwd_bwd(lambda f, lc, ww: daf.reference(f, shapes, starts, lc, ww, True), [feat, loc, w], grad)
    ours = fwd_bwd(lambda f, lc, ww: daf.deformable_aggregation(f, shapes, starts, lc, ww, True), [feat, loc, w],
                   grad)
    reps = reps_for(quick)
    tb, to = cuda_timer(base, reps), cuda_timer(ours, reps)
    print(f"  daf baseline = {DAF_BASELINE}; max |difference| of the forward = {max_difference(base, ours):.2e}",
          flush=True)
    bench_line("gpu_daf_fwd_bwd_vs_torch_ref", tb, to)
    return ok


DAF_BASELINE = "torch reference daf.reference (loongkit-ops' gather path; no registry package has this op)"


def case_bev_pool(quick: bool) -> bool:
    import torch
    from loongkit_ops.kernels.ops import bev_pool

    dev = DEV
    if not triton_used("bev_pool", bev_pool.backend(torch.empty(1, device=dev))):
        return True
    ok = check("bev_pool")
    g = torch.Generator(device=dev).manual_seed(0)
    # BEVFusion camera branch: ~2M frustum points x 80 channels pooled into a 360x360 BEV grid.
    n, ch, b, z, x, y = pick((2_000_000, 80, 1, 1, 360, 360), (200_000, 80, 1, 1, 360, 360), (20, 3, 1, 1, 2, 3),
                             quick)
    feats = torch.randn(n, ch, device=dev, generator=g, requires_grad=True)
    coords = torch.stack([torch.randint(0, d, (n,), device=dev, generator=g) for d in (x, y, z, b)], 1)
    grad = torch.randn(b, ch, z, x, y, device=dev, generator=g)
    base = fwd_bwd(lambda f: bev_pool.reference(f, coords, b, z, x, y), [feats], grad)
    ours = fwd_bwd(lambda f: bev_pool.op(f, coords, b, z, x, y), [feats], grad)
    reps = reps_for(quick)
    tb, to = cuda_timer(base, reps), cuda_timer(ours, reps)
    print(f"  bev_pool baseline = torch reference bev_pool.reference (index_add); max |difference| of the "
          f"forward = {max_difference(base, ours):.2e}", flush=True)
    bench_line("gpu_bev_pool_fwd_bwd_vs_torch_ref", tb, to)
    return ok


def case_voxelize(quick: bool) -> bool:
    import torch
    from loongkit_ops.kernels.ops import voxelize

    dev = DEV
    if not triton_used("voxelize", voxelize.backend(torch.empty(1, device=dev))):
        return True
    ok = check("voxelize")
    g = torch.Generator(device=dev).manual_seed(0)
    # nuScenes CenterPoint: ~300k points x 5 (x, y, z, intensity, time), 0.075 m voxels, 10 points each.
    n = pick(300_000, 30_000, 50, quick)
    size, rng, max_points, max_voxels = [0.075, 0.075, 0.2], [-54.0, -54.0, -5.0, 54.0, 54.0, 3.0], 10, 90_000
    points = torch.randn(n, 5, device=dev, generator=g) * torch.tensor([20.0, 20.0, 1.5, 1.0, 1.0], device=dev)
    upstream, dyn_upstream, label, suffix = mmcv_voxelize(points)
    if upstream is None:
        label, suffix = f"torch reference voxelize.hard_reference ({label})", "vs_torch_ref"
        upstream, dyn_upstream = voxelize.hard_reference, voxelize.dynamic_reference
        dyn_label = "the reference"
    else:
        dyn_label = "mmcv's dynamic_voxelize"

    reps = reps_for(quick, 30)
    tb = cuda_timer(lambda: upstream(points, size, rng, max_points, max_voxels), reps)
    to = cuda_timer(lambda: voxelize.hard_op(points, size, rng, max_points, max_voxels), reps)
    theirs = upstream(points, size, rng, max_points, max_voxels)
    mine = voxelize.hard_op(points, size, rng, max_points, max_voxels)
    same = all(a.shape == b.shape and torch.equal(a.to(b.dtype), b) for a, b in zip(mine, theirs, strict=True))
    dyn_same = torch.equal(voxelize.dynamic_op(points, size, rng), dyn_upstream(points, size, rng).to(torch.int32))
    print(f"  voxelize baseline = {label}; {mine[0].shape[0]} voxels; identical output: {same}; dynamic "
          f"identical to {dyn_label}: {dyn_same}", flush=True)
    bench_line(f"gpu_hard_voxelize_{suffix}", tb, to)
    return ok


def mmcv_voxelize(points: Any) -> tuple[Callable[..., Any] | None, Callable[..., Any] | None, str, str]:
    """(hard(points, size, range, max_points, max_voxels), dynamic(points, size, range), label, suffix) on
    mmcv's CUDA ops: an installed mmcv's when they run, else the carried build's (deterministic hard
    voxelization); (None, None, why, '') when neither runs."""
    if DEV.type != "cuda":
        return None, None, "not on a CUDA device", ""
    size, rng = [0.5, 0.5, 0.5], [-2.0, -2.0, -1.0, 2.0, 2.0, 1.0]
    try:  # mmcv may import yet lack its CUDA ops: try one small call
        from mmcv.ops.voxelize import voxelization as mmcv_voxelization

        mmcv_voxelization(points[:16], size, rng, 3, 8, True)
        return (lambda *a: tuple(mmcv_voxelization(*a, True)),  # deterministic mode
                lambda p, vs, cr: mmcv_voxelization(p, vs, cr, -1),
                "mmcv hard_voxelize (installed mmcv's CUDA op, deterministic)", "vs_mmcv_cuda")
    except Exception as exc:
        installed = f"installed mmcv unusable: {type(exc).__name__}: {exc}"[:160]
    import build_baselines

    carried, why = build_baselines.mmcv_voxelize()
    if carried is None:
        return None, None, f"{installed}; carried mmcv 2.1.0: {why}", ""
    try:
        carried[0](points[:16], size, rng, 3, 8)
    except Exception as exc:
        return None, None, f"{installed}; carried mmcv 2.1.0 fails: {type(exc).__name__}: {exc}"[:300], ""
    return (carried[0], carried[1], "mmcv 2.1.0 hard_voxelize's CUDA op (deterministic; carried sources built here)",
            "vs_mmcv_cuda")


def case_dice(quick: bool) -> bool:
    import torch
    from loongkit_ops.kernels.ops import dice_class_stats, dice_stats

    dev = DEV
    if not triton_used("dice", dice_stats.backend(torch.empty(1, device=dev))):
        return True
    ok = check("dice")
    g = torch.Generator(device=dev).manual_seed(0)
    # Cityscapes-like batch: [4, 19, 256, 512] logits, labels with 255 ignored pixels.
    n, c, h, w = pick((4, 19, 256, 512), (2, 19, 128, 256), (1, 3, 2, 4), quick)
    logits = torch.randn(n, c, h * w, device=dev, generator=g, requires_grad=True)
    target = torch.randint(0, c, (n, h * w), device=dev, generator=g)
    target[:, ::13] = 255
    reps = reps_for(quick)
    for name, ref, op, shape in (
            ("dice_stats", lambda x: dice_stats.reference(x, target, 2, 255, False),
             lambda x: dice_stats.op(x, target, 2, 255, False), (n, 3)),
            ("dice_class_stats", lambda x: dice_class_stats.reference(x, target, 255, 2.0),
             lambda x: dice_class_stats.op(x, target, 255, 2.0), (n, c, 3))):
        grad = torch.randn(shape, device=dev, generator=g)
        base, ours = fwd_bwd(ref, [logits], grad), fwd_bwd(op, [logits], grad)
        tb, to = cuda_timer(base, reps), cuda_timer(ours, reps)
        scale = base().detach().abs().max().item()
        print(f"  {name} baseline = torch reference {name}.reference; max |difference| of the forward = "
              f"{max_difference(base, ours):.2e} (largest value {scale:.2e})", flush=True)
        bench_line(f"gpu_{name}_fwd_bwd_vs_torch_ref", tb, to)
    return ok


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


KERNEL_FUNCS: dict[str, Callable[[bool], bool]] = {
    "msda": case_msda, "msda_fused": case_msda_fused, "daf": case_daf, "bev_pool": case_bev_pool,
    "voxelize": case_voxelize, "dice": case_dice,
}


def run_case(case: str, quick: bool) -> int:
    """One case in this process: 1 when a kernel's CHECK failed, else 0."""
    if case in KERNEL_FUNCS:
        return 0 if KERNEL_FUNCS[case](quick) else 1
    if case == "tf32":
        case_tf32(quick)
    elif case == "compile":
        case_compile(quick)
    else:
        raise SystemExit(f"unknown case {case}")
    return 0


def dry_run(chosen: list[str], break_refs: bool) -> int:
    """Every chosen kernel case in this process on the CPU under Triton's interpreter; 1 if any failed."""
    import traceback

    configure(True)
    if break_refs:
        from checks import break_references

        break_references()
    kernels = [c for c in chosen if c in KERNEL_CASES]
    for case in chosen:
        if case not in KERNEL_CASES:
            print(f"SKIP gpu_{case}: needs a CUDA device (dry run)", flush=True)
    failed = []
    start = time.perf_counter()
    for case in kernels:
        try:
            if run_case(case, True):
                failed.append(case)
        except Exception:  # a crash in one case must not hide the others
            print(f"ERROR {case}:\n{traceback.format_exc()}", flush=True)
            failed.append(case)
    print(f"GPU kit dry run: {len(kernels) - len(failed)}/{len(kernels)} kernel cases ok"
          f"{' (failed: ' + ', '.join(failed) + ')' if failed else ''} in {time.perf_counter() - start:.1f} s "
          "(Triton interpreter on the CPU; timings mean nothing)", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer repetitions")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per case at most")
    parser.add_argument("--budget", type=float, help="seconds for the whole run (default: 330 with --quick)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, Triton interpreter, tiny shapes: the kit's own test (no GPU needed)")
    parser.add_argument("--self-test-break", action="store_true",
                        help="replace every reference with a wrong one: every CHECK must then FAIL")
    built = parser.add_mutually_exclusive_group()
    built.add_argument("--build-baselines", action="store_true",
                       help="build the carried upstream baselines (the default when benchmarks/gpu/carry exists) and "
                            "fail the run if one is not available")
    built.add_argument("--no-build-baselines", action="store_true", help="do not build them (torch references)")
    parser.add_argument("--build-time", type=float, default=150.0, help="seconds the baselines' build may take")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child process for one case
    args = parser.parse_args(argv)

    sys.path.insert(0, str(HERE))  # checks.py, in the children too
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(CASES))
    if unknown:
        sys.stderr.write(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}\n")
        return 2
    if args.dry_run:
        # Must be set before triton is first imported (the ops import it lazily, at first dispatch).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ["TRITON_INTERPRET"] != "1":
            sys.stderr.write("--dry-run runs Triton's interpreter: TRITON_INTERPRET must be 1\n")
            return 2
        return dry_run(chosen, args.self_test_break)

    import torch

    if not torch.cuda.is_available():
        sys.stderr.write("benchmarks/gpu/run_all.py needs a CUDA device: torch.cuda.is_available() is False "
                         f"(torch {torch.__version__}, CUDA build {torch.version.cuda}). Run it on a GPU machine "
                         "(or --dry-run here); the CPU benchmarks are `loongkit bench`.\n")
        return 2
    if args.case:
        configure(False)
        if args.self_test_break:
            from checks import break_references

            break_references()
        return run_case(args.case, args.quick)

    from loongkit_core.bench import render_table, run_script

    print(f"GPU: {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})", flush=True)
    budget = args.budget if args.budget is not None else (330.0 if args.quick else float("inf"))
    deadline = time.perf_counter() + budget
    baselines = prepare_baselines(args, deadline)
    flags = [*(["--quick"] if args.quick else []), *(["--self-test-break"] if args.self_test_break else [])]
    runs = []
    for case in chosen:
        left = deadline - time.perf_counter()
        if left < 5:
            print(f"SKIP gpu_{case}: the run's budget of {budget:g} s is spent", flush=True)
            continue
        timeout = min(args.timeout, left)
        if case == "prefetch":
            run = run_script(case, HERE / "data_prefetch.py", flags[:1] if args.quick else [], sys.executable,
                             timeout, echo=True)
        else:
            run = run_script(case, Path(__file__).resolve(), [*flags, "--case", case], sys.executable, timeout,
                             echo=True)
        if run.returncode:
            print(f"FAILED gpu_{case}: exit {run.returncode}\n{run.error_tail}", flush=True)
        runs.append(run)
    print(render_table(runs), end="")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "baselines": baselines, "runs": [asdict(r) for r in runs]}, indent=2))
    missing = [name for name, b in baselines.items() if not b["ok"]]
    if args.build_baselines and missing:
        print(f"FAILED baselines: {', '.join(missing)} not available (--build-baselines)", flush=True)
    return 1 if any(r.returncode for r in runs) or len(runs) < len(chosen) or (args.build_baselines and missing) else 0


# The cases keep at least this much of the budget whatever the build would like.
CASES_RESERVE_S = 120.0


def prepare_baselines(args: argparse.Namespace, deadline: float) -> dict[str, dict[str, Any]]:
    """Build the carried upstream baselines before the cases (the build's time counts in the budget).

    {baseline: {'ok', 'reason', 'seconds', ...}}; never raises: a failure only leaves the torch
    references in place, and each case prints why.
    """
    import build_baselines

    def none(reason: str) -> dict[str, dict[str, Any]]:
        print(f"baselines: {reason}; the cases use installed mmcv ops if any, else the torch references", flush=True)
        return {b.name: {"ok": False, "reason": reason, "seconds": 0.0} for b in build_baselines.BASELINES}

    if args.no_build_baselines:
        return none("not built (--no-build-baselines)")
    why = build_baselines.verify_carry(build_baselines.CARRY)
    if why:
        return none(why)
    left = deadline - time.perf_counter()
    limit = min(args.build_time, left - CASES_RESERVE_S)
    if limit < 10:
        return none(f"not built: {left:.0f} s of the budget left (the cases keep {CASES_RESERVE_S:.0f} s), "
                    f"--build-time {args.build_time:g} s")
    start = time.perf_counter()
    try:
        outcomes = build_baselines.build(time_limit=limit, log=lambda line: print(line, flush=True))
    except Exception as exc:  # build() catches its own faults; this is the last guard of the kit
        return none(f"the build raised {type(exc).__name__}: {exc}"[:300])
    print(f"baselines build: {time.perf_counter() - start:.1f} s of the run's budget", flush=True)
    return {name: asdict(out) for name, out in outcomes.items()}


if __name__ == "__main__":
    raise SystemExit(main())
