"""LOONGKIT_BEVFORMER's registry part against BEVFormer-style test modules registered in an mmcv 1.x
Registry double (mmcv-full 1.x is not installed here; the mmengine path is in the integration tests).

Fresh random inputs each run (seed in failure messages); outputs and every gradient with the feature
on must equal the unpatched module's within 2e-5 (fp32) / 1e-10 (fp64), relative to the tensor's max.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from loongkit_ops import kernels
from loongkit_ops.patches import registry
from loongkit_ops.plugin import plugin

from loongkit_core.context import ActivationContext

HERE = Path(__file__).parent
SEED = int(torch.seed() % 2**31)
TARGET = "mmcv.utils.registry"


def _load(name: str) -> types.ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"lk_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kit = _load("models_testkit")
double = _load("mmcv1_registry_double")
TINY = [(15, 25)]
BASE = [(116, 200), (58, 100), (29, 50), (15, 25)]


@pytest.fixture(scope="module", autouse=True)
def ext() -> Any:
    module = kernels.load()
    assert module is not None, kernels.failure()
    return module


@pytest.fixture
def mmcv1(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A fresh ``mmcv.utils.registry`` (the double) per test, and no test project left behind."""
    fake = types.ModuleType(TARGET)
    fake.Registry = type("Registry", (double.Registry,), {})  # type: ignore[attr-defined]  # fresh class per test
    for parent in ("mmcv", "mmcv.utils"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, TARGET, fake)
    yield fake
    kit.remove_projects()


def activation(name: str = "bevformer") -> tuple[Any, ActivationContext]:
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == name)
    ctx = ActivationContext.standalone(feature, logger="test")
    return plugin.impl(feature).__class__(feature), ctx


def projects(mmcv1: types.ModuleType, uniad: bool = False) -> tuple[types.ModuleType, ...]:
    return kit.install_projects(mmcv1.Registry("attention"), mmcv1.Registry("loss"), uniad=uniad)


def test_classes_registered_after_activation_are_patched(mmcv1: types.ModuleType) -> None:
    impl, ctx = activation()
    original_register = mmcv1.Registry._register_module
    impl.activate(ctx, TARGET)
    try:
        assert mmcv1.Registry._register_module is not original_register
        (bev,) = projects(mmcv1)
        assert getattr(bev.SpatialCrossAttention.forward, "__loongkit_feature__", None) == "bevformer"
        assert getattr(bev.multi_scale_deformable_attn_pytorch, "__loongkit_original__", None) is not None
        patched = ctx.record.details["patched"]
        assert {k.split(" ")[0] for k in patched} == {"SpatialCrossAttention", "MSDeformableAttention3D",  # type: ignore[attr-defined]
                                                      "TemporalSelfAttention"}
        assert ctx.record.reason == ""
    finally:
        impl.deactivate(ctx)
    assert mmcv1.Registry._register_module is original_register  # the registry class is as found
    assert not hasattr(bev.SpatialCrossAttention.forward, "__loongkit_feature__")
    assert not hasattr(bev.multi_scale_deformable_attn_pytorch, "__loongkit_original__")


def test_classes_registered_before_activation_are_found(mmcv1: types.ModuleType) -> None:
    (bev,) = projects(mmcv1)
    impl, ctx = activation()
    impl.activate(ctx, TARGET)
    try:
        assert getattr(bev.SpatialCrossAttention.forward, "__loongkit_feature__", None) == "bevformer"
        assert len(ctx.record.details["patched"]) == 3  # type: ignore[arg-type]
    finally:
        impl.deactivate(ctx)


def test_registration_call_form_and_other_names(mmcv1: types.ModuleType) -> None:
    impl, ctx = activation()
    impl.activate(ctx, TARGET)
    try:
        (bev,) = projects(mmcv1)
        registry = mmcv1.Registry("other")
        registry.register_module(name="SomethingElse", module=torch.nn.Linear)  # not watched: ignored
        assert "nn.Linear" not in str(ctx.record.details)
        registry.register_module(name="SpatialCrossAttention", module=bev.SpatialCrossAttention, force=True)
        assert len(ctx.record.details["patched"]) == 3  # type: ignore[arg-type]  # same class: patched once
    finally:
        impl.deactivate(ctx)


