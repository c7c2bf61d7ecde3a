"""loongkit::hard_voxelize / dynamic_voxelize vs the sort-based reference (and a literal sequential scan
written from mmcv's documented rules), on fresh random clouds; opcheck and torch.compile."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from loongkit_ops import kernels
from loongkit_ops.kernels.ops import voxelize

SEED = int(torch.seed() % 2**31)
GRID = ([0.2, 0.25, 0.5], [-4.0, -5.0, -1.0, 4.0, 5.0, 2.0])


def cloud(gen: torch.Generator, n: int, dtype: torch.dtype = torch.float32, features: int = 4) -> torch.Tensor:
    pts = torch.randn(n, features, generator=gen) * torch.tensor([2.5, 3.0, 1.0] + [1.0] * (features - 3))
    pts[::17, :3] = pts[::17, :3].round()  # on voxel edges
    pts[::29, 2] = 2.0  # on the upper z edge: outside
    return pts.to(dtype)


def scan(points: torch.Tensor, size: list[float], rng: list[float], max_points: int,
         max_voxels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rules as a literal loop over the points (slow; small inputs only)."""
    coords = voxelize.dynamic_reference(points, size, rng).tolist()
    ids: dict[tuple, int] = {}
    rows: list[list[torch.Tensor]] = []
    order: list[tuple] = []
    for i, c in enumerate(coords):
        key = tuple(c)
        if key[0] < 0:
            continue
        if key not in ids:
            if len(ids) >= max_voxels:
                continue
            ids[key] = len(ids)
            rows.append([])
            order.append(key)
        if len(rows[ids[key]]) < max_points:
            rows[ids[key]].append(points[i])
    voxels = points.new_zeros(len(rows), max_points, points.shape[1])
    for v, r in enumerate(rows):
        if r:
            voxels[v, :len(r)] = torch.stack(r)
    return (voxels, torch.tensor(order, dtype=torch.int32).reshape(-1, 3),
            torch.tensor([len(r) for r in rows], dtype=torch.int32))


def assert_same(got: tuple, expected: tuple) -> None:
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, e.dtype, g.shape, e.shape)
        assert torch.equal(g, e), f"seed {SEED}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize(("n", "max_points", "max_voxels"), [(3000, 4, 10000), (3000, 2, 150), (500, 1, 7),
                                                             (0, 3, 5), (400, 0, 50)])
def test_kernel_matches_reference_and_scan(ext: Any, dtype: torch.dtype, n: int, max_points: int,
                                           max_voxels: int) -> None:
    gen = torch.Generator().manual_seed(SEED)
    pts = cloud(gen, n, dtype)
    if n:
        pts[3, 0] = float("nan")
    got = ext.hard_voxelize(pts, *GRID, max_points, max_voxels)
    assert_same(tuple(got), voxelize.hard_reference(pts, *GRID, max_points, max_voxels))
    assert_same(tuple(got), scan(pts, *GRID, max_points, max_voxels))
    coors = ext.dynamic_voxelize(pts, *GRID)
    assert torch.equal(coors, voxelize.dynamic_reference(pts, *GRID))


def test_dense_cloud_many_points_per_voxel(ext: Any) -> None:
    """100k points in few voxels: the per-voxel caps and input order matter for nearly every point."""
    gen = torch.Generator().manual_seed(SEED)
    pts = torch.rand(100_000, 5, generator=gen) * torch.tensor([2.0, 2.0, 1.0, 1.0, 1.0])
    got = voxelize.hard_op(pts, *GRID, 35, 60)
    assert_same(got, voxelize.hard_reference(pts, *GRID, 35, 60))
    assert got[0].shape[0] == 60 and int(got[2].min()) == 35


def test_reference_fallback_and_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(SEED)
    pts = cloud(gen, 800)
    assert voxelize.backend(pts.bfloat16())[0] == "reference"
    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels, "failure", lambda: "RuntimeError: boom")
    assert voxelize.backend(pts) == ("reference", "CPU kernel unavailable: RuntimeError: boom")
    assert_same(voxelize.hard_op(pts, *GRID, 3, 100), scan(pts, *GRID, 3, 100))


def test_bad_arguments_raise(ext: Any) -> None:
    pts = torch.zeros(4, 3)
    with pytest.raises(RuntimeError, match="empty voxel grid"):
        ext.hard_voxelize(pts, [1.0, 1.0, 1.0], [0, 0, 0, 0, 1, 1], 2, 2)
    with pytest.raises(RuntimeError, match="3 values"):
        ext.dynamic_voxelize(pts, [1.0, 1.0], [0, 0, 0, 1, 1, 1])
    with pytest.raises(RuntimeError, match="\\[N, >=3\\]"):
        ext.hard_voxelize(torch.zeros(4, 2), *GRID, 2, 2)


def test_opcheck_and_compile(ext: Any) -> None:
    gen = torch.Generator().manual_seed(SEED)
    pts = cloud(gen, 600)
    torch.library.opcheck(voxelize.dynamic_op, (pts, *GRID))
    torch.library.opcheck(voxelize.hard_op, (pts, *GRID, 3, 100),
                          test_utils=("test_schema", "test_faketensor"))
    torch._dynamo.reset()

    def count(p: torch.Tensor) -> torch.Tensor:
        return (voxelize.dynamic_op(p * 1.0, *GRID) >= 0).all(1).sum()

    assert int(torch.compile(count, backend="aot_eager", fullgraph=True)(pts)) == int(count(pts))
