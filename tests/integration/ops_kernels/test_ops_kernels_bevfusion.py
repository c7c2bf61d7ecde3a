"""LOONGKIT_BEVFUSION: a vendored BEVFusion-style view transform, its bev_pool patched at registration.

The test writes a small ``projects/bevfusion_plugin`` package (written for this project from the
published BEVFusion algorithm: same public interface and maths, no upstream code): ``BaseTransform``
with ``bev_pool(geom_feats, x)`` and a registered ``LSSTransform`` subclass, plus a CPU stand-in for
the CUDA ``bev_pool`` extension (sort by voxel rank, cumulative-sum trick, scatter). Outputs and
gradients of the patched method equal the original's, for fresh random camera-branch inputs
(6 cameras, 80 channels, 360x360 BEV, points inside and outside the grid), batch 1 and 2.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
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
from loongkit_core.feature import FeatureRecord, State  # noqa: E402
from loongkit_core.log import get_logger  # noqa: E402

SEED = int(torch.seed() % 2**31)

TRANSFORMS = textwrap.dedent('''
    """BEVFusion-style view transforms written for loongkit's tests (interface and maths of the paper's code)."""
    import torch
    from torch import nn
    from mmengine.registry import Registry

    VTRANSFORMS = Registry("vtransforms")


    def bev_pool(feats, coords, B, D, H, W):
        """CPU stand-in for the CUDA extension: per-voxel sums via sort + cumulative sums -> [B, C, D, H, W]."""
        ranks = coords[:, 0] * (W * D * B) + coords[:, 1] * (D * B) + coords[:, 2] * B + coords[:, 3]
        order = ranks.argsort()
        feats, coords, ranks = feats[order], coords[order], ranks[order]
        sums = feats.cumsum(0)
        last = torch.ones(sums.shape[0], dtype=torch.bool)
        last[:-1] = ranks[1:] != ranks[:-1]
        sums, coords = sums[last], coords[last]
        sums = torch.cat((sums[:1], sums[1:] - sums[:-1]))
        out = sums.new_zeros(B, D, H, W, feats.shape[1])
        out[coords[:, 3], coords[:, 2], coords[:, 0], coords[:, 1]] = sums
        return out.permute(0, 4, 1, 2, 3).contiguous()


    def gen_dx_bx(xbound, ybound, zbound):
        rows = [xbound, ybound, zbound]
        dx = torch.tensor([r[2] for r in rows])
        bx = torch.tensor([r[0] + r[2] / 2.0 for r in rows])
        nx = torch.tensor([int(round((r[1] - r[0]) / r[2])) for r in rows], dtype=torch.long)
        return dx, bx, nx


    class BaseTransform(nn.Module):
        def __init__(self, in_channels, out_channels, image_size, feature_size, xbound, ybound, zbound, dbound):
            super().__init__()
            self.in_channels, self.C = in_channels, out_channels
            self.image_size, self.feature_size = image_size, feature_size
            dx, bx, nx = gen_dx_bx(xbound, ybound, zbound)
            self.dx = nn.Parameter(dx, requires_grad=False)
            self.bx = nn.Parameter(bx, requires_grad=False)
            self.nx = nn.Parameter(nx, requires_grad=False)

        def bev_pool(self, geom_feats, x):
            B, N, D, H, W, C = x.shape
            Nprime = B * N * D * H * W
            x = x.reshape(Nprime, C)
            geom_feats = ((geom_feats - (self.bx - self.dx / 2.0)) / self.dx).long()
            geom_feats = geom_feats.view(Nprime, 3)
            batch_ix = torch.cat([torch.full([Nprime // B, 1], ix, device=x.device, dtype=torch.long)
                                  for ix in range(B)])
            geom_feats = torch.cat((geom_feats, batch_ix), 1)
            kept = ((geom_feats[:, 0] >= 0) & (geom_feats[:, 0] < self.nx[0]) & (geom_feats[:, 1] >= 0)
                    & (geom_feats[:, 1] < self.nx[1]) & (geom_feats[:, 2] >= 0) & (geom_feats[:, 2] < self.nx[2]))
            x = x[kept]
            geom_feats = geom_feats[kept]
            x = bev_pool(x, geom_feats, B, self.nx[2], self.nx[0], self.nx[1])
            final = torch.cat(x.unbind(dim=2), 1)
            return final


    @VTRANSFORMS.register_module()
    class LSSTransform(BaseTransform):
        pass
''')


def write_project(root: Path, package: str, source: str = TRANSFORMS) -> str:
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    (root / package / "vtransforms.py").write_text(source)
    return f"{package}.vtransforms"


def activation() -> tuple[BevFusionPool, ActivationContext]:
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == "bevfusion")
    record = FeatureRecord(feature)
    record.state = State.APPLIED
    ctx = ActivationContext(record, None, get_logger("test"),  # type: ignore[arg-type]
                            lambda module, cb: cb(sys.modules[module]))
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


def test_fork_with_other_pooling_is_left_alone(tmp_path: Path) -> None:
    fork = TRANSFORMS.replace("        final = torch.cat(x.unbind(dim=2), 1)\n",
                              "        final = torch.cat(x.unbind(dim=2), 1).relu()\n")
    assert fork != TRANSFORMS
    for module, ctx in load(tmp_path, "lk_bevfusion_fork", fork):
        assert not hasattr(module.BaseTransform.bev_pool, "__wrapped__")
        reason = ctx.record.details["skipped"][f"{module.__name__}.BaseTransform"]
        assert "interface differs" in reason and "relu" in reason


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
        assert "no compiler" in ctx.record.details["skipped"][f"{module.__name__}.BaseTransform"]
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
x = torch.randn(1, 2, 3, 4, 11, 8, requires_grad=True)
m.bev_pool(torch.randn(1, 2, 3, 4, 11, 3) * 8, x).sum().backward()
"""


def test_end_to_end_summary(run_loongkit: Callable[..., Any], tmp_path: Path) -> None:
    write_project(tmp_path, "lk_bevfusion_e2e")
    result = run_loongkit(RUN.format(root=str(tmp_path)), env={"LOONGKIT_BEVFUSION": "1"})
    assert result.returncode == 0, result.stderr
    row = result.feature("bevfusion")
    assert row["active"] and row["calls"] == 1, row