def sca_module(bev: types.ModuleType, levels: list[tuple[int, int]], dtype: torch.dtype, gen: torch.Generator,
               cls: Any = None) -> Any:
    cfg = {"type": "MSDeformableAttention3D", "embed_dims": 256, "num_points": 8, "num_levels": len(levels)}
    module = (cls or bev.SpatialCrossAttention)(embed_dims=256, num_cams=6, dropout=0.0,
                                                deformable_attention=cfg).to(dtype)
    kit.randomise(module, gen)
    return module


def check_sca(mmcv1: types.ModuleType, bs: int, dtype: torch.dtype, levels: list[tuple[int, int]],
              feature: str = "bevformer", uniad: bool = False) -> ActivationContext:
    mods = projects(mmcv1, uniad=uniad)
    gen = torch.Generator().manual_seed(SEED + bs)
    module = sca_module(mods[0], levels, dtype, gen, cls=mods[-1].SpatialCrossAttention)
    inputs = kit.camera_inputs(bs, dtype, gen, levels)
    grad = torch.randn(bs, 2500, 256, generator=gen, dtype=dtype)
    impl, ctx = activation(feature)
    before, after = kit.compare(lambda: module, lambda m: kit.run_sca(m, inputs, grad),
                                lambda: impl.activate(ctx, TARGET), lambda: impl.deactivate(ctx))
    kit.assert_same(before, after, dtype, SEED)
    assert ctx.record.calls >= 2, ctx.record  # the SCA fast path and the fused op both ran
    assert "fallbacks" not in ctx.record.details, ctx.record.details
    msda3d = [v for k, v in ctx.record.details["patched"].items() if k.startswith("MSDeformableAttention3D")]  # type: ignore[union-attr]
    assert msda3d and all("ms_deform_attn_fused" in v for v in msda3d), ctx.record.details
    return ctx


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sca_tiny_equals_upstream(mmcv1: types.ModuleType, bs: int, dtype: torch.dtype) -> None:
    check_sca(mmcv1, bs, dtype, TINY)


def test_sca_base_levels_equals_upstream(mmcv1: types.ModuleType) -> None:
    check_sca(mmcv1, 1, torch.float32, BASE)


def test_tsa_tiny_equals_upstream(mmcv1: types.ModuleType) -> None:
    (bev,) = projects(mmcv1)
    for dtype in (torch.float32, torch.float64):
        gen = torch.Generator().manual_seed(SEED)
        module = bev.TemporalSelfAttention(embed_dims=256, num_levels=1, dropout=0.0).to(dtype)
        kit.randomise(module, gen)
        inputs = kit.tsa_inputs(1, dtype, gen)
        grad = torch.randn(1, 2500, 256, generator=gen, dtype=dtype)
        impl, ctx = activation()
        before, after = kit.compare(lambda m=module: m, lambda m, i=inputs, g=grad: kit.run_tsa(m, i, g),
                                    lambda i=impl, c=ctx: i.activate(c, TARGET), lambda i=impl, c=ctx: i.deactivate(c))
        kit.assert_same(before, after, dtype, SEED)
        assert ctx.record.calls == 1
        assert "fallbacks" not in ctx.record.details, ctx.record.details
        assert "ms_deform_attn_fused" in str(ctx.record.details["patched"])


def test_tsa_first_frame_and_padding_mask(mmcv1: types.ModuleType) -> None:
    """No previous BEV (value None: [current, current]) and a key padding mask, fp64."""
    (bev,) = projects(mmcv1)
    gen = torch.Generator().manual_seed(SEED)
    module = bev.TemporalSelfAttention(embed_dims=64, num_heads=4, num_levels=1, dropout=0.0).double()
    kit.randomise(module, gen, scale=0.2)
    inputs = kit.tsa_inputs(1, torch.float64, gen, bev=12, dims=64)
    mask = torch.rand(2, 144, generator=gen) < 0.2
    grad = torch.randn(1, 144, 64, generator=gen, dtype=torch.float64)

    def run(m: Any) -> list[torch.Tensor]:
        m.zero_grad()
        query = inputs["query"].clone().requires_grad_()
        out = m(query, None, None, query_pos=inputs["query_pos"], key_padding_mask=mask,
                reference_points=inputs["reference_points"], spatial_shapes=inputs["spatial_shapes"],
                level_start_index=inputs["level_start_index"])
        out.backward(grad)
        return [out.detach(), query.grad, *(p.grad.clone() for p in m.parameters())]

    impl, ctx = activation()
    before, after = kit.compare(lambda: module, run, lambda: impl.activate(ctx, TARGET), lambda: impl.deactivate(ctx))
    kit.assert_same(before, after, torch.float64, SEED)
    assert ctx.record.calls == 1 and "fallbacks" not in ctx.record.details, ctx.record


