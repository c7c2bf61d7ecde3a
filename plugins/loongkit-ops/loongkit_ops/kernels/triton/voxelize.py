"""Dynamic and hard voxelization (mmcv semantics, deterministic mode) with Triton kernels.

The per-point kernel computes each point's voxel exactly as mmcv and the C++ kernel
(cpu/voxelize.cpp) do: f = floor((p - range_min) / voxel_size) per axis in float32 (float64 for
float64 points) with the float32 voxel size and range, IEEE division (Triton's ``/`` on fp32 is an
approximate division on NVIDIA GPUs, hence ``div_rn``); a coordinate outside [0, grid) or NaN drops
the point. grid = round((max - min) / size) in float32, rounded half away from zero like std::round.

Hard voxelization keeps upstream's order rules (points scanned in input order, a voxel's index fixed
by its first point, max_voxels and max_points caps, (z, y, x) coordinates, zero padding) without a
sequential scan and without a dense grid: a stable sort of the kept points' voxel keys groups each
voxel's points in input order (a point's slot is its rank in its group), the voxels are numbered by
their first point's index, and a fill kernel writes every (voxel, slot) row of the output once,
either its point's features or zeros.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _axis(pts, rows, nmask, F, grid, j: tl.constexpr, dim, ACC: tl.constexpr, F64: tl.constexpr):
    """floor((p_j - lo_j) / size_j) of each point and whether it lies in [0, dim) (False for NaN)."""
    p = tl.load(pts + rows * F + j, mask=nmask, other=0.0).to(ACC)
    size = tl.load(grid + j).to(ACC)  # float32 values, widened exactly for float64 points
    d = p - tl.load(grid + 3 + j).to(ACC)
    q = d / size if F64 else tl.math.div_rn(d, size)  # fp64 division is IEEE already
    f = tl.floor(q)
    ok = (f >= 0.0) & (f < dim)  # dim converted to ACC (exact below 2^24), as the C++ comparison does
    return tl.where(ok, f, 0.0).to(tl.int64), ok


@triton.jit
def _voxel_keys(pts, grid, coors, keys, N, F, DX, DY, DZ, BLOCK_N: tl.constexpr, ACC: tl.constexpr,
                F64: tl.constexpr, WRITE_COORS: tl.constexpr, WRITE_KEYS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rows < N
    x, okx = _axis(pts, rows, nmask, F, grid, 0, DX, ACC, F64)
    y, oky = _axis(pts, rows, nmask, F, grid, 1, DY, ACC, F64)
    z, okz = _axis(pts, rows, nmask, F, grid, 2, DZ, ACC, F64)
    inside = okx & oky & okz
    if WRITE_COORS:
        tl.store(coors + 3 * rows, tl.where(inside, z, -1).to(tl.int32), mask=nmask)
        tl.store(coors + 3 * rows + 1, tl.where(inside, y, -1).to(tl.int32), mask=nmask)
        tl.store(coors + 3 * rows + 2, tl.where(inside, x, -1).to(tl.int32), mask=nmask)
    if WRITE_KEYS:
        tl.store(keys + rows, tl.where(inside, (z * DY + y) * DX + x, -1), mask=nmask)


@triton.jit
def _fill(pts, src, voxels, R, F, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    """Row r of voxels [M * max_points, F] = points[src[r]], or zeros where src[r] < 0 (padding)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    fs = tl.arange(0, BLOCK_F)
    rmask = rows < R
    fmask = (fs < F)[None, :]
    i = tl.load(src + rows, mask=rmask, other=-1)
    has = i >= 0
    v = tl.load(pts + tl.where(has, i, 0)[:, None] * F + fs[None, :], mask=has[:, None] & fmask, other=0.0)
    tl.store(voxels + rows[:, None] * F + fs[None, :], v, mask=rmask[:, None] & fmask)


def _round_half_away(q: float) -> int:
    return int(math.copysign(math.floor(abs(q) + 0.5), q))


