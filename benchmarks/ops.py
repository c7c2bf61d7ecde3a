"""loongkit-ops kernel library vs upstream, forward+backward on CPU, same process and inputs.

- MSDA: ``loongkit::ms_deform_attn`` vs mmcv's ``multi_scale_deformable_attn_pytorch`` (what mmcv's
  MultiScaleDeformableAttention runs on CPU) at BEVFormer-tiny shapes: TSA (50x50 BEV, 2 frames,
  8 heads x 32, 1 level, 4 points) and SCA (6 cameras, 15x25 map, ~1000 visible queries per camera,
  8 points); full mode adds BEVFormer-base TSA (200x200 BEV).
- Dice: mmseg 1.x ``DiceLoss`` (softmax and sigmoid) unpatched vs with LOONGKIT_DICE_LOSS_MMSEG1's
  patch, on [4, 19, 256, 512] logits with 255-labelled pixels.
- DAF: ``loongkit::deformable_aggregation`` (including the flattening of the feature maps that
  LOONGKIT_DAG does per call) vs DeformableFeatureAggregation's grid_sample path (one grid_sample
  per level, stacked, weighted per group, summed over cameras, levels and points) at Sparse4D v3
  shapes: 6 cameras, levels 64x176..8x22, 256 channels, 8 groups, 13 points, 900 anchors.
- Dice (mmseg 0.x, in the stack1 venv): ``DiceLoss`` unpatched vs with LOONGKIT_DICE_LOSS's patch.
- voxel: mmcv's CPU ``hard_voxelize`` (deterministic) vs ``loongkit::hard_voxelize`` (what
  LOONGKIT_VOXELIZATION routes it to), nuScenes CenterPoint grid (voxel 0.075 x 0.075 x 0.2 m,
  range +-54 m, z -5..3 m, 10 points per voxel, 90k voxels) on a synthetic 32-beam multi-sweep
  cloud of 300k points x 5 (--quick: 120k); outputs are checked identical before timing.
- bev_pool: ``loongkit::bev_pool`` vs BEVFusion's CPU-side formulations: the sort + cumsum trick
  (LSS's QuickCumsum, then a scatter into the grid) and a plain ``index_add``; ~2M camera points x
  80 channels into a 360x360 BEV grid (--quick: 500k points).

Needs mmcv and mmseg (the stack2 venv) for MSDA and Dice; DAF and bev_pool run anywhere. Prints
``BENCH <name> baseline=<s> ours=<s> ratio=<b/o>`` (median seconds per forward+backward; runs
alternate so both see the same machine state).

    python benchmarks/ops.py --quick     # < 1 minute
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch
from _timing import bench_line, median_time


def compare(name: str, base: Callable[[], Any], ours: Callable[[], Any], reps: int, rounds: int = 3) -> None:
    base()
    ours()  # warm-up (first-call allocation, kernel load)
    b, o = [], []
    for _ in range(rounds):
        b.append(median_time(base, reps))
        o.append(median_time(ours, reps))
    tb, to = min(b), min(o)
    bench_line(name, tb, to)


def msda_case(bs: int, queries: int, heads: int, channels: int, levels: list[tuple[int, int]], points: int) -> tuple:
    gen = torch.Generator().manual_seed(0)
    shapes = torch.tensor(levels)
    areas = shapes[:, 0] * shapes[:, 1]
    starts = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
    value = torch.randn(bs, int(areas.sum()), heads, channels, generator=gen).requires_grad_()
    loc = torch.rand(bs, queries, heads, len(levels), points, 2, generator=gen).requires_grad_()
    attn = torch.rand(bs, queries, heads, len(levels), points, generator=gen).softmax(-1).requires_grad_()
    grad = torch.randn(bs, queries, heads * channels, generator=gen)
    return value, shapes, starts, loc, attn, grad


def bench_msda(quick: bool, reps: int) -> None:
    from loongkit_ops.kernels.ops import msda
    from mmcv.ops.multi_scale_deform_attn import multi_scale_deformable_attn_pytorch

    cases = {
        "msda_bevformer_tiny_tsa": (2, 2500, 8, 32, [(50, 50)], 4),
        "msda_bevformer_tiny_sca": (6, 1000, 8, 32, [(15, 25)], 8),
    }
    if not quick:
        cases["msda_bevformer_base_tsa"] = (2, 40000, 8, 32, [(200, 200)], 4)
        cases["msda_bevformer_base_sca"] = (6, 10000, 8, 32, [(116, 200), (58, 100), (29, 50), (15, 25)], 8)
    for name, shape in cases.items():
        value, shapes, starts, loc, attn, grad = msda_case(*shape)

        def base(args: tuple = (value, shapes, loc, attn), grad: torch.Tensor = grad) -> None:
            multi_scale_deformable_attn_pytorch(*args).backward(grad)

        def ours(args: tuple = (value, shapes, starts, loc, attn), grad: torch.Tensor = grad) -> None:
            msda.op(*args).backward(grad)

        # The base shapes take seconds per baseline iteration here: fewer repetitions.
        compare(name, base, ours, reps if "tiny" in name else 1, rounds=3 if "tiny" in name else 2)


def bench_dice(quick: bool, reps: int) -> None:
    import mmseg

    if mmseg.__version__.startswith("0."):
        bench_dice0(quick, reps)
        return
    import mmseg.models.losses.dice_loss as dice_mod
    from loongkit_ops.patches.dice import DiceLossMmseg1
    from loongkit_ops.plugin import plugin

    from loongkit_core.context import ActivationContext

    feature = next(f for f in plugin.loongkit_declare_features() if f.name == "dice_loss_mmseg1")
    ctx = ActivationContext.standalone(feature, logger="bench")
    impl = DiceLossMmseg1(feature)
    gen = torch.Generator().manual_seed(0)
    shape = (4, 19, 256, 512)
    pred = torch.randn(*shape, generator=gen).requires_grad_()
    target = torch.randint(0, 19, (shape[0], *shape[2:]), generator=gen)
    target[:, :20] = 255
    for name, config in (("dice_softmax_4x19x256x512", {"use_sigmoid": False}),
                         ("dice_sigmoid_4x19x256x512", {"use_sigmoid": True})):
        loss = dice_mod.DiceLoss(**config)
        original = dice_mod.DiceLoss.forward

        def base(loss: Any = loss, original: Any = original) -> None:
            original(loss, pred, target).backward()

        impl.activate(ctx, "mmseg.models.losses.dice_loss")
        patched = dice_mod.DiceLoss.forward
        impl.deactivate(ctx)

        def ours(loss: Any = loss, patched: Any = patched) -> None:
            patched(loss, pred, target).backward()

        compare(name, base, ours, max(1, reps // 2))


def bench_dice0(quick: bool, reps: int) -> None:
    """mmseg 0.x DiceLoss (the stack1 venv) unpatched vs with LOONGKIT_DICE_LOSS's patch."""
    import mmseg.models.losses.dice_loss as dice_mod
    from loongkit_ops.patches.dice import DiceLossMmseg0
    from loongkit_ops.plugin import plugin

    from loongkit_core.context import ActivationContext

    feature = next(f for f in plugin.loongkit_declare_features() if f.name == "dice_loss")
    ctx = ActivationContext.standalone(feature, logger="bench")
    impl = DiceLossMmseg0(feature)
    gen = torch.Generator().manual_seed(0)
    shape = (4, 19, 256, 512)
    pred = torch.randn(*shape, generator=gen).requires_grad_()
    target = torch.randint(0, 19, (shape[0], *shape[2:]), generator=gen)
    target[:, :20] = 255
    loss = dice_mod.DiceLoss()
    original = dice_mod.DiceLoss.forward
    impl.activate(ctx, "mmseg.models.losses.dice_loss")
    patched = dice_mod.DiceLoss.forward
    impl.deactivate(ctx)

    def base() -> None:
        original(loss, pred, target).backward()

    def ours() -> None:
        patched(loss, pred, target).backward()

    compare("dice_mmseg0_4x19x256x512", base, ours, max(1, reps // 2))


def lidar_cloud(n: int, gen: torch.Generator) -> torch.Tensor:
    """A nuScenes-like multi-sweep cloud [n, 5] (x, y, z, intensity, time lag) in scan order: 32 beams
    from -30 to +10 degrees, ground returns 1.8 m below the sensor, dense near the car."""
    beams = torch.linspace(-0.52, 0.17, 32)
    per_beam = n // 32
    az = torch.rand(32, per_beam, generator=gen).sort(1).values * 6.2832 - 3.1416
    elev = beams[:, None].expand(32, per_beam)
    obstacle = 1.0 + torch.empty(32, per_beam).exponential_(1 / 14.0, generator=gen)
    ground = torch.where(elev < 0, 1.8 / (-elev).tan().clamp(min=1e-3), torch.full_like(elev, 1e9))
    r = torch.minimum(obstacle, ground).clamp(max=80.0)
    pts = torch.stack([r * az.cos(), r * az.sin(), (r * elev.tan()).clamp(min=-1.8),
                       torch.rand(32, per_beam, generator=gen) * 255, (torch.arange(per_beam) % 10 * 0.05).expand(
                           32, per_beam)], -1).reshape(-1, 5)
    pts[:, :3] += torch.randn(pts.shape[0], 3, generator=gen) * 0.02
    return pts.contiguous()


def bench_voxel(quick: bool, reps: int) -> None:
    """mmcv's CPU hard_voxelize (deterministic) vs loongkit::hard_voxelize, nuScenes CenterPoint grid."""
    try:
        from mmcv.ops.voxelize import voxelization
    except (ImportError, OSError) as exc:  # mmcv without compiled ops
        print(f"# voxel: skipped, mmcv.ops unavailable ({type(exc).__name__})", flush=True)
        return
    from loongkit_ops.kernels.ops import voxelize

    gen = torch.Generator().manual_seed(0)
    n = 120_000 if quick else 300_000
    pts = lidar_cloud(n, gen)
    size, rng = [0.075, 0.075, 0.2], [-54.0, -54.0, -5.0, 54.0, 54.0, 3.0]
    expected = voxelization(pts, size, rng, 10, 90000, True)
    got = voxelize.hard_op(pts, size, rng, 10, 90000)
    for e, g in zip(expected, got, strict=True):  # identical output, or no number at all
        assert e.dtype == g.dtype and torch.equal(e, g), "loongkit::hard_voxelize differs from mmcv"
    print(f"# voxel: {n} points -> {got[0].shape[0]} voxels (cap 90000), identical output", flush=True)
    compare(f"voxelize_centerpoint_{n // 1000}k", lambda: voxelization(pts, size, rng, 10, 90000, True),
            lambda: voxelize.hard_op(pts, size, rng, 10, 90000), reps)


def daf_grid_sample(feature_maps: list[torch.Tensor], points: torch.Tensor, weights: torch.Tensor,
                    groups: int) -> torch.Tensor:
    """DeformableFeatureAggregation without the CUDA op: points [bs, cams, anchors, pts, 2] in [0, 1],
    weights [bs, anchors, cams, levels, pts, groups] -> [bs, anchors, C]."""
    bs, cams, anchors, pts, _ = points.shape
    c = feature_maps[0].shape[2]
    grid = (points * 2 - 1).flatten(end_dim=1)
    sampled = torch.stack([torch.nn.functional.grid_sample(fm.flatten(end_dim=1), grid, align_corners=False)
                           for fm in feature_maps], dim=1)  # [bs*cams, levels, C, anchors, pts]
    sampled = sampled.reshape(bs, cams, len(feature_maps), c, anchors, pts).permute(0, 4, 1, 2, 5, 3)
    fused = weights[..., None] * sampled.reshape(*sampled.shape[:-1], groups, c // groups)
    return fused.sum(dim=(2, 3)).reshape(bs, anchors, pts, c).sum(2)


def bench_daf(quick: bool, reps: int) -> None:
    from loongkit_ops.kernels.ops import daf

    gen = torch.Generator().manual_seed(0)
    bs, cams, anchors, pts, c, groups = 1, 6, 900, 13, 256, 8
    levels = [(64, 176), (32, 88), (16, 44), (8, 22)]
    maps = [torch.randn(bs, cams, c, h, w, generator=gen).requires_grad_() for h, w in levels]
    # Most key points land in one or two of the six cameras, the rest outside: like projected anchors.
    points = (torch.rand(bs, cams, anchors, pts, 2, generator=gen) * 3 - 1).requires_grad_()
    weights = torch.rand(bs, anchors, cams, len(levels), pts, groups, generator=gen).requires_grad_()
    grad = torch.randn(bs, anchors, c, generator=gen)
    hw = [h * w for h, w in levels]
    shapes = torch.tensor([levels] * cams)
    offsets = torch.tensor([sum(hw[:i]) for i in range(len(hw))])
    starts = torch.arange(cams)[:, None] * sum(hw) + offsets

    def base() -> None:
        daf_grid_sample(maps, points, weights, groups).backward(grad)

    def ours() -> None:
        feat = torch.cat([t.flatten(3) for t in maps], dim=3).transpose(2, 3).reshape(bs, -1, c)
        loc = points.permute(0, 2, 3, 1, 4)
        w = weights.permute(0, 1, 4, 2, 3, 5)
        daf.deformable_aggregation(feat, shapes, starts, loc, w, False).backward(grad)

    compare("daf_sparse4d_v3_900x13x6cam", base, ours, max(1, reps // 2), rounds=2 if quick else 3)


def bench_bev_pool(quick: bool, reps: int) -> None:
    from loongkit_ops.kernels.ops import bev_pool

    gen = torch.Generator().manual_seed(0)
    n, c, nx, ny = (500_000 if quick else 2_000_000), 80, 360, 360
    feats = torch.randn(n, c, generator=gen).requires_grad_()
    # Camera frustum points crowd near the ego car: a Gaussian around the grid centre, clipped.
    xy = (torch.randn(n, 2, generator=gen) * 70 + 180).long().clamp(0, 359)
    coords = torch.cat([xy, torch.zeros(n, 2, dtype=torch.long)], 1)  # (x, y, z=0, batch=0)
    grad = torch.randn(1, c, 1, nx, ny, generator=gen)

    def cumsum_trick() -> None:
        ranks = ((coords[:, 0] * ny + coords[:, 1]) * 1 + coords[:, 2]) * 1 + coords[:, 3]
        order = ranks.argsort()
        x, geom, r = feats[order], coords[order], ranks[order]
        x = x.cumsum(0)
        kept = torch.ones(x.shape[0], dtype=torch.bool)
        kept[:-1] = r[1:] != r[:-1]
        x, geom = x[kept], geom[kept]
        x = torch.cat((x[:1], x[1:] - x[:-1]))
        out = x.new_zeros(1, c, 1, nx, ny)
        out[geom[:, 3], :, geom[:, 2], geom[:, 0], geom[:, 1]] = x
        out.backward(grad)

    def index_add() -> None:
        voxel = coords[:, 0] * ny + coords[:, 1]
        out = feats.new_zeros(nx * ny, c).index_add(0, voxel, feats)
        out.t().reshape(1, c, 1, nx, ny).backward(grad)

    def ours() -> None:
        bev_pool.op(feats, coords, 1, 1, nx, ny).backward(grad)

    size = f"{n // 1000}kx{c}_{nx}x{ny}"
    compare(f"bev_pool_vs_cumsum_{size}", cumsum_trick, ours, max(1, reps // 2), rounds=2)
    compare(f"bev_pool_vs_index_add_{size}", index_add, ours, max(1, reps // 2), rounds=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="BEVFormer-tiny shapes only, fewer repetitions")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--only", choices=("msda", "dice", "daf", "bev_pool", "voxel"), default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from loongkit_ops import kernels

    if kernels.load() is None:
        sys.exit(f"loongkit-ops kernels unavailable: {kernels.failure()}")
    reps = 3 if args.quick else 7
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    import importlib.util

    # The baselines are the upstream packages: without them (nox's plain bench venv) say so, exit 0.
    for part, needs, run in (("msda", "mmcv", bench_msda), ("dice", "mmseg", bench_dice), ("daf", "torch", bench_daf),
                             ("bev_pool", "torch", bench_bev_pool), ("voxel", "mmcv", bench_voxel)):
        if args.only not in (None, part):
            continue
        if importlib.util.find_spec(needs) is None:
            print(f"# {part}: skipped, {needs} is not installed (run in the stack2 venv)", flush=True)
            continue
        run(args.quick, reps)


if __name__ == "__main__":
    main()