@pytest.mark.parametrize("batch_first", [True, False])
def test_msda3d_alone_equals_upstream(mmcv1: types.ModuleType, batch_first: bool) -> None:
    """MSDeformableAttention3D called directly (not from SCA): bs 2, query_pos, padding mask, both layouts."""
    (bev,) = projects(mmcv1)
    gen = torch.Generator().manual_seed(SEED)
    module = bev.MSDeformableAttention3D(embed_dims=64, num_heads=4, num_levels=2, num_points=6,
                                         batch_first=batch_first).double()
    kit.randomise(module, gen, scale=0.2)
    shapes = torch.tensor([[6, 7], [3, 4]])
    starts = torch.tensor([0, 42])
    query = torch.randn(2, 30, 64, generator=gen, dtype=torch.float64)
    value = torch.randn(2, 54, 64, generator=gen, dtype=torch.float64)
    ref = torch.rand(2, 30, 3, 2, generator=gen, dtype=torch.float64)  # 3 Z anchors, 6 points
    mask = torch.rand(2, 54, generator=gen) < 0.2
    grad = torch.randn(2, 30, 64, generator=gen, dtype=torch.float64)
    if not batch_first:
        query, value, grad = query.transpose(0, 1), value.transpose(0, 1), grad.transpose(0, 1)

    def run(m: Any) -> list[torch.Tensor]:
        m.zero_grad()
        q, v = query.clone().requires_grad_(), value.clone().requires_grad_()
        out = m(q, None, v, query_pos=q * 0.5, key_padding_mask=mask, reference_points=ref, spatial_shapes=shapes,
                level_start_index=starts)
        out.backward(grad)
        return [out.detach(), q.grad, v.grad, *(p.grad.clone() for p in m.parameters())]

    impl, ctx = activation()
    before, after = kit.compare(lambda: module, run, lambda: impl.activate(ctx, TARGET), lambda: impl.deactivate(ctx))
    kit.assert_same(before, after, torch.float64, SEED)
    assert ctx.record.calls == 1 and "fallbacks" not in ctx.record.details, ctx.record


def test_sca_with_a_hooked_inner_module_calls_it(mmcv1: types.ModuleType) -> None:
    """A forward hook on SCA's MSDeformableAttention3D: SCA calls the module (hook runs), same results."""
    (bev,) = projects(mmcv1)
    gen = torch.Generator().manual_seed(SEED)
    module = sca_module(bev, TINY, torch.float64, gen)
    seen: list[int] = []
    module.deformable_attention.register_forward_hook(lambda m, args, out: seen.append(1))
    inputs = kit.camera_inputs(1, torch.float64, gen, TINY, bev=12)
    grad = torch.randn(1, 144, 256, generator=gen, dtype=torch.float64)
    impl, ctx = activation()
    before, after = kit.compare(lambda: module, lambda m: kit.run_sca(m, inputs, grad),
                                lambda: impl.activate(ctx, TARGET), lambda: impl.deactivate(ctx))
    kit.assert_same(before, after, torch.float64, SEED)
    assert len(seen) == 2 and ctx.record.calls == 2, (seen, ctx.record)  # SCA fast path + the inner fused forward


