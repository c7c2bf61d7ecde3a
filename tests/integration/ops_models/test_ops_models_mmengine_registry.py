"""LOONGKIT_BEVFORMER / LOONGKIT_UNIAD with the real mmengine Registry (the mmcv 2.x stack) and mmcv's own
``multi_scale_deformable_attn_pytorch`` as the unpatched baseline: the test projects register into a
child of mmengine's MODELS, as mmdet3d 1.x ports of BEVFormer do.

Fresh random inputs each run (seed in failure messages); outputs and gradients with the feature on
equal the unpatched ones within 2e-5 (fp32), relative to the tensor's max.
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.integration

registry_mod = pytest.importorskip("mmengine.registry.registry")
pytest.importorskip("mmcv.ops.multi_scale_deform_attn")

from loongkit_ops import kernels  # noqa: E402
from loongkit_ops.plugin import plugin  # noqa: E402

from loongkit_core.context import ActivationContext  # noqa: E402

UNIT = Path(__file__).parents[2] / "unit" / "ops_models"
SEED = int(torch.seed() % 2**31)
TARGET = "mmengine.registry.registry"


def _load(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"lk_{name}_mmengine", UNIT / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kit = _load("models_testkit")


@pytest.fixture
def registries() -> Iterator[tuple[Any, Any]]:
    assert kernels.load() is not None, kernels.failure()
    from mmengine.registry import MODELS

    scope = f"lk_test_{SEED}_{len(MODELS.children)}"
    yield registry_mod.Registry("model", parent=MODELS, scope=scope), registry_mod.Registry("loss", scope=scope)
    MODELS.children.pop(scope, None)
    kit.remove_projects()


def activation(name: str) -> tuple[Any, ActivationContext]:
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == name)
    ctx = ActivationContext.standalone(feature, logger="test")
    return plugin.impl(feature).__class__(feature), ctx


@pytest.mark.parametrize("bs", [1, 2])
def test_bevformer_sca_and_tsa_equal_upstream(registries: tuple[Any, Any], bs: int) -> None:
    (bev,) = kit.install_projects(*registries)
    assert bev.multi_scale_deformable_attn_pytorch.__module__ == "mmcv.ops.multi_scale_deform_attn"
    gen = torch.Generator().manual_seed(SEED + bs)
    cfg = {"type": "MSDeformableAttention3D", "embed_dims": 256, "num_points": 8, "num_levels": 1}
    sca = registries[0].build({"type": "SpatialCrossAttention", "embed_dims": 256, "num_cams": 6, "dropout": 0.0,
                               "deformable_attention": cfg})
    kit.randomise(sca, gen)
    inputs = kit.camera_inputs(bs, torch.float32, gen, [(15, 25)])
    grad = torch.randn(bs, 2500, 256, generator=gen)
    impl, ctx = activation("bevformer")
    before, after = kit.compare(lambda: sca, lambda m: kit.run_sca(m, inputs, grad),
                                lambda: impl.activate(ctx, TARGET), lambda: impl.deactivate(ctx))
    kit.assert_same(before, after, torch.float32, SEED)
    assert ctx.record.calls >= 2 and len(ctx.record.details["patched"]) == 3, ctx.record  # type: ignore[arg-type]
    if bs == 1:  # BEVFormer's TSA runs with batch size 1 only
        tsa = registries[0].build({"type": "TemporalSelfAttention", "embed_dims": 256, "num_levels": 1,
                                   "dropout": 0.0})
        kit.randomise(tsa, gen)
        inputs = kit.tsa_inputs(1, torch.float32, gen)
        before, after = kit.compare(lambda: tsa, lambda m: kit.run_tsa(m, inputs, grad),
                                    lambda: impl.activate(ctx, TARGET), lambda: impl.deactivate(ctx))
        kit.assert_same(before, after, torch.float32, SEED)


def test_uniad_classes_patched_through_mmengine(registries: tuple[Any, Any]) -> None:
    _, uni = kit.install_projects(*registries, uniad=True)
    impl, ctx = activation("uniad")
    impl.activate(ctx, TARGET)
    try:
        names = {k.split(" ")[0] for k in ctx.record.details["patched"]}  # type: ignore[union-attr]
        assert names == {"SpatialCrossAttention", "TemporalSelfAttention", "MotionDeformableAttention",
                         "MSDeformableAttention3D", "CollisionLoss"}, ctx.record.details
        assert getattr(uni.CollisionLoss.forward, "__loongkit_feature__", None) == "uniad"
    finally:
        impl.deactivate(ctx)
    assert not hasattr(uni.CollisionLoss.forward, "__loongkit_feature__")


USER = """
import sys, types, torch
import importlib.util
from mmengine.registry import MODELS, Registry
sys.modules["lk_upstream_registry"] = reg = types.ModuleType("lk_upstream_registry")
reg.ATTENTION = Registry("model", parent=MODELS, scope="lk_user")
reg.LOSSES = Registry("loss", scope="lk_user")
spec = importlib.util.spec_from_file_location("lk_upstream_bevformer", PATH)
bev = importlib.util.module_from_spec(spec); sys.modules["lk_upstream_bevformer"] = bev; spec.loader.exec_module(bev)
if MISMATCH:
    @reg.ATTENTION.register_module(name="SpatialCrossAttention", force=True)
    class Other(torch.nn.Module):
        def forward(self, query, key, value):
            return query
else:
    cfg = dict(type="MSDeformableAttention3D", embed_dims=32, num_heads=4, num_points=4, num_levels=1)
    sca = reg.ATTENTION.build(dict(type="SpatialCrossAttention", embed_dims=32, num_cams=2, deformable_attention=cfg))
    q = torch.randn(1, 16, 32, requires_grad=True)
    kv = torch.randn(2, 12, 1, 32)
    out = sca(q, kv, kv, reference_points_cam=torch.rand(2, 1, 16, 2, 2), bev_mask=torch.rand(2, 1, 16, 2) > 0.3,
              spatial_shapes=torch.tensor([[3, 4]]), level_start_index=torch.tensor([0]))
    out.sum().backward()
"""


@pytest.mark.parametrize("mismatch", [False, True])
def test_end_to_end_summary(run_loongkit: Callable[..., Any], mismatch: bool) -> None:
    code = f"PATH, MISMATCH = {str(UNIT / 'upstream_bevformer_modules.py')!r}, {mismatch}\n" + USER
    result = run_loongkit(code, env={"LOONGKIT_BEVFORMER": "1"})
    assert result.returncode == 0, result.stderr
    row = result.feature("bevformer")
    assert TARGET in row["targets"], row
    if mismatch:
        assert "SpatialCrossAttention" in row["reason"] and "interface differs" in row["reason"], row
    else:
        assert row["active"] and row["calls"] >= 2 and not row["reason"], row
