"""LOONGKIT_BEVFUSION: a vendored BEVFusion-style view transform, get_geometry and bev_pool patched at registration.

The test writes a small ``projects/bevfusion_plugin`` package (``upstream_bevfusion_project.py`` next
to this file: written for this project from the published BEVFusion algorithm, same public interface
and maths, no upstream code): ``BaseTransform`` with ``create_frustum``, ``get_geometry`` and
``bev_pool``, a registered ``LSSTransform`` subclass, and a CPU stand-in for the CUDA ``bev_pool``
extension (sort by voxel rank, cumulative-sum trick, scatter). With fresh random camera-branch
inputs (nuScenes-like rig with random image and lidar augmentations, 6 cameras, 118 depth bins on a
32x88 feature map, 80 channels, 360x360 BEV, points inside and outside the grid), batch 1 and 2:
the patched methods' outputs and gradients equal the originals', and the voxels the patched geometry
quantises to are the original's (fp64: all; fp32: all but the few points a rounding step away from a
voxel boundary, counted and checked to be exactly those).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.integration

pytest.importorskip("mmengine.registry.registry")

from loongkit_ops import kernels  # noqa: E402
from loongkit_ops.patches.bevfusion import BevFusionPool  # noqa: E402
from loongkit_ops.plugin import plugin  # noqa: E402

from loongkit_core.context import ActivationContext  # noqa: E402
from loongkit_core.feature import State  # noqa: E402

SEED = int(torch.seed() % 2**31)


def _load(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"lk_{name}_test", Path(__file__).parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


upstream = _load("upstream_bevfusion_project")
TRANSFORMS = upstream.source("mmengine.registry")
BOUNDS = ((-54.0, 54.0, 0.3), (-54.0, 54.0, 0.3))  # BEVFusion's nuScenes camera grid: 360 x 360


def write_project(root: Path, package: str, source: str = TRANSFORMS) -> str:
    return upstream.write_project(root, package, source)


def activation() -> tuple[BevFusionPool, ActivationContext]:
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == "bevfusion")
    ctx = ActivationContext.standalone(feature, State.APPLIED)
    return BevFusionPool(feature), ctx


def load(tmp_path: Path, package: str, source: str = TRANSFORMS) -> Iterator[tuple[Any, ActivationContext]]:
    assert kernels.load() is not None, kernels.failure()
    impl, ctx = activation()
    impl.activate(ctx, "mmengine.registry.registry")
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module(write_project(tmp_path, package, source)), ctx
    finally:
        impl.deactivate(ctx)
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith(package)]:
            del sys.modules[name]


@pytest.fixture
def project(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Any, ActivationContext]]:
    name = request.node.name.replace("[", "_").replace("]", "").replace("-", "_")
    yield from load(tmp_path, f"lk_bevfusion_{name}")


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("zbound", [(-10.0, 10.0, 20.0), (-5.0, 3.0, 2.0)])
def test_patched_bev_pool_equals_unpatched(project: tuple[Any, ActivationContext], bs: int, dtype: torch.dtype,
                                           zbound: tuple[float, float, float]) -> None:
    module, ctx = project
    base = module.BaseTransform
    assert base.bev_pool.__wrapped__ is not base.bev_pool, "bev_pool was not patched at registration"
    gen = torch.Generator().manual_seed(SEED + bs)
    lss = module.LSSTransform(256, 80, (256, 704), (32, 88), (-54.0, 54.0, 0.3), (-54.0, 54.0, 0.3), zbound,
                              (1.0, 60.0, 0.5)).to(dtype)
    n_cam, depth, h, w, c = 6, 24, 8, 22, 80
    geom = torch.empty(bs, n_cam, depth, h, w, 3, dtype=dtype)
    geom[..., :2] = torch.randn(bs, n_cam, depth, h, w, 2, generator=gen, dtype=dtype) * 30  # some beyond 54 m
    geom[..., 2] = torch.rand(bs, n_cam, depth, h, w, generator=gen, dtype=dtype) * 16 - 8
    x = torch.randn(bs, n_cam, depth, h, w, c, generator=gen, dtype=dtype)
    results = []
    for fn in (base.bev_pool.__wrapped__, base.bev_pool):
        xi = x.clone().requires_grad_()
        out = fn(lss, geom, xi)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(SEED), dtype=dtype)
        out.backward(grad)
        results.append((out.detach(), xi.grad))
    assert ctx.record.calls == 1
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    for theirs, mine in zip(*results, strict=True):
        assert mine.shape == theirs.shape
        torch.testing.assert_close(mine, theirs, **tol, msg=lambda m: f"seed {SEED}: {m}")


def voxels(lss: Any, geom: torch.Tensor) -> torch.Tensor:
    """The integer voxel of every point, exactly as upstream's bev_pool quantises (truncation toward zero)."""
    return ((geom - (lss.bx - lss.dx / 2.0)) / lss.dx).long()