FORK = """
from lk_upstream_bevformer import ATTENTION, multi_scale_deformable_attn_pytorch
from lk_upstream_bevformer import TemporalSelfAttention as Base


@ATTENTION.register_module(force=True)
class TemporalSelfAttention(Base):
    def forward(self, query, key=None, value=None, identity=None, query_pos=None, key_padding_mask=None,
                reference_points=None, spatial_shapes=None, level_start_index=None, flag="decoder", **kwargs):
        _ = (self.sampling_offsets, self.attention_weights, self.value_proj, self.output_proj,
             multi_scale_deformable_attn_pytorch)
        return 0.5 * super().forward(query, key, value, identity, query_pos, key_padding_mask, reference_points,
                                     spatial_shapes, level_start_index, flag, **kwargs)
"""


def test_fork_without_upstream_maths_keeps_its_forward(mmcv1: types.ModuleType, tmp_path: Path) -> None:
    """A TSA whose forward does not show upstream's expressions: only its sampling kernel is swapped."""
    projects(mmcv1)
    (tmp_path / "lk_fork_tsa.py").write_text(FORK)
    impl, ctx = activation()
    impl.activate(ctx, TARGET)
    try:
        fork = kit.load_file(tmp_path / "lk_fork_tsa.py", "lk_fork_tsa")
        mine = ctx.record.details["patched"]["TemporalSelfAttention (lk_fork_tsa)"]  # type: ignore[index]
        assert "own forward kept" in mine and "source lacks" in mine, mine
        assert "forward" not in vars(fork.TemporalSelfAttention) or not hasattr(
            fork.TemporalSelfAttention.forward, "__loongkit_fused__")
        assert getattr(fork.multi_scale_deformable_attn_pytorch, "__loongkit_original__", None) is not None
    finally:
        impl.deactivate(ctx)
    gen = torch.Generator().manual_seed(SEED)
    module = fork.TemporalSelfAttention(embed_dims=64, num_heads=4, num_levels=1, dropout=0.0).double()
    kit.randomise(module, gen, scale=0.2)
    inputs = kit.tsa_inputs(1, torch.float64, gen, bev=12, dims=64)
    grad = torch.randn(1, 144, 64, generator=gen, dtype=torch.float64)
    try:
        before, after = kit.compare(lambda: module, lambda m: kit.run_tsa(m, inputs, grad),
                                    lambda: impl.activate(ctx, TARGET), lambda: impl.deactivate(ctx))
    finally:
        sys.modules.pop("lk_fork_tsa", None)
    kit.assert_same(before, after, torch.float64, SEED)


def test_tsa_batch_two_fails_as_upstream(mmcv1: types.ModuleType) -> None:
    """BEVFormer's own TSA cannot run bs > 1 (value[0:1] beside a bs-row query): still so when patched."""
    (bev,) = projects(mmcv1)
    gen = torch.Generator().manual_seed(SEED)
    module = bev.TemporalSelfAttention(embed_dims=32, num_heads=4, num_levels=1, dropout=0.0)
    inputs = kit.tsa_inputs(2, torch.float32, gen, bev=6, dims=32)
    impl, ctx = activation()
    with pytest.raises(RuntimeError) as unpatched:
        kit.run_tsa(module, inputs, torch.zeros(2, 36, 32))
    impl.activate(ctx, TARGET)
    try:
        with pytest.raises(RuntimeError) as patched:
            kit.run_tsa(module, inputs, torch.zeros(2, 36, 32))
    finally:
        impl.deactivate(ctx)
    assert str(patched.value) == str(unpatched.value)


