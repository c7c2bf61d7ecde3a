"""The Triton voxelization kernels (kernels/triton/voxelize.py), run by Triton's interpreter on CPU tensors.

A child process with TRITON_INTERPRET=1 runs loongkit::hard_voxelize and loongkit::dynamic_voxelize
with the backend forced to 'triton' (so the dispatch in kernels/ops/ is exercised too), with
torch.empty / empty_like / new_empty poisoned (NaN, or -7 for integers) so an unwritten element
shows. The parent requires outputs identical to the C++ kernel's (and to the reference's): same
dtypes, shapes and values, voxel order, point order in a voxel, caps and zero padding. Clouds are
fresh random every run (seed in every failure message), with points on voxel edges, on the upper
bound (outside), NaN coordinates and far outliers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from loongkit_ops.kernels.ops import voxelize

SEED = int(torch.seed() % 2**31)
# (voxel_size, coors_range): the second is a pillar grid (one z voxel) with sizes that are not powers of two.
GRIDS = [([0.2, 0.25, 0.5], [-4.0, -5.0, -1.0, 4.0, 5.0, 2.0]), ([0.3, 0.7, 3.0], [-3.0, -4.2, -1.0, 3.0, 4.2, 2.0])]
# (points, max_points, max_voxels): no cap, both caps, one point per voxel, empty cloud, no slot, no voxel.
CASES = [(300, 4, 10000), (300, 2, 25), (200, 1, 7), (0, 3, 5), (60, 0, 20), (60, 3, 0)]

SCRIPT = """
    from loongkit_ops.kernels.ops import voxelize
    voxelize.backend = lambda t: ("triton", "")  # CPU tensors through the Triton branch
    seed, grids, cases = ARGS
    gen = torch.Generator().manual_seed(seed)
    results = []
    for dtype in (torch.float32, torch.float64, torch.float16):
        for gi, (size, rng) in enumerate(grids):
            for n, max_points, max_voxels in cases:
                features = 4 + (n % 3)  # 4 or 5 features: the fill kernel's feature lanes are masked
                pts = torch.randn(n, features, generator=gen) * torch.tensor([2.5, 3.0, 1.0] + [1.0] * (features - 3))
                pts[::7] = pts[::7] * 0.05  # dense clusters: many points per voxel
                pts[::17, :3] = pts[::17, :3].round()  # on voxel edges
                pts[::29, 2] = rng[5]  # on the upper z bound: outside
                pts = pts.to(dtype)
                if n > 5:
                    pts[3, 0] = float("nan")
                    pts[5, 1] = 1e30
                hard = voxelize.hard_op(pts, size, rng, max_points, max_voxels)
                dyn = voxelize.dynamic_op(pts, size, rng)
                results.append(dict(grid=gi, case=(n, max_points, max_voxels), points=pts, hard=hard, dynamic=dyn))
    save(results)
"""


def assert_same(got: tuple, expected: tuple, msg: str) -> None:
    for name, g, e in zip(("voxels", "coors", "num_points"), got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape, f"{name} {msg}: {g.dtype} {g.shape} vs {e.dtype} {e.shape}"
        assert torch.equal(g, e), f"{name} {msg}: differs at {(g != e).nonzero()[:5].tolist()}"


def test_triton_kernel_interpreted(ext: Any, run_interpreted: Callable[..., Any]) -> None:
    pytest.importorskip("triton")
    results = run_interpreted(SCRIPT, SEED, GRIDS, CASES)
    assert len(results) == 3 * len(GRIDS) * len(CASES)
    capped = 0
    for r in results:
        pts, (_, max_points, max_voxels) = r["points"], r["case"]
        size, rng = GRIDS[r["grid"]]
        msg = f"seed {SEED}, grid {r['grid']}, case {r['case']}, {pts.dtype}"
        assert voxelize.backend(pts)[0] == "cpu"
        assert_same(r["hard"], voxelize.hard_op(pts, size, rng, max_points, max_voxels), f"vs C++ kernel {msg}")
        assert_same(r["hard"], voxelize.hard_reference(pts, size, rng, max_points, max_voxels), f"vs reference {msg}")
        dyn = r["dynamic"]
        assert dyn.dtype == torch.int32 and torch.equal(dyn, voxelize.dynamic_op(pts, size, rng)), msg
        assert torch.equal(dyn, voxelize.dynamic_reference(pts, size, rng)), msg
        capped += int(r["hard"][2].numel() == max_voxels > 0 and bool((r["hard"][2] == max_points).any()))
    assert capped > 0, f"seed {SEED}: no case reached both caps"  # the caps were exercised