def boundary_distance(lss: Any, geom: torch.Tensor) -> torch.Tensor:
    """Per point and axis: how far (m) the coordinate is from the nearest voxel boundary (in float64)."""
    lower = (lss.bx - lss.dx / 2.0).double()
    cells = (geom.double() - lower) / lss.dx.double()
    return (cells - cells.round()).abs() * lss.dx.double()


def geometries(module: Any, lss: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    base = module.BaseTransform
    return base.get_geometry.__wrapped__(lss, *args, **kwargs), base.get_geometry(lss, *args, **kwargs)


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_patched_get_geometry_equals_unpatched(project: tuple[Any, ActivationContext], bs: int,
                                               dtype: torch.dtype) -> None:
    """Full camera branch: 6 cameras x 118 depth bins x 32 x 88 = 2M frustum points per sample."""
    module, ctx = project
    assert module.BaseTransform.get_geometry.__wrapped__ is not module.BaseTransform.get_geometry
    gen = torch.Generator().manual_seed(SEED + bs)
    lss = module.LSSTransform(256, 80, (256, 704), (32, 88), *BOUNDS, (-10.0, 10.0, 20.0), (1.0, 60.0, 0.5)).to(dtype)
    args, extra = upstream.camera_inputs(bs, dtype, gen)
    theirs, mine = geometries(module, lss, args, extra)
    assert ctx.record.calls == 1
    assert mine.shape == theirs.shape == (bs, 6, 118, 32, 88, 3) and mine.dtype == dtype
    # Coordinates reach ~70 m: the tolerance is relative to that magnitude (the fold reassociates products).
    scale = theirs.abs().max().item()
    rel = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(mine, theirs, rtol=0, atol=rel * scale, msg=lambda m: f"seed {SEED}: {m}")
    # The voxels fed to bev_pool. A point closer to a voxel boundary than the rounding difference may
    # land in the neighbouring voxel; only such points may differ, and by one voxel.
    v_theirs, v_mine = voxels(lss, theirs), voxels(lss, mine)
    flipped = v_theirs != v_mine
    count = int(flipped.any(-1).sum())
    print(f"seed {SEED} {dtype} bs {bs}: {count} of {flipped.shape[:-1].numel()} points change voxel")
    if dtype == torch.float64:
        assert count == 0, f"seed {SEED}: fp64 geometry changed {count} voxels"
        return
    assert (v_theirs - v_mine).abs().max() <= 1
    # Near = within the two geometries' difference plus the rounding of the quantisation itself
    # (one subtraction and one division in float32: a few ulps of the coordinate).
    err = (mine - theirs).abs().double()
    slack = 4 * torch.finfo(dtype).eps * (theirs.abs() + (lss.bx - lss.dx / 2.0).abs()).double()
    near = boundary_distance(lss, theirs) <= err + slack
    assert near[flipped].all(), f"seed {SEED}: a point away from any voxel boundary changed voxel"
    assert count <= 1e-4 * flipped.shape[:-1].numel(), f"seed {SEED}: {count} voxel changes"


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_camera_to_bev_equals_unpatched(project: tuple[Any, ActivationContext], bs: int, dtype: torch.dtype) -> None:
    """get_geometry then bev_pool, output and gradient to the features, patched vs original methods.

    BEV cells that a voxel-changing point (see above) enters or leaves are excluded from the fp32
    comparison and counted; fp64 compares every cell.
    """
    module, ctx = project
    base = module.BaseTransform
    gen = torch.Generator().manual_seed(SEED + 10 + bs)
    lss = module.LSSTransform(256, 8, (256, 704), (32, 88), *BOUNDS, (-5.0, 3.0, 2.0), (1.0, 60.0, 1.0)).to(dtype)
    args, extra = upstream.camera_inputs(bs, dtype, gen)
    x = torch.randn(bs, 6, lss.D, 32, 88, 8, generator=gen, dtype=dtype)
    results = []
    for geometry, pool in ((base.get_geometry.__wrapped__, base.bev_pool.__wrapped__),
                           (base.get_geometry, base.bev_pool)):
        xi = x.clone().requires_grad_()
        geom = geometry(lss, *args, **extra)
        out = pool(lss, geom, xi)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(SEED), dtype=dtype)
        out.backward(grad)
        results.append((geom, out.detach(), xi.grad))
    assert ctx.record.calls == 2
    (g_theirs, out_theirs, gx_theirs), (g_mine, out_mine, gx_mine) = results
    flipped = (voxels(lss, g_theirs) != voxels(lss, g_mine)).any(-1)  # [B, N, D, H, W]
    cells = torch.zeros(out_theirs.shape[0], *out_theirs.shape[2:], dtype=torch.bool)  # [B, X, Y]
    for g in (g_theirs, g_mine):
        v = voxels(lss, g)[flipped]
        b = torch.arange(bs)[:, None, None, None, None].expand_as(flipped)[flipped]
        ok = ((v[:, :2] >= 0) & (v[:, :2] < lss.nx[:2])).all(1)
        cells[b[ok], v[ok, 0], v[ok, 1]] = True
    print(f"seed {SEED} {dtype} bs {bs}: {int(flipped.sum())} points change voxel, "
          f"{int(cells.sum())} BEV cells excluded")
    if dtype == torch.float64:
        assert not flipped.any()
    # The stand-in's cumulative-sum trick over ~1M sorted points loses float32 precision (a voxel's sum
    # is the difference of two large running sums): its error, not ours, sets the float32 atol.
    tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    keep = ~cells[:, None].expand_as(out_theirs)
    torch.testing.assert_close(out_mine[keep], out_theirs[keep], **tol, msg=lambda m: f"seed {SEED}: {m}")
    moved = flipped[..., None].expand_as(gx_theirs)
    torch.testing.assert_close(gx_mine[~moved], gx_theirs[~moved], **tol, msg=lambda m: f"seed {SEED}: {m}")


