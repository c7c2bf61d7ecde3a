"""``loongkit::hard_voxelize`` and ``loongkit::dynamic_voxelize``: mmcv's voxelization, deterministic.

points [N, F] -> voxels, coordinates (z, y, x) and counts (hard), or each point's voxel (dynamic).
Forward only (integer outputs, and voxels copied from the points). Kernels: ``cpu/voxelize.cpp``,
``triton/voxelize.py``; :func:`hard_reference` / :func:`dynamic_reference` (sort-based torch) otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from loongkit_ops import kernels
from loongkit_ops.kernels.ops import dispatch

DTYPES = (torch.float16, torch.float32, torch.float64)  # the CPU kernel takes half points too


def backend(points: Tensor) -> tuple[str, str]:
    """('cpu' | 'triton' | 'reference', why) for a call on ``points``."""
    return dispatch.backend(points, "voxelization", DTYPES, triton_module="voxelize")


def _voxel_coords(points: Tensor, voxel_size: Sequence[float], coors_range: Sequence[float]) -> tuple[Tensor, Tensor]:
    """((z, y, x) int64 [N, 3], inside [N] bool) with mmcv's arithmetic: float32 grid values, computed
    in float32 for float32/float16 points and in float64 for float64 points."""
    size = torch.tensor(list(voxel_size), dtype=torch.float32)
    rng = torch.tensor(list(coors_range), dtype=torch.float32)
    grid = torch.round((rng[3:] - rng[:3]) / size).to(torch.int64)
    acc = torch.float64 if points.dtype == torch.float64 else torch.float32
    f = torch.floor((points[:, :3].to(acc) - rng[:3].to(acc)) / size.to(acc))
    inside = ((f >= 0) & (f < grid.to(acc))).all(1)  # NaN fails: dropped
    xyz = torch.where(inside[:, None], f, torch.zeros_like(f)).to(torch.int64)
    return xyz.flip(1), inside


def dynamic_reference(points: Tensor, voxel_size: Sequence[float], coors_range: Sequence[float]) -> Tensor:
    """mmcv's dynamic voxelization: int32 (z, y, x) per point, -1 rows outside the range."""
    zyx, inside = _voxel_coords(points, voxel_size, coors_range)
    return torch.where(inside[:, None], zyx, torch.full_like(zyx, -1)).to(torch.int32)


def hard_reference(points: Tensor, voxel_size: Sequence[float], coors_range: Sequence[float], max_points: int,
                   max_voxels: int) -> tuple[Tensor, Tensor, Tensor]:
    """mmcv's deterministic hard voxelization, by sorting instead of a sequential scan.

    A voxel's id is the rank of its first point's index among the voxels' first points (ids >=
    max_voxels are dropped with all their points); a point's slot is its rank among its voxel's
    points in input order (slots >= max_points are dropped); unused slots are zero.
    """
    n, feat = points.shape
    zyx, inside = _voxel_coords(points, voxel_size, coors_range)
    idx = torch.nonzero(inside).flatten()
    zyx = zyx[idx]
    keys, inverse = torch.unique(zyx, dim=0, return_inverse=True)
    first = torch.full((keys.shape[0],), n, dtype=torch.int64).scatter_reduce(0, inverse, idx, "amin")
    order = torch.argsort(first)  # voxel ids in order of their first point
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    vid = rank[inverse]  # voxel id of each kept point
    # Slot: the point's position among its voxel's points (a stable sort by voxel id keeps input order).
    by_voxel = torch.sort(vid, stable=True)
    starts = torch.searchsorted(by_voxel.values, by_voxel.values, right=False)
    slot = torch.empty_like(vid)
    slot[by_voxel.indices] = torch.arange(vid.numel()) - starts
    m = min(int(keys.shape[0]), max_voxels)
    keep = (vid < m) & (slot < max_points)
    voxels = points.new_zeros(m, max_points, feat)
    voxels[vid[keep], slot[keep]] = points[idx[keep]]
    counts = torch.bincount(vid[vid < m], minlength=m).clamp(max=max_points)
    coors = keys[order[:m]].to(torch.int32)
    return voxels, coors, counts.to(torch.int32)


@dispatch.custom_op("loongkit::hard_voxelize")
def hard_op(points: Tensor, voxel_size: list[float], coors_range: list[float], max_points: int,
            max_voxels: int) -> tuple[Tensor, Tensor, Tensor]:
    """(voxels [M, max_points, F], coors int32 [M, 3] (z, y, x), num_points int32 [M]) of points [N, F]."""
    which, _ = backend(points)
    if which == "reference":
        return hard_reference(points, voxel_size, coors_range, max_points, max_voxels)
    if which == "triton":
        return dispatch.triton("voxelize").hard_voxelize(points.contiguous(), voxel_size, coors_range, max_points,
                                                         max_voxels)
    voxels, coors, num = kernels.load().hard_voxelize(points.contiguous(), voxel_size, coors_range, max_points,
                                                      max_voxels)
    return voxels, coors, num


@hard_op.register_fake
def _(points: Tensor, voxel_size: list[float], coors_range: list[float], max_points: int,
      max_voxels: int) -> tuple[Tensor, Tensor, Tensor]:
    torch._check(points.dim() == 2)
    m = torch.library.get_ctx().new_dynamic_size()  # data-dependent: the number of occupied voxels
    return (points.new_empty(m, max_points, points.shape[1]), points.new_empty(m, 3, dtype=torch.int32),
            points.new_empty(m, dtype=torch.int32))


@dispatch.custom_op("loongkit::dynamic_voxelize")
def dynamic_op(points: Tensor, voxel_size: list[float], coors_range: list[float]) -> Tensor:
    """int32 [N, 3] (z, y, x) voxel of each point, -1 rows for points outside coors_range."""
    which, _ = backend(points)
    if which == "reference":
        return dynamic_reference(points, voxel_size, coors_range)
    if which == "triton":
        return dispatch.triton("voxelize").dynamic_voxelize(points.contiguous(), voxel_size, coors_range)
    return kernels.load().dynamic_voxelize(points.contiguous(), voxel_size, coors_range)


@dynamic_op.register_fake
def _(points: Tensor, voxel_size: list[float], coors_range: list[float]) -> Tensor:
    torch._check(points.dim() == 2)
    return points.new_empty(points.shape[0], 3, dtype=torch.int32)
