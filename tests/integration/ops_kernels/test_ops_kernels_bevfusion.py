"""LOONGKIT_BEVFUSION: a vendored BEVFusion-style view transform, get_geometry and bev_pool patched at registration.

The test writes a small ``projects/bevfusion_plugin`` package (``upstream_bevfusion_project.py`` next
to this file: written for this project from the published BEVFusion algorithm, same public interface
and maths, no upstream code): ``BaseTransform`` with ``create_frustum``, ``get_geometry`` and
``bev_pool``, a registered ``LSSTransform`` subclass, and a CPU stand-in for the CUDA ``bev_pool``
extension (sort by voxel rank, cumulative-sum trick, scatter). With fresh random camera-branch
inputs (nuScenes-like rig with random image and lidar augmentations, 6 cameras, 118 depth bins on a
32x88 feature map, 80 channels, 360x360 BEV, points inside and outside the grid), batch 1 and 2:
the patched methods' outputs and gradients equal the originals'; the patched geometry is the
original's bit for bit (fp32 and fp64), also on a rig that puts most points within a few ulps of a
voxel face (where any other rounding moves points to a neighbouring voxel), with signed zeros, with
a frustum that is not a grid, and a self-check that keeps upstream's method if the rounding differs.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
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


def bits(t: torch.Tensor) -> torch.Tensor:
    """The IEEE bit patterns (so -0.0 and +0.0 differ, and NaNs compare by payload)."""
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int64)


def assert_bitwise(mine: torch.Tensor, theirs: torch.Tensor) -> None:
    assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
    differ = bits(mine) != bits(theirs)
    assert not differ.any(), (f"seed {SEED}: {int(differ.sum())} of {differ.numel()} coordinates differ from "
                              f"upstream's, by up to {(mine - theirs).abs().max().item():.3g}")


def geometries(module: Any, lss: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    base = module.BaseTransform
    return base.get_geometry.__wrapped__(lss, *args, **kwargs), base.get_geometry(lss, *args, **kwargs)


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_patched_get_geometry_equals_unpatched(project: tuple[Any, ActivationContext], bs: int,
                                               dtype: torch.dtype) -> None:
    """Full camera branch: 6 cameras x 118 depth bins x 32 x 88 = 2M frustum points per sample, bit for bit."""
    module, ctx = project
    assert module.BaseTransform.get_geometry.__wrapped__ is not module.BaseTransform.get_geometry
    gen = torch.Generator().manual_seed(SEED + bs)
    lss = module.LSSTransform(256, 80, (256, 704), (32, 88), *BOUNDS, (-10.0, 10.0, 20.0), (1.0, 60.0, 0.5)).to(dtype)
    args, extra = upstream.camera_inputs(bs, dtype, gen)
    theirs, mine = geometries(module, lss, args, extra)
    assert ctx.record.calls == 1 and "fallbacks" not in ctx.record.details, ctx.record.details
    assert mine.shape == (bs, 6, 118, 32, 88, 3) and mine.is_contiguous()
    assert_bitwise(mine, theirs)


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_camera_to_bev_equals_unpatched(project: tuple[Any, ActivationContext], bs: int, dtype: torch.dtype) -> None:
    """get_geometry then bev_pool, output and gradient to the features, patched vs original methods, every
    BEV cell: the geometry is upstream's bit for bit, so every point pools into upstream's voxel."""
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
    assert_bitwise(g_mine, g_theirs)
    # The stand-in's cumulative-sum trick over ~1M sorted points loses float32 precision (a voxel's sum
    # is the difference of two large running sums): its error, not ours, sets the float32 atol.
    tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(out_mine, out_theirs, **tol, msg=lambda m: f"seed {SEED}: {m}")
    torch.testing.assert_close(gx_mine, gx_theirs, **tol, msg=lambda m: f"seed {SEED}: {m}")


def _rot_z(angle: float) -> torch.Tensor:
    c, s = math.cos(angle), math.sin(angle)
    return torch.tensor([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)


def face_inputs(bs: int, dtype: torch.dtype, gen: torch.Generator, dx: float = 0.3,
                cams: int = 4) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """A rig whose frustum points lie on voxel faces in exact arithmetic (float rounding decides the voxel).

    Cameras look along +x, +y, -x, -y; each sample's camera2lidar rotation carries a random yaw that
    its lidar augmentation (``extra_rots``) undoes, and every translation along the BEV axes is a
    multiple of ``dx``. With depth bins on multiples of ``dx``, the coordinate along the optical axis
    is depth + translation: a voxel face, reached through rotations that do not cancel in float.
    Random intrinsics and image augmentation (scale, rotation, shift) as BEVFusion's.
    """
    f64 = torch.float64
    mounts = []
    for k in range(cams):
        c, s = round(math.cos(k * math.pi / 2)), round(math.sin(k * math.pi / 2))
        mounts.append(torch.tensor([[s, -c, 0], [0, 0, -1], [c, s, 0]], dtype=f64).T)  # columns: right, down, fwd
    mount = torch.stack(mounts)
    rots, trans, extra_rots, extra_trans = [], [], [], []
    for _ in range(bs):
        yaw = (torch.rand(1, generator=gen, dtype=f64).item() * 2 - 1) * math.radians(22.5)
        offset = torch.randint(-8, 9, (cams, 3), generator=gen).to(f64) * dx
        offset[:, 2] = 1.0 + torch.rand(cams, generator=gen, dtype=f64)
        rots.append(_rot_z(-yaw) @ mount)
        trans.append((_rot_z(-yaw) @ offset[..., None])[..., 0])
        extra_rots.append(_rot_z(yaw))
        shift = torch.randint(-8, 9, (2,), generator=gen).to(f64) * dx
        extra_trans.append(torch.cat([shift, torch.zeros(1, dtype=f64)]))
    intrins = torch.zeros(bs, cams, 3, 3, dtype=f64)
    focal = 1260 + torch.randn(bs, cams, generator=gen, dtype=f64) * 20
    intrins[..., 0, 0], intrins[..., 1, 1], intrins[..., 2, 2] = focal, focal, 1.0
    intrins[..., 0, 2] = 800 + torch.randn(bs, cams, generator=gen, dtype=f64) * 5
    intrins[..., 1, 2] = 450 + torch.randn(bs, cams, generator=gen, dtype=f64) * 5
    scale = 0.38 + torch.rand(bs, cams, generator=gen, dtype=f64) * 0.17
    angle = (torch.rand(bs, cams, generator=gen, dtype=f64) * 2 - 1) * math.radians(5.4)
    post_rots = torch.eye(3, dtype=f64).repeat(bs, cams, 1, 1)
    post_rots[..., :2, :2] = torch.stack([torch.stack([angle.cos(), -angle.sin()], -1),
                                          torch.stack([angle.sin(), angle.cos()], -1)], -2) * scale[..., None, None]
    post_trans = torch.zeros(bs, cams, 3, dtype=f64)
    post_trans[..., :2] = torch.randn(bs, cams, 2, generator=gen, dtype=f64) * 20
    args = tuple(t.to(dtype) for t in (torch.stack(rots), torch.stack(trans), intrins, post_rots, post_trans))
    return args, {"extra_rots": torch.stack(extra_rots).to(dtype), "extra_trans": torch.stack(extra_trans).to(dtype)}


def near_face(lss: Any, geom: torch.Tensor, ulps: int) -> torch.Tensor:
    """Per point and axis: moving the coordinate by at most ``ulps`` ulps changes its voxel (as bev_pool
    quantises, in the geometry's dtype)."""
    v = voxels(lss, geom)
    near = torch.zeros(geom.shape, dtype=torch.bool)
    for direction in (math.inf, -math.inf):
        moved = geom
        for _ in range(ulps):
            moved = torch.nextafter(moved, torch.full_like(moved, direction))
            near |= voxels(lss, moved) != v
    return near


def test_geometry_near_voxel_faces_is_upstreams_bit_for_bit(project: tuple[Any, ActivationContext]) -> None:
    """Voxel re-binning, float32: on a rig that puts most in-grid points within 4 ulps of a voxel face
    (checked), the patched geometry equals upstream's bit for bit, and so do the voxels bev_pool
    quantises to. (The folded-affine geometry this replaced moved ~18% of the in-grid points here.)"""
    module, ctx = project
    dtype = torch.float32
    gen = torch.Generator().manual_seed(SEED + 30)
    lss = module.LSSTransform(256, 8, (256, 704), (16, 44), *BOUNDS, (-10.0, 10.0, 20.0), (1.2, 48.0, 0.3)).to(dtype)
    args, extra = face_inputs(2, dtype, gen)
    theirs, mine = geometries(module, lss, args, extra)
    assert ctx.record.calls == 1
    v_theirs, v_mine = voxels(lss, theirs), voxels(lss, mine)
    inside = ((v_theirs >= 0) & (v_theirs < lss.nx)).all(-1)
    near = near_face(lss, theirs, 4).any(-1) & inside
    moved = (v_mine != v_theirs).any(-1) & inside
    print(f"seed {SEED} {dtype}: {int(inside.sum())} of {inside.numel()} points in the grid, {int(near.sum())} "
          f"within 4 ulps of a face; {int(moved.sum())} change voxel, "
          f"{int((bits(mine) != bits(theirs)).any(-1).sum())} change bits")
    assert inside.sum() >= 0.5 * inside.numel() and near.sum() >= 0.5 * inside.sum(), "the rig misses the faces"
    assert torch.equal(v_mine, v_theirs), f"seed {SEED}: {int(moved.sum())} in-grid points change voxel"
    assert_bitwise(mine, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_get_geometry_keyword_arguments_and_fallbacks(project: tuple[Any, ActivationContext],
                                                      dtype: torch.dtype) -> None:
    """No extra_rots / extra_trans, or only one: bit for bit as upstream reads them. Mixed dtypes and
    inputs that need gradients: the original method runs (and raises where it raises), counted as a
    fallback with its reason."""
    module, ctx = project
    gen = torch.Generator().manual_seed(SEED + 20)
    lss = module.LSSTransform(256, 80, (256, 704), (8, 22), *BOUNDS, (-10.0, 10.0, 20.0), (1.0, 60.0, 2.0)).to(dtype)
    args, extra = upstream.camera_inputs(2, dtype, gen)
    for kwargs in ({}, {"extra_rots": extra["extra_rots"]}, {"extra_trans": extra["extra_trans"]}, extra):
        assert_bitwise(*reversed(geometries(module, lss, args, kwargs)))
    assert ctx.record.calls == 4 and "fallbacks" not in ctx.record.details, ctx.record.details
    other = torch.float32 if dtype == torch.float64 else torch.float64
    mixed = (args[0].to(other), *args[1:])  # rotations in another dtype: upstream's error
    with pytest.raises(RuntimeError):
        module.BaseTransform.get_geometry.__wrapped__(lss, *mixed, **extra)
    with pytest.raises(RuntimeError):
        module.BaseTransform.get_geometry(lss, *mixed, **extra)
    rots = args[0].clone().requires_grad_()  # a gradient through the matrices: upstream's autograd graph
    for fn in (module.BaseTransform.get_geometry.__wrapped__, module.BaseTransform.get_geometry):
        fn(lss, rots, *args[1:], **extra).sum().backward()
    assert ctx.record.calls == 4, "mixed dtypes and gradients must run the original"
    assert set(ctx.record.details["fallbacks"]) == {"get_geometry: not all float32 or all float64",
                                                    "get_geometry: inputs require grad"}
    lss.float()  # the frustum in float32, the matrices in float64: upstream promotes
    theirs, mine = geometries(module, lss, tuple(a.double() for a in args), {k: v.double() for k, v in extra.items()})
    assert mine.dtype == theirs.dtype == torch.float64
    assert_bitwise(mine, theirs)
    assert ctx.record.calls == 4
    assert ctx.record.details["fallbacks"]["get_geometry: not all float32 or all float64"] == 2


def _signed_small(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Entries from {-1, -0, +0, 1, 2}: products and sums that are exact zeros of either sign."""
    values = torch.tensor([-1.0, -0.0, 0.0, 1.0, 2.0])
    return values[torch.randint(0, 5, shape, generator=gen)]


def _invertible(n: int, gen: torch.Generator) -> torch.Tensor:
    while True:
        m = _signed_small((1, n, 3, 3), gen)
        if bool((torch.linalg.det(m.double()).abs() > 0.5).all()):  # integer determinants: exactly nonzero
            return m


def test_get_geometry_signed_zeros(project: tuple[Any, ActivationContext]) -> None:
    """200 rigs of small integer matrices with signed zeros on a frustum with zero coordinates (u, v and
    depth 0), each with every keyword combination: most coordinates are exact, many are exact zeros,
    whose sign upstream's ``0 + ...`` accumulation fixes (every other rig's extra_trans is all -0, where
    a -0 sum would survive). Every bit equal."""
    module, ctx = project
    lss = module.LSSTransform(256, 8, (5, 6), (5, 6), *BOUNDS, (-10.0, 10.0, 20.0), (0.0, 3.0, 1.0))
    gen = torch.Generator().manual_seed(SEED + 60)
    zeros = 0
    for rig in range(200):
        args = (_invertible(2, gen), _signed_small((1, 2, 3), gen), _invertible(2, gen), _invertible(2, gen),
                _signed_small((1, 2, 3), gen))
        extra = {"extra_rots": _invertible(1, gen)[0],
                 "extra_trans": _signed_small((1, 3), gen) if rig % 2 else torch.full((1, 3), -0.0)}
        for kwargs in ({}, {"extra_rots": extra["extra_rots"]}, {"extra_trans": extra["extra_trans"]}, extra):
            theirs, mine = geometries(module, lss, args, kwargs)
            zeros += int((theirs == 0).sum())
            assert_bitwise(mine, theirs)
    assert ctx.record.calls == 800
    assert zeros > 10_000, zeros


def test_get_geometry_of_a_frustum_that_is_not_a_grid(tmp_path: Path) -> None:
    """A create_frustum of a fork that jitters each point: the general path (no per-axis products), bit for bit."""
    old = "        return nn.Parameter(torch.stack((u, v, depth), -1), requires_grad=False)\n"
    new = ("        jitter = torch.rand(D, fH, fW, 3, generator=torch.Generator().manual_seed(7))\n"
           "        frustum = torch.stack((u, v, depth), -1) + jitter * 1e-3\n"
           "        return nn.Parameter(frustum, requires_grad=False)\n")
    fork = TRANSFORMS.replace(old, new)
    assert fork != TRANSFORMS
    for module, ctx in load(tmp_path, "lk_bevfusion_jitter", fork):
        gen = torch.Generator().manual_seed(SEED + 40)
        lss = module.LSSTransform(256, 8, (256, 704), (16, 44), *BOUNDS, (-10.0, 10.0, 20.0), (1.0, 60.0, 1.0))
        frustum = lss.frustum
        assert not torch.equal(frustum[0, ..., 0], frustum[1, ..., 0]), "the fork's frustum is still a grid"
        args, extra = upstream.camera_inputs(2, torch.float32, gen)
        assert_bitwise(*reversed(geometries(module, lss, args, extra)))
        assert ctx.record.calls == 1


def test_get_geometry_after_the_frustum_changes_in_place(project: tuple[Any, ActivationContext]) -> None:
    """A grid frustum, then one point of its last depth bin moved through ``.data`` (no version bump): the
    grid is re-checked at every call, so the second call takes the general path, still bit for bit."""
    module, ctx = project
    gen = torch.Generator().manual_seed(SEED + 45)
    lss = module.LSSTransform(256, 8, (256, 704), (16, 44), *BOUNDS, (-10.0, 10.0, 20.0), (1.0, 60.0, 1.0))
    args, extra = upstream.camera_inputs(1, torch.float32, gen)
    assert_bitwise(*reversed(geometries(module, lss, args, extra)))
    lss.frustum.data[-1, -1, -1, 0] += 0.5
    theirs, mine = geometries(module, lss, args, extra)
    assert_bitwise(mine, theirs)
    assert ctx.record.calls == 2


def test_self_check_keeps_upstream_when_rounding_differs(project: tuple[Any, ActivationContext],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Should the elementwise formulation round otherwise than upstream's matmuls (simulated: a last-bit
    change), the first call's self-check finds it and upstream's method runs, counted as a fallback."""
    from loongkit_ops.patches import bevfusion

    module, ctx = project
    exact = bevfusion.exact_geometry
    monkeypatch.setattr(bevfusion, "exact_geometry",
                        lambda *a, **k: torch.nextafter(exact(*a, **k), torch.tensor(math.inf)))
    gen = torch.Generator().manual_seed(SEED + 50)
    lss = module.LSSTransform(256, 8, (256, 704), (8, 22), *BOUNDS, (-10.0, 10.0, 20.0), (1.0, 60.0, 2.0))
    args, extra = upstream.camera_inputs(1, torch.float32, gen)
    for _ in range(2):
        assert_bitwise(*reversed(geometries(module, lss, args, extra)))
    assert ctx.record.calls == 0
    assert ctx.record.details["fallbacks"] == {
        "get_geometry: this torch build's matmul rounds otherwise (self-check)": 2}


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


def test_fork_registered_before_activation_is_not_applicable(tmp_path: Path, loongkit_runtime: Any) -> None:
    """Through the runtime: a fork whose bev_pool and get_geometry both differ registers before the feature
    activates; the registry watch finds it while activating and the row ends NOT APPLICABLE (the runtime
    does not overwrite it with APPLIED)."""
    fork = (TRANSFORMS.replace("        final = torch.cat(x.unbind(dim=2), 1)\n",
                               "        final = torch.cat(x.unbind(dim=2), 1).relu()\n")
            .replace("cam2lidar = camera2lidar_rots.matmul(torch.inverse(intrins))",
                     "cam2lidar = camera2lidar_rots.matmul(torch.linalg.inv(intrins))"))
    assert fork.count("relu") > TRANSFORMS.count("relu") and "linalg" in fork
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(write_project(tmp_path, "lk_bevfusion_fork_early", fork))
        rt = loongkit_runtime({"LOONGKIT_BEVFUSION": "1"}, activate={"bevfusion": "mmengine.registry.registry"})
        record = rt.records["bevfusion"]
        skipped = record.details["skipped"]
        assert isinstance(skipped, dict) and sorted(skipped) == [
            f"{module.__name__}.BaseTransform.bev_pool", f"{module.__name__}.BaseTransform.get_geometry"]
        assert record.state == State.NOT_APPLICABLE and record.reason in skipped.values()
        assert record.to_json()["state"] == "not applicable"
        assert not hasattr(module.BaseTransform.bev_pool, "__wrapped__")
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith("lk_bevfusion_fork_early")]:
            del sys.modules[name]


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