def test_get_geometry_without_lidar_augmentation_and_fallbacks(project: tuple[Any, ActivationContext]) -> None:
    """No extra_rots / extra_trans, or only one: folded as upstream reads them. Mixed or half dtypes and
    wrong shapes: the original method runs (and raises where it raises)."""
    module, ctx = project
    gen = torch.Generator().manual_seed(SEED + 20)
    lss = module.LSSTransform(256, 80, (256, 704), (8, 22), *BOUNDS, (-10.0, 10.0, 20.0), (1.0, 60.0, 2.0)).double()
    args, extra = upstream.camera_inputs(2, torch.float64, gen)
    for kwargs in ({}, {"extra_rots": extra["extra_rots"]}, {"extra_trans": extra["extra_trans"]}, extra):
        theirs, mine = geometries(module, lss, args, kwargs)
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12 * theirs.abs().max().item())
    assert ctx.record.calls == 4
    mixed = (args[0].float(), *args[1:])  # float32 rotations with float64 others: upstream's error or result
    with pytest.raises(RuntimeError):
        module.BaseTransform.get_geometry.__wrapped__(lss, *mixed, **extra)
    with pytest.raises(RuntimeError):
        module.BaseTransform.get_geometry(lss, *mixed, **extra)
    lss.float()  # the frustum in float32, the matrices float64: upstream promotes to float64
    theirs, mine = geometries(module, lss, args, extra)
    assert mine.dtype == theirs.dtype == torch.float64
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert ctx.record.calls == 4, "mixed dtypes must run the original"


