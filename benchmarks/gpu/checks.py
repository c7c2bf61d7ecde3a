"""Correctness of every Triton kernel of loongkit-ops against its fp64 torch reference (used by run_all.py).

For each kernel and each dtype in fp32, fp16 and bf16: inputs are drawn in fp64 and rounded to the
dtype; the op runs on the rounded inputs (forward, then backward through autograd with a fixed
upstream gradient rounded the same way) and the module's ``reference`` runs in fp64 on the very same
rounded values. The error of the output and of every input gradient is the relative L2 difference
||ours - ref|| / ||ref||, which a rare sample on a pixel border (where the bilinear gradient jumps)
cannot blow up the way a max-norm would; each must be within the dtype's tolerance.

One line per kernel: ``CHECK <kernel> ok|FAIL fp32 fwd=<e> bwd=<e per differentiable input>; fp16 ...; bf16 ...``.
Voxelization is integer arithmetic, not differentiable: it must equal its reference bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Relative L2 bounds: the kernels accumulate in fp32 whatever the storage dtype, so the error is about
# the output's own rounding (fp16 ~5e-4, bf16 ~4e-3) plus the inputs' accumulated rounding; a wrong
# kernel (a missed sample, a wrong weight) is off by 1e-1 or more.
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def rel_l2(ours: Tensor, ref: Tensor) -> float:
    """||ours - ref|| / ||ref|| in fp64 (0 for two empty or two zero tensors, inf when ours is not finite)."""
    a, b = ours.detach().double(), ref.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    num, den = (a - b).norm().item(), b.norm().item()
    return num / den if den > 0 else num


def compare(name: str, op: Callable[..., Tensor], ref: Callable[[], Callable[..., Tensor]],
            inputs: Sequence[Tensor], seed: int) -> bool:
    """Check op(*inputs) and its input gradients in every dtype against ref()(*inputs) in fp64; print the line.

    ``ref`` is looked up per call (a module attribute) so a replaced reference is what gets compared.
    """
    parts, ok = [], True
    for dtype in DTYPES:
        rounded = [t.to(dtype) for t in inputs]
        xs = [t.clone().requires_grad_() for t in rounded]
        out = op(*xs)
        gen = torch.Generator(device=out.device).manual_seed(seed)
        grad = torch.randn(out.shape, device=out.device, dtype=torch.float64, generator=gen).to(dtype)
        out.backward(grad)
        xr = [t.double().requires_grad_() for t in rounded]
        expected = ref()(*xr)
        expected.backward(grad.double())
        fwd = rel_l2(out, expected)
        bwd = [rel_l2(x.grad, r.grad) if x.grad is not None else float("inf") for x, r in zip(xs, xr, strict=True)]
        good = out.dtype == dtype and fwd <= TOL[dtype] and max(bwd) <= TOL[dtype]
        ok &= good
        grads = ",".join(f"{e:.1e}" for e in bwd)
        parts.append(f"{short(dtype)} fwd={fwd:.1e} bwd={grads}{'' if good else ' (over ' + str(TOL[dtype]) + ')'}")
    print(f"CHECK {name} {'ok' if ok else 'FAIL'} {'; '.join(parts)} (relative L2 vs fp64 reference)", flush=True)
    return ok


def inside_cells(shape: tuple[int, ...], sizes: Tensor, dev: torch.device, g: torch.Generator) -> Tensor:
    """Locations [*shape, 2] (x, y in [-0.1, 1.1]) whose pixel coordinate u*S - 0.5 lies in (0.3, 0.45) of
    a cell on the coarsest map and so, the maps being 2x apart, in (0.1, 0.4) of one on the finer ones,
    bf16 rounding included: on a pixel border the gradient jumps, and bf16's coarse grid would put
    samples on borders often. ``sizes`` [2]: (W, H) of the coarsest map."""
    frac = 0.3 + 0.15 * torch.rand(*shape, 2, device=dev, dtype=torch.float64, generator=g)
    lo = -1 if int(sizes.min()) > 2 else 0
    cell = torch.randint(lo, int(sizes.min()) + 1, (*shape, 2), device=dev, generator=g)
    loc = (cell + frac + 0.5) / sizes.to(dev, torch.float64)
    return loc.to(torch.bfloat16).double()  # exactly representable in every checked dtype


def check_msda(dev: torch.device, small: bool, seed: int) -> bool:
    from loongkit_ops.kernels.ops import msda

    g = torch.Generator(device=dev).manual_seed(seed)
    # Two levels (a level offset in the index), some locations beyond the map (the zero padding).
    bs, lq, heads, ch, points = (1, 2, 1, 4, 2) if small else (2, 20, 2, 32, 3)
    w, h = (3, 2) if small else (8, 6)
    shapes = torch.tensor([[2 * h, 2 * w], [h, w]], device=dev)
    starts = torch.cat([shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])
    keys = int((shapes[:, 0] * shapes[:, 1]).sum())
    f64 = torch.float64
    value = torch.randn(bs, keys, heads, ch, device=dev, dtype=f64, generator=g)
    loc = inside_cells((bs, lq, heads, 2, points), torch.tensor([w, h]), dev, g)
    attn = torch.rand(bs, lq, heads, 2, points, device=dev, dtype=f64, generator=g)
    return compare("msda", lambda v, lc, a: msda.op(v, shapes, starts, lc, a),
                   lambda: lambda v, lc, a: msda.reference(v, shapes, starts, lc, a), [value, loc, attn], seed)


def check_msda_fused(dev: torch.device, small: bool, seed: int) -> bool:
    from loongkit_ops.kernels.ops import msda_fused

    g = torch.Generator(device=dev).manual_seed(seed)
    # The kernel computes the locations (reference point + offset / size): reference points inside cells
    # and offsets of whole pixels keep them off the borders too.
    nq, queue, side, heads, ch, points = (1, 2, 2, 1, 4, 2) if small else (1, 2, 16, 2, 32, 4)
    q = side * side
    shapes = torch.tensor([[side, side]], device=dev)
    starts = torch.tensor([0], device=dev)
    f64 = torch.float64
    value = torch.randn(nq * queue, q, heads, ch, device=dev, dtype=f64, generator=g)
    ref_points = inside_cells((nq * queue, q, 1), torch.tensor([side, side]), dev, g)
    n = heads * queue * points
    proj = torch.randn(nq, q, 3 * n, device=dev, dtype=f64, generator=g)
    proj[..., :2 * n] = torch.randint(-2, 3, (nq, q, 2 * n), device=dev, generator=g).to(f64)
    return compare("msda_fused",
                   lambda v, p: msda_fused.op(v, shapes, starts, ref_points.to(v.dtype), p, True, queue),
                   lambda: lambda v, p: msda_fused.reference(v, shapes, starts, ref_points.to(v.dtype).double(), p,
                                                             True, queue),
                   [value, proj], seed)


def check_daf(dev: torch.device, small: bool, seed: int) -> bool:
    from loongkit_ops.kernels.ops import daf

    g = torch.Generator(device=dev).manual_seed(seed)
    bs, anchors, pts, cams, ch, groups = (1, 2, 2, 2, 4, 2) if small else (1, 16, 3, 2, 32, 4)
    w, h = (3, 2) if small else (8, 6)
    levels = [(2 * h, 2 * w), (h, w)]
    shapes = torch.tensor([levels] * cams, device=dev)
    areas = (shapes[..., 0] * shapes[..., 1]).flatten()
    starts = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]]).reshape(cams, len(levels))
    f64 = torch.float64
    feat = torch.randn(bs, int(areas.sum()), ch, device=dev, dtype=f64, generator=g)
    loc = inside_cells((bs, anchors, pts, cams), torch.tensor([w, h]), dev, g)
    wts = torch.rand(bs, anchors, pts, cams, len(levels), groups, device=dev, dtype=f64, generator=g)
    return compare("daf", lambda f, lc, ww: daf.op(f, shapes, starts, lc, ww, True),
                   lambda: lambda f, lc, ww: daf.reference(f, shapes, starts, lc, ww, True), [feat, loc, wts], seed)


def check_bev_pool(dev: torch.device, small: bool, seed: int) -> bool:
    from loongkit_ops.kernels.ops import bev_pool

    g = torch.Generator(device=dev).manual_seed(seed)
    n, ch, b, z, x, y = (30, 3, 2, 1, 2, 3) if small else (5000, 70, 2, 2, 12, 16)
    feats = torch.randn(n, ch, device=dev, dtype=torch.float64, generator=g)
    # One beyond each side of the grid too (dropped), and several points per voxel.
    coords = torch.stack([torch.randint(-1, d + 1, (n,), device=dev, generator=g) for d in (x, y, z, b)], 1)
    coords = coords.to(torch.int32)
    return compare("bev_pool", lambda f: bev_pool.op(f, coords, b, z, x, y),
                   lambda: lambda f: bev_pool.reference(f, coords, b, z, x, y), [feats], seed)


def check_dice(dev: torch.device, small: bool, seed: int) -> bool:
    from loongkit_ops.kernels.ops import dice_class_stats, dice_stats

    g = torch.Generator(device=dev).manual_seed(seed)
    n, c, s = (2, 3, 20) if small else (2, 19, 5000)
    logits = torch.randn(n, c, s, device=dev, dtype=torch.float64, generator=g)
    target = torch.randint(0, c, (n, s), device=dev, generator=g)
    target[:, ::7] = 255
    ok = compare("dice_stats", lambda x: dice_stats.op(x, target, 2, 255, False),
                 lambda: lambda x: dice_stats.reference(x, target, 2, 255, False), [logits], seed)
    return compare("dice_class_stats", lambda x: dice_class_stats.op(x, target, 255, 2.0),
                   lambda: lambda x: dice_class_stats.reference(x, target, 255, 2.0), [logits], seed) and ok


def check_voxelize(dev: torch.device, small: bool, seed: int) -> bool:
    from loongkit_ops.kernels.ops import voxelize

    g = torch.Generator(device=dev).manual_seed(seed)
    # Fewer voxels allowed than there are, and crowded voxels: both kinds of drop are exercised.
    n, max_voxels = (100, 20) if small else (20_000, 100)
    size, rng, max_points = [0.5, 0.5, 0.5], [-2.0, -2.0, -1.0, 2.0, 2.0, 1.0], 3
    points = torch.randn(n, 4, device=dev, dtype=torch.float64, generator=g) * 1.5
    parts, ok = [], True
    # The grid arithmetic is fp32 for all three (mmcv's rule for non-fp64 points): identical by design.
    for dtype in DTYPES:
        p = points.to(dtype)
        mine, theirs = voxelize.hard_op(p, size, rng, max_points, max_voxels), voxelize.hard_reference(
            p, size, rng, max_points, max_voxels)
        hard = all(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
                   for a, b in zip(mine, theirs, strict=True))
        dyn = torch.equal(voxelize.dynamic_op(p, size, rng), voxelize.dynamic_reference(p, size, rng))
        ok &= hard and dyn
        parts.append(f"{short(dtype)} hard identical={hard} ({mine[0].shape[0]} voxels) dynamic identical={dyn}")
    print(f"CHECK voxelize {'ok' if ok else 'FAIL'} {'; '.join(parts)} (bit for bit vs the reference; "
          "no backward: not differentiable)", flush=True)
    return ok


CHECKS: dict[str, Callable[[torch.device, bool, int], bool]] = {
    "msda": check_msda, "msda_fused": check_msda_fused, "daf": check_daf, "bev_pool": check_bev_pool,
    "voxelize": check_voxelize, "dice": check_dice,
}


def break_references() -> None:
    """--self-test-break: every reference returns a wrong answer, so every CHECK line must say FAIL."""
    from loongkit_ops.kernels.ops import bev_pool, daf, dice_class_stats, dice_stats, msda, msda_fused, voxelize

    def scaled(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        return lambda *a, **k: fn(*a, **k) * 1.25

    for mod in (msda, msda_fused, daf, bev_pool, dice_stats, dice_class_stats):
        mod.reference = scaled(mod.reference)  # type: ignore[attr-defined]
    hard, dyn = voxelize.hard_reference, voxelize.dynamic_reference

    def hard_broken(*a: Any) -> tuple[Tensor, Tensor, Tensor]:
        voxels, coors, num = hard(*a)
        return voxels, coors + 1, num

    voxelize.hard_reference = hard_broken  # type: ignore[assignment]
    voxelize.dynamic_reference = lambda *a: dyn(*a) + 1  # type: ignore[assignment]
