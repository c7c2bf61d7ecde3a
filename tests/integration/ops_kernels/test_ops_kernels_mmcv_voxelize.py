"""LOONGKIT_VOXELIZATION against the real mmcv CPU kernel (mmcv 2.x in stack2, mmcv-full 1.x in stack1):
identical voxels, coordinates and counts for fresh random point clouds, hard (deterministic) and
dynamic, through ``voxelization`` and the ``Voxelization`` module."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

mmcv = pytest.importorskip("mmcv")
vox_mod = pytest.importorskip("mmcv.ops.voxelize")
# Runs in whichever stack is installed: marked stack1 on mmcv-full 1.x (nox -s stack1 runs `-m stack1`),
# plain integration on mmcv 2.x (nox -s stack2 runs `integration and not stack1`).
pytestmark = [pytest.mark.integration] + ([pytest.mark.stack1] if mmcv.__version__.startswith("1.") else [])

from loongkit_ops import kernels  # noqa: E402
from loongkit_ops.patches.voxelize import Voxelization as VoxelizationImpl  # noqa: E402
from loongkit_ops.plugin import plugin  # noqa: E402

from loongkit_core.context import ActivationContext, NotApplicable  # noqa: E402

SEED = int(torch.seed() % 2**31)
TARGET = "mmcv.ops.voxelize"
NUSCENES = ([0.075, 0.075, 0.2], [-54.0, -54.0, -5.0, 54.0, 54.0, 3.0])
KITTI = ([0.05, 0.05, 0.1], [0, -40, -3, 70.4, 40, 1])


@pytest.fixture(scope="module", autouse=True)
def ext() -> Any:
    module = kernels.load()
    assert module is not None, kernels.failure()
    return module


def activation() -> tuple[VoxelizationImpl, ActivationContext]:
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == "voxelization")
    ctx = ActivationContext.standalone(feature, logger="test")
    return VoxelizationImpl(feature), ctx


def cloud(gen: torch.Generator, n: int, rng: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A lidar-like cloud: dense near the sensor, some points outside the range, some on voxel edges."""
    lo, hi = torch.tensor(rng[:3]), torch.tensor(rng[3:])
    centre = (lo + hi) / 2
    r = torch.rand(n, generator=gen) ** 2 * (hi[0] - lo[0]) * 0.6
    phi = torch.rand(n, generator=gen) * 6.2832
    xyz = torch.stack([centre[0] + r * phi.cos(), centre[1] + r * phi.sin(),
                       lo[2] + torch.rand(n, generator=gen) * (hi[2] - lo[2]) * 1.1], 1)
    pts = torch.cat([xyz, torch.rand(n, 2, generator=gen)], 1)
    pts[::53, :3] = pts[::53, :3].round()  # exactly on voxel boundaries
    pts[::101, 0] = hi[0]  # on the upper edge: outside
    return pts.to(dtype)


def run_both(fn: Callable[[], Any]) -> tuple[Any, Any, int]:
    expected = fn()
    impl, ctx = activation()
    impl.activate(ctx, TARGET)
    try:
        got = fn()
        calls = ctx.record.calls
    finally:
        impl.deactivate(ctx)
    return expected, got, calls


def assert_identical(got: Any, expected: Any) -> None:
    got = got if isinstance(got, tuple) else (got,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, e.dtype, g.shape, e.shape)
        assert torch.equal(g, e), f"seed {SEED}"


CASES = [  # (grid, points, max_points, max_voxels)
    (NUSCENES, 40000, 10, 90000),
    (NUSCENES, 40000, 10, 3000),  # the max_voxels cap drops voxels (and every later point of them)
    (KITTI, 20000, 5, 16000),
    (KITTI, 5000, 1, 20000),
    (NUSCENES, 3000, 64, 10),
    (NUSCENES, 0, 10, 100),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=[f"n{c[1]}-mp{c[2]}-mv{c[3]}" for c in CASES])