def test_fork_with_other_geometry_is_left_alone(tmp_path: Path) -> None:
    """A get_geometry that reads another keyword, uses other ops or other parameters is not patched;
    bev_pool still is."""
    forks = {
        "lidar_aug_matrix": TRANSFORMS.replace('if "extra_trans" in kwargs:', 'if "lidar_aug_matrix" in kwargs:'),
        "linalg": TRANSFORMS.replace("cam2lidar = camera2lidar_rots.matmul(torch.inverse(intrins))",
                                     "cam2lidar = camera2lidar_rots.matmul(torch.linalg.inv(intrins))"),
        "depth": TRANSFORMS.replace("post_rots, post_trans, **kwargs):", "post_rots, post_trans, depth, **kwargs):"),
    }
    for i, (word, fork) in enumerate(forks.items()):
        assert fork != TRANSFORMS
        for module, ctx in load(tmp_path / str(i), f"lk_bevfusion_geofork{i}", fork):
            base = module.BaseTransform
            assert not hasattr(base.get_geometry, "__wrapped__")
            assert hasattr(base.bev_pool, "__wrapped__")
            reason = ctx.record.details["skipped"][f"{module.__name__}.BaseTransform.get_geometry"]
            assert "interface differs" in reason and word in reason, reason
            assert ctx.record.state == State.APPLIED
            assert ctx.record.details["patched"] == [f"{module.__name__}.BaseTransform.bev_pool"]
    assert not hasattr(base.get_geometry, "__wrapped__")  # deactivation left the fork as written


def test_fork_with_other_pooling_is_left_alone(tmp_path: Path) -> None:
    fork = TRANSFORMS.replace("        final = torch.cat(x.unbind(dim=2), 1)\n",
                              "        final = torch.cat(x.unbind(dim=2), 1).relu()\n")
    assert fork != TRANSFORMS
    for module, ctx in load(tmp_path, "lk_bevfusion_fork", fork):
        assert not hasattr(module.BaseTransform.bev_pool, "__wrapped__")
        reason = ctx.record.details["skipped"][f"{module.__name__}.BaseTransform.bev_pool"]
        assert "interface differs" in reason and "relu" in reason
        assert hasattr(module.BaseTransform.get_geometry, "__wrapped__")  # the geometry is upstream's: patched
    assert not hasattr(module.BaseTransform.get_geometry, "__wrapped__")  # and restored


def test_kernel_unavailable_leaves_the_class_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No kernel build when the registry is imported; a matching class that registers is skipped."""
    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels, "failure", lambda: "RuntimeError: no compiler")
    impl, ctx = activation()
    impl.activate(ctx, "mmengine.registry.registry")  # applies: nothing built yet
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(write_project(tmp_path, "lk_bevfusion_nokernel", TRANSFORMS))
        assert not hasattr(module.BaseTransform.bev_pool, "__wrapped__")
        assert "no compiler" in ctx.record.details["skipped"][f"{module.__name__}.BaseTransform.bev_pool"]
        assert hasattr(module.BaseTransform.get_geometry, "__wrapped__")  # needs no kernel
    finally:
        impl.deactivate(ctx)
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith("lk_bevfusion_nokernel")]:
            del sys.modules[name]


RUN = """
import sys, importlib, torch
sys.path.insert(0, {root!r})
vt = importlib.import_module("lk_bevfusion_e2e.vtransforms")
m = vt.LSSTransform(8, 8, (32, 88), (4, 11), (-10.0, 10.0, 1.0), (-10.0, 10.0, 1.0), (-5.0, 5.0, 10.0), (1.0, 5.0, 1.0))
eye = torch.eye(3).repeat(1, 2, 1, 1)
intrins = torch.tensor([[20.0, 0, 44], [0, 20.0, 16], [0, 0, 1]]).repeat(1, 2, 1, 1)
geom = m.get_geometry(eye, torch.zeros(1, 2, 3), intrins, eye, torch.zeros(1, 2, 3), extra_rots=torch.eye(3)[None],
                      extra_trans=torch.zeros(1, 3))
x = torch.randn(1, 2, 4, 4, 11, 8, requires_grad=True)
m.bev_pool(geom, x).sum().backward()
"""


def test_end_to_end_summary(run_loongkit: Callable[..., Any], tmp_path: Path) -> None:
    write_project(tmp_path, "lk_bevfusion_e2e")
    result = run_loongkit(RUN.format(root=str(tmp_path)), env={"LOONGKIT_BEVFUSION": "1"})
    assert result.returncode == 0, result.stderr
    row = result.feature("bevfusion")
    assert row["active"] and row["calls"] == 2, row  # one get_geometry, one bev_pool