def test_unknown_layout_runs_the_original_for_batch_two(mmcv1: types.ModuleType) -> None:
    """A fork whose forward the layout check cannot read: bs == 1 fast, bs > 1 the original, same results."""
    (bev,) = projects(mmcv1)

    class SpatialCrossAttention(bev.SpatialCrossAttention):  # type: ignore[name-defined,misc]
        def forward(self, query: Any, key: Any, value: Any, residual: Any = None, query_pos: Any = None,
                    key_padding_mask: Any = None, reference_points: Any = None, spatial_shapes: Any = None,
                    reference_points_cam: Any = None, bev_mask: Any = None, level_start_index: Any = None,
                    flag: str = "encoder", **kwargs: Any) -> Any:
            # the names the interface check looks for; the maths is the parent's
            _ = (torch.nonzero, self.deformable_attention, self.output_proj, self.num_cams, self.embed_dims,
                 self.dropout)
            return super().forward(query, key, value, residual, query_pos, key_padding_mask, reference_points,
                                   spatial_shapes, reference_points_cam, bev_mask, level_start_index, flag, **kwargs)

    attention = sys.modules["lk_upstream_registry"].ATTENTION  # the fork replaces the project's class
    attention.register_module(module=SpatialCrossAttention, force=True)
    gen = torch.Generator().manual_seed(SEED)
    module = sca_module(bev, TINY, torch.float32, gen, cls=SpatialCrossAttention)
    impl, ctx = activation()
    for bs in (1, 2):
        inputs = kit.camera_inputs(bs, torch.float32, gen, TINY, bev=12)
        grad = torch.randn(bs, 144, 256, generator=gen)
        before, after = kit.compare(lambda: module, lambda m, i=inputs, g=grad: kit.run_sca(m, i, g),
                                    lambda: impl.activate(ctx, TARGET), lambda: impl.deactivate(ctx))
        kit.assert_same(before, after, torch.float32, SEED)
    assert ctx.record.details.get("fallbacks") == {"batch > 1 with an unknown key/value layout": 1}, ctx.record.details


def test_interface_mismatch_is_reported_not_patched(mmcv1: types.ModuleType) -> None:
    impl, ctx = activation()
    impl.activate(ctx, TARGET)
    try:
        registry = mmcv1.Registry("attention")

        @registry.register_module()
        class TemporalSelfAttention(torch.nn.Module):  # no `flag`, no sampling: someone else's module
            def forward(self, query: Any, key: Any = None, value: Any = None, **kwargs: Any) -> Any:
                return query

        assert "__loongkit_feature__" not in vars(TemporalSelfAttention)
        assert "TemporalSelfAttention" in ctx.record.reason and "interface differs" in ctx.record.reason
        problems = ctx.record.details["not_applicable"]
        assert any("forward(" in v for v in problems.values()), problems  # type: ignore[union-attr]
    finally:
        impl.deactivate(ctx)


def test_broken_registry_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType(TARGET)
    fake.Registry = type("Registry", (), {})  # type: ignore[attr-defined]  # no _register_module
    for parent in ("mmcv", "mmcv.utils"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, TARGET, fake)
    impl, ctx = activation()
    impl.activate(ctx, TARGET)
    assert "registry hook not installed" in ctx.record.reason
    impl.deactivate(ctx)


def test_kernel_unavailable_keeps_upstream_code(mmcv1: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """No kernel: the fused-op function falls back to upstream's at its first call and says why; SCA's
    gather/scatter (no kernel needed) still applies."""
    import torch

    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels, "failure", lambda: "RuntimeError: no compiler")
    impl, ctx = activation()
    impl.activate(ctx, TARGET)
    try:
        (bev,) = projects(mmcv1)
        assert getattr(bev.SpatialCrossAttention.forward, "__loongkit_feature__", None) == "bevformer"
        patched = bev.multi_scale_deformable_attn_pytorch
        value = torch.randn(1, 20, 2, 4)
        args = (value, torch.tensor([[4, 5]]), torch.rand(1, 6, 2, 1, 2, 2), torch.rand(1, 6, 2, 1, 2))
        torch.testing.assert_close(patched(*args), patched.__loongkit_original__(*args), rtol=0, atol=0)
        assert "no compiler" in ctx.record.reason
    finally:
        impl.deactivate(ctx)


def test_registry_hook_shared_between_features(mmcv1: types.ModuleType) -> None:
    """BEVFORMER and UNIAD both watch the registry; leaving in either order restores it."""
    original = mmcv1.Registry._register_module
    first, ctx1 = activation("bevformer")
    second, ctx2 = activation("uniad")
    first.activate(ctx1, TARGET)
    second.activate(ctx2, TARGET)
    projects(mmcv1, uniad=True)
    assert all("patched by" not in v for v in ctx1.record.details["patched"].values())  # type: ignore[union-attr]
    assert "patched by LOONGKIT_BEVFORMER" in str(ctx2.record.details["patched"])  # MSDA3D: one class, two
    first.deactivate(ctx1)
    assert mmcv1.Registry in registry.hooked()  # UNIAD still watching
    second.deactivate(ctx2)
    assert mmcv1.Registry._register_module is original
    assert not registry.hooked()