def test_hard_voxelize_identical(dtype: torch.dtype, case: tuple) -> None:
    (size, rng), n, max_points, max_voxels = case
    gen = torch.Generator().manual_seed(SEED)
    pts = cloud(gen, n, rng, dtype)
    if n:
        pts[7, 1] = float("nan")  # dropped by both
    expected, got, calls = run_both(lambda: vox_mod.voxelization(pts, size, rng, max_points, max_voxels, True))
    assert calls == 1
    assert_identical(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dynamic_voxelize_identical(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(SEED)
    pts = cloud(gen, 30000, NUSCENES[1], dtype)
    expected, got, calls = run_both(lambda: (vox_mod.voxelization(pts, *NUSCENES, -1, 20000, True),
                                             vox_mod.voxelization(pts, *NUSCENES, 10, -1, True)))
    assert calls == 2
    assert_identical(got, expected)


def test_module_train_and_eval_caps() -> None:
    gen = torch.Generator().manual_seed(SEED)
    pts = cloud(gen, 60000, NUSCENES[1])
    layer = vox_mod.Voxelization(*NUSCENES, max_num_points=10, max_voxels=(4000, 9000))

    def both_modes() -> tuple:
        return (*layer.train()(pts), *layer.eval()(pts))

    expected, got, calls = run_both(both_modes)
    assert calls == 2
    assert_identical(got, expected)
    assert got[0].shape[0] == 4000 and got[3].shape[0] == 9000  # both caps reached on this cloud


def test_tensor_and_tuple_grid_arguments() -> None:
    gen = torch.Generator().manual_seed(SEED)
    pts = cloud(gen, 8000, KITTI[1])
    size, rng = torch.tensor(KITTI[0], dtype=torch.float64), tuple(KITTI[1])
    expected, got, calls = run_both(lambda: vox_mod.voxelization(pts, size, rng, 5, 5000, True))
    assert calls == 1
    assert_identical(got, expected)


def test_unsupported_calls_run_mmcv() -> None:
    gen = torch.Generator().manual_seed(SEED)
    pts = cloud(gen, 1000, KITTI[1])
    impl, ctx = activation()
    impl.activate(ctx, TARGET)
    try:
        original = ctx.patcher.original(vox_mod._Voxelization, "forward")
        assert isinstance(original, staticmethod)
        with pytest.raises(Exception) as ours:  # whatever mmcv raises, unchanged
            vox_mod.voxelization(pts.bfloat16(), *KITTI, 5, 100, True)
        with pytest.raises(type(ours.value)):
            original.__func__(None, pts.bfloat16(), *KITTI, 5, 100, True)
        assert ctx.record.calls == 0
    finally:
        impl.deactivate(ctx)
    assert vox_mod._Voxelization.__dict__["forward"] is original


def test_interface_differs_is_not_applicable(monkeypatch: pytest.MonkeyPatch) -> None:
    class _Voxelization(torch.autograd.Function):  # an older/forked signature without `deterministic`
        @staticmethod
        def forward(ctx: Any, points: Any, voxel_size: Any, coors_range: Any, max_points: int = 35,
                    max_voxels: int = 20000) -> Any:
            return points

    fake = types.ModuleType("fake_voxelize")
    fake.__dict__.update(_Voxelization=_Voxelization, voxelization=_Voxelization.apply,
                         Voxelization=vox_mod.Voxelization)
    monkeypatch.setitem(sys.modules, "fake_voxelize", fake)
    impl, ctx = activation()
    with pytest.raises(NotApplicable, match=r"interface differs: _Voxelization\.forward"):
        impl.activate(ctx, "fake_voxelize")
    monkeypatch.setitem(sys.modules, "fake_voxelize2", types.ModuleType("fake_voxelize2"))
    with pytest.raises(NotApplicable, match="lacks"):
        impl.activate(ctx, "fake_voxelize2")
    assert not ctx.patcher.patched


RUN = """
import torch
from mmcv.ops import Voxelization
pts = torch.rand(20000, 5) * torch.tensor([70.0, 80.0, 4.0, 1.0, 1.0]) - torch.tensor([0.0, 40.0, 3.0, 0.0, 0.0])
layer = Voxelization([0.05, 0.05, 0.1], [0, -40, -3, 70.4, 40, 1], 5, (16000, 40000))
voxels, coors, num = layer(pts)
assert voxels.shape[0] == coors.shape[0] == num.shape[0] > 0
"""


def test_end_to_end_summary(run_loongkit: Callable[..., Any]) -> None:
    result = run_loongkit(argv=[sys.executable, "-c", RUN], env={"LOONGKIT_ALL": "3"})
    assert result.returncode == 0, result.stderr
    row = result.feature("voxelization")
    assert row["active"] and row["calls"] == 1, row


def test_end_to_end_torch_out_of_range(run_loongkit: Callable[..., Any], tmp_path: Path) -> None:
    site = tmp_path / "site"
    meta = site / "torch-2.3.1.dist-info"  # first on sys.path: the metadata says torch 2.3.1
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.3.1\n")
    result = run_loongkit(argv=[sys.executable, "-c", RUN],
                          env={"LOONGKIT_VOXELIZATION": "1", "PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    row = result.feature("voxelization")
    assert row["state"] == "not applicable" and "2.3.1" in row["reason"], row


def test_apply_undo_apply() -> None:
    """The default deactivate (ctx.patcher.undo()) leaves mmcv's _Voxelization exactly as found; applying
    again patches again."""
    module = sys.modules[TARGET]
    prior = dict(vars(module._Voxelization))
    impl, ctx = activation()
    points = cloud(torch.Generator().manual_seed(SEED), 500, NUSCENES[1])
    for round_ in (1, 2):
        impl.activate(ctx, TARGET)
        assert vars(module._Voxelization)["forward"] is not prior["forward"]
        module.voxelization(points, *NUSCENES, 10, 2000, True)
        assert ctx.record.calls == round_
        impl.deactivate(ctx)
        assert dict(vars(module._Voxelization)) == prior and len(ctx.patcher) == 0