def _grid(voxel_size: Sequence[float], coors_range: Sequence[float]) -> tuple[Tensor, list[int]]:
    """(float32 [size_x, size_y, size_z, lo_x, lo_y, lo_z], dims x, y, z), computed as the C++ kernel does."""
    if len(voxel_size) != 3 or len(coors_range) != 6:
        raise RuntimeError("voxel_size has 3 values, coors_range 6")
    f32 = torch.tensor([*voxel_size, *coors_range], dtype=torch.float32)
    size, lo, hi = f32[:3], f32[3:6], f32[6:]
    extent = hi - lo  # float32 arithmetic, like the C++ kernel
    dims = [_round_half_away((extent[j] / size[j]).item()) for j in range(3)]
    if min(dims) <= 0:
        raise RuntimeError("empty voxel grid")
    return torch.cat([size, lo]), dims


def _per_point(points: Tensor, voxel_size: Sequence[float], coors_range: Sequence[float], coors: bool,
               keys: bool) -> tuple[Tensor | None, Tensor | None, list[int]]:
    if points.dim() != 2 or points.shape[1] < 3:
        raise RuntimeError("points must be [N, >=3]")
    grid, dims = _grid(voxel_size, coors_range)
    n, f = points.shape
    out_coors = torch.empty(n, 3, dtype=torch.int32, device=points.device) if coors else None
    out_keys = torch.empty(n, dtype=torch.int64, device=points.device) if keys else None
    if n:
        block, f64 = 256, points.dtype == torch.float64
        _voxel_keys[(triton.cdiv(n, block),)](points, grid.to(points.device), out_coors, out_keys, n, f, *dims,
                                              BLOCK_N=block, ACC=tl.float64 if f64 else tl.float32, F64=f64,
                                              WRITE_COORS=coors, WRITE_KEYS=keys)
    return out_coors, out_keys, dims


def dynamic_voxelize(points: Tensor, voxel_size: Sequence[float], coors_range: Sequence[float]) -> Tensor:
    """int32 [N, 3] (z, y, x) voxel of each point of points [N, F] (contiguous), -1 rows outside the range."""
    coors, _, _ = _per_point(points, voxel_size, coors_range, coors=True, keys=False)
    assert coors is not None
    return coors


def hard_voxelize(points: Tensor, voxel_size: Sequence[float], coors_range: Sequence[float], max_points: int,
                  max_voxels: int) -> tuple[Tensor, Tensor, Tensor]:
    """(voxels [M, max_points, F], coors int32 [M, 3] (z, y, x), num_points int32 [M]) of points [N, F]."""
    if max_points < 0 or max_voxels < 0:
        raise RuntimeError("max_points and max_voxels must be >= 0")
    _, key, (dx, dy, _) = _per_point(points, voxel_size, coors_range, coors=False, keys=True)
    assert key is not None
    dev, f = points.device, points.shape[1]
    idx = torch.nonzero(key >= 0).squeeze(1)  # kept points, in input order
    # Stable: within a voxel's group the points stay in input order, so the group's head is its first point.
    sorted_keys, perm = torch.sort(key[idx], stable=True)
    total = sorted_keys.numel()
    head = torch.ones(total, dtype=torch.bool, device=dev)
    head[1:] = sorted_keys[1:] != sorted_keys[:-1]
    group = torch.cumsum(head, 0) - 1  # group of each sorted point
    starts = torch.nonzero(head).squeeze(1)  # sorted position of each group's first point
    count = torch.diff(starts, append=starts.new_tensor([total]))
    # Voxel ids follow the first points' input order (perm positions are increasing in input index).
    order = torch.argsort(perm[starts])  # voxel id -> group
    m = min(order.numel(), max_voxels)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=dev)
    vid = rank[group]
    slot = torch.arange(total, device=dev) - starts[group]
    keep = (vid < m) & (slot < max_points)
    src = torch.full((m * max_points,), -1, dtype=torch.int64, device=dev)  # point of each (voxel, slot)
    src[vid[keep] * max_points + slot[keep]] = idx[perm[keep]]
    voxels = points.new_empty(m, max_points, f)
    if voxels.numel():
        block_f = triton.next_power_of_2(f)
        block_r = max(1, 1024 // block_f)
        _fill[(triton.cdiv(m * max_points, block_r),)](points, src, voxels, m * max_points, f, BLOCK_R=block_r,
                                                       BLOCK_F=block_f)
    first = order[:m]
    k = sorted_keys[starts[first]]
    coors = torch.stack([k // (dx * dy), (k // dx) % dy, k % dx], 1).to(torch.int32)
    num = count[first].clamp(max=max_points).to(torch.int32)
    return voxels, coors, num