# -- end to end: a user script under loongkit-run, fake mmcv 1.x layout on disk -------------------


def fake_mmcv1(tmp: Path) -> Path:
    root = tmp / "site"
    (root / "mmcv" / "utils").mkdir(parents=True)
    (root / "mmcv" / "__init__.py").write_text("")
    (root / "mmcv" / "utils" / "__init__.py").write_text("")
    (root / "mmcv" / "utils" / "registry.py").write_text((HERE / "mmcv1_registry_double.py").read_text())
    (root / "lk_upstream_bevformer.py").write_text((HERE / "upstream_bevformer_modules.py").read_text())
    return root


USER = """
import sys, types, torch
from mmcv.utils.registry import Registry
sys.modules["lk_upstream_registry"] = reg = types.ModuleType("lk_upstream_registry")
reg.ATTENTION, reg.LOSSES = Registry("attention"), Registry("loss")
import lk_upstream_bevformer as bev
if MISMATCH:
    @reg.ATTENTION.register_module(force=True)
    class TemporalSelfAttention(torch.nn.Module):
        def forward(self, query, key=None, value=None):
            return query
cfg = dict(type="MSDeformableAttention3D", embed_dims=32, num_heads=4, num_points=4, num_levels=1)
if RUN:
    sca = reg.ATTENTION.build(dict(type="SpatialCrossAttention", embed_dims=32, num_cams=2, deformable_attention=cfg))
    q = torch.randn(1, 16, 32, requires_grad=True)
    kv = torch.randn(2, 12, 1, 32)
    out = sca(q, kv, kv, reference_points_cam=torch.rand(2, 1, 16, 2, 2), bev_mask=torch.rand(2, 1, 16, 2) > 0.3,
              spatial_shapes=torch.tensor([[3, 4]]), level_start_index=torch.tensor([0]))
    out.sum().backward()
"""


def test_end_to_end_summary(run_loongkit: Callable[..., Any], tmp_path: Path) -> None:
    site = fake_mmcv1(tmp_path)
    env = {"LOONGKIT_BEVFORMER": "1", "PYTHONPATH": str(site)}
    result = run_loongkit("MISMATCH, RUN = False, True\n" + USER, env=env)
    assert result.returncode == 0, result.stderr
    row = result.feature("bevformer")
    assert row["active"] and row["calls"] >= 2, row
    assert "mmcv.utils.registry" in row["targets"], row
    assert len(row["details"]["patched"]) == 3, row
    assert set(row["config"]) == {"SpatialCrossAttention", "MSDeformableAttention3D", "TemporalSelfAttention"}, row


def test_end_to_end_interface_mismatch_in_summary(run_loongkit: Callable[..., Any], tmp_path: Path) -> None:
    site = fake_mmcv1(tmp_path)
    env = {"LOONGKIT_BEVFORMER": "1", "PYTHONPATH": str(site)}
    result = run_loongkit("MISMATCH, RUN = True, False\n" + USER, env=env)
    assert result.returncode == 0, result.stderr
    row = result.feature("bevformer")
    assert not row["active"], row
    assert "TemporalSelfAttention" in row["reason"] and "interface differs" in row["reason"], row
    # The Summary's text shows the reason (on stdout, or only in the log for a process that trained nothing).
    text = result.stdout + result.logs()
    assert "interface differs" in text[text.rindex("Loongkit Feature Summary"):], text


def test_end_to_end_torch_out_of_range(run_loongkit: Callable[..., Any], tmp_path: Path) -> None:
    site = fake_mmcv1(tmp_path)
    meta = site / "torch-2.3.1.dist-info"  # found first on sys.path: the metadata says torch 2.3.1
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.3.1\n")
    env = {"LOONGKIT_BEVFORMER": "1", "PYTHONPATH": str(site)}
    result = run_loongkit("MISMATCH, RUN = False, False\n" + USER, env=env)
    assert result.returncode == 0, result.stderr
    row = result.feature("bevformer")
    assert row["state"] == "not applicable" and "2.3.1" in row["reason"], row
