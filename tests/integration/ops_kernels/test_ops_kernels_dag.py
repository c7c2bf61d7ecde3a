"""LOONGKIT_DAG: a vendored Sparse4D-style DeformableFeatureAggregation, patched at registration.

The test writes a small ``projects/mmdet3d_plugin`` package (``upstream_sparse4d_project.py`` next to
this file: written for this project from the published Sparse4D algorithm, same public interface and
maths, no upstream code; ``benchmarks/models.py`` uses it too) that registers its classes in
mmengine's MODELS registry as a ported project does, activates the feature, imports the package, and
compares outputs and every gradient of the patched module with the same module's
original forward: fresh random inputs each run, Sparse4D v3 shapes (6 cameras, 4 levels 64x176 ..
8x22, 256 channels, 8 groups, 13 key points; fewer anchors), batch 1 and 2, both aggregation paths
(grid_sample on CPU; the CUDA extension's rule through a stand-in for ``DAF``).
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

registry_mod = pytest.importorskip("mmengine.registry.registry")

from loongkit_ops import kernels  # noqa: E402
from loongkit_ops.kernels.ops import daf  # noqa: E402
from loongkit_ops.patches.dag import SparseDAG, interface_problem  # noqa: E402
from loongkit_ops.plugin import plugin  # noqa: E402

from loongkit_core.context import ActivationContext, NotApplicable  # noqa: E402
from loongkit_core.feature import State  # noqa: E402

SEED = int(torch.seed() % 2**31)
TOL = {torch.float32: {"rtol": 2e-5, "atol": 2e-5}, torch.float64: {"rtol": 1e-10, "atol": 1e-10}}


def _load(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"lk_{name}_test", Path(__file__).parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


upstream = _load("upstream_sparse4d_project")
BLOCKS = upstream.source("mmengine")
cameras, inputs, build = upstream.cameras, upstream.inputs, upstream.build


def write_project(root: Path, package: str, blocks: str = BLOCKS) -> str:
    return upstream.write_project(root, package, blocks)


def activation() -> tuple[SparseDAG, ActivationContext]:
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == "dag")
    ctx = ActivationContext.standalone(feature, State.APPLIED)
    return SparseDAG(feature), ctx


@pytest.fixture
def project(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Any, ActivationContext]]:
    """The vendored package imported with the feature active (undone afterwards)."""
    assert kernels.load() is not None, kernels.failure()
    impl, ctx = activation()
    impl.activate(ctx, "mmengine.registry.registry")
    package = f"lk_sparse4d_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}"
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(write_project(tmp_path, package))
        yield module, ctx
    finally:
        impl.deactivate(ctx)
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith(package)]:
            del sys.modules[name]


def run(dfa: Any, forward: Callable[..., Any], data: dict[str, Any], grad: torch.Tensor) -> list[torch.Tensor]:
    dfa.zero_grad()
    feats = [t.clone().requires_grad_() for t in data["feature_maps"]]
    inst = data["instance_feature"].clone().requires_grad_()
    anchor = data["anchor"].clone().requires_grad_()
    out = forward(dfa, inst, anchor, data["anchor_embed"], feats, data["metas"])
    out.backward(grad)
    return [out.detach(), inst.grad, anchor.grad, *(f.grad for f in feats),
            *(p.grad.clone() for p in dfa.parameters())]


def assert_same(before: list[torch.Tensor], after: list[torch.Tensor], dtype: torch.dtype) -> None:
    for i, (theirs, mine) in enumerate(zip(before, after, strict=True)):
        scale = theirs.abs().max().clamp(min=1e-3)
        torch.testing.assert_close(mine / scale, theirs / scale, **TOL[dtype],
                                   msg=lambda m, i=i: f"#{i} seed {SEED}: {m}")


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grid_sample_path_equals_unpatched(project: tuple[Any, ActivationContext], bs: int,
                                           dtype: torch.dtype) -> None:
    module, ctx = project
    cls = module.DeformableFeatureAggregation
    assert cls.forward.__wrapped__ is not cls.forward, "the class was not patched at registration"
    gen = torch.Generator().manual_seed(SEED + bs)
    dfa = build(module, dtype, gen)
    data = inputs(bs, 96, dtype, gen)
    grad = torch.randn(bs, 96, 256, generator=gen, dtype=dtype)
    before = run(dfa, cls.forward.__wrapped__, data, grad)
    after = run(dfa, cls.forward, data, grad)
    assert ctx.record.calls == 1
    assert_same(before, after, dtype)
    # (earlier tests' classes, still in MODELS when the feature activates, are patched too)
    assert f"{module.__name__}.DeformableFeatureAggregation" in ctx.record.details["patched"]


@pytest.mark.parametrize("bs", [1, 2])
def test_deformable_func_path_equals_unpatched(project: tuple[Any, ActivationContext], bs: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """use_deformable_func=True: the CUDA op's rule (samples outside (0, 1) dropped), here with the fp64
    reference standing in for the extension the unpatched module would call."""
    module, ctx = project
    dtype = torch.float64
    monkeypatch.setattr(module, "DAF", lambda *args: daf.reference(*args, inside_only=True))
    cls = module.DeformableFeatureAggregation
    gen = torch.Generator().manual_seed(SEED + 10 * bs)
    levels = [(16, 44), (8, 22)]
    dfa = build(module, dtype, gen, num_levels=2, embed_dims=64)
    data = inputs(bs, 40, dtype, gen, channels=64, levels=levels)
    maps = data.pop("feature_maps")
    flat = torch.cat([t.flatten(3) for t in maps], 3).transpose(2, 3).reshape(bs, -1, 64)
    per_cam = sum(h * w for h, w in levels)
    shapes = torch.tensor([levels] * 6)
    starts = torch.tensor([[cam * per_cam, cam * per_cam + levels[0][0] * levels[0][1]] for cam in range(6)])
    grad = torch.randn(bs, 40, 64, generator=gen, dtype=dtype)

    def go(forward: Callable[..., Any]) -> list[torch.Tensor]:
        dfa.zero_grad()
        feat = flat.clone().requires_grad_()
        inst = data["instance_feature"].clone().requires_grad_()
        out = forward(dfa, inst, data["anchor"], data["anchor_embed"], [feat, shapes, starts], data["metas"])
        out.backward(grad)
        return [out.detach(), inst.grad, feat.grad, *(p.grad.clone() for p in dfa.parameters())]

    dfa.use_deformable_func = True
    assert_same(go(cls.forward.__wrapped__), go(cls.forward), dtype)
    assert ctx.record.calls == 1


def test_attention_dropout_draws_the_same_numbers(project: tuple[Any, ActivationContext]) -> None:
    module, _ = project
    cls = module.DeformableFeatureAggregation
    gen = torch.Generator().manual_seed(SEED)
    dfa = build(module, torch.float64, gen, attn_drop=0.3).train()
    data = inputs(1, 24, torch.float64, gen, levels=[(16, 44), (8, 22), (4, 11), (2, 6)])
    grad = torch.randn(1, 24, 256, generator=gen, dtype=torch.float64)
    torch.manual_seed(SEED)
    before = run(dfa, cls.forward.__wrapped__, data, grad)
    torch.manual_seed(SEED)
    assert_same(before, run(dfa, cls.forward, data, grad), torch.float64)


def test_other_dtypes_run_the_original(project: tuple[Any, ActivationContext]) -> None:
    module, ctx = project
    gen = torch.Generator().manual_seed(SEED)
    dfa = build(module, torch.bfloat16, gen)
    data = inputs(1, 8, torch.bfloat16, gen, levels=[(8, 22), (4, 11), (2, 6), (1, 3)])
    with torch.no_grad():
        out = dfa(data["instance_feature"], data["anchor"], data["anchor_embed"], data["feature_maps"], data["metas"])
    assert out.dtype == torch.bfloat16 and ctx.record.calls == 0


FORK = BLOCKS.replace("        output = self.proj_drop(self.output_proj(features))\n",
                      "        features = torch.tanh(features)\n"
                      "        output = self.proj_drop(self.output_proj(features))\n")


def forget_registered(monkeypatch: pytest.MonkeyPatch, class_name: str = "DeformableFeatureAggregation") -> None:
    """Earlier tests' classes stay registered in mmengine's MODELS (and its children) under ``class_name``:
    out of the way for this test (put back at its end), so the registry holds only what it registers."""
    from mmengine.registry import MODELS

    stack = [MODELS]
    while stack:
        found = stack.pop()
        for key, cls in list(found._module_dict.items()):
            if getattr(cls, "__name__", None) == class_name:
                monkeypatch.delitem(found._module_dict, key)
        stack.extend(found._children.values())


def test_fork_with_another_forward_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert FORK != BLOCKS
    forget_registered(monkeypatch)
    impl, ctx = activation()
    impl.activate(ctx, "mmengine.registry.registry")
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(write_project(tmp_path, "lk_sparse4d_fork", FORK))
        assert not hasattr(module.DeformableFeatureAggregation.forward, "__wrapped__")
        reason = ctx.record.details["skipped"][f"{module.__name__}.DeformableFeatureAggregation"]
        assert "interface differs" in reason and "tanh" in reason
        assert not ctx.record.details.get("patched")
        assert ctx.record.state == State.NOT_APPLICABLE and ctx.record.reason == reason
    finally:
        impl.deactivate(ctx)
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith("lk_sparse4d_fork")]:
            del sys.modules[name]


def test_fork_registered_before_activation_is_not_applicable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             loongkit_runtime: Any) -> None:
    """Through the runtime: the registry watch finds the fork while the feature activates; the row ends
    NOT APPLICABLE with the reason (the runtime does not overwrite it with APPLIED)."""
    forget_registered(monkeypatch)
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(write_project(tmp_path, "lk_sparse4d_fork_early", FORK))
        rt = loongkit_runtime({"LOONGKIT_DAG": "1"}, activate={"dag": "mmengine.registry.registry"})
        record = rt.records["dag"]
        reason = record.details["skipped"][f"{module.__name__}.DeformableFeatureAggregation"]
        assert "interface differs" in reason and "tanh" in reason
        assert (record.state, record.reason) == (State.NOT_APPLICABLE, reason)
        assert record.to_json()["state"] == "not applicable"
        assert not hasattr(module.DeformableFeatureAggregation.forward, "__wrapped__")
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith("lk_sparse4d_fork_early")]:
            del sys.modules[name]


def test_interface_checks() -> None:
    class NoSampling:
        def forward(self, instance_feature: Any, anchor: Any, anchor_embed: Any, feature_maps: Any, metas: Any,
                    **kwargs: Any) -> Any:
            return instance_feature

    assert "does not use" in str(interface_problem(NoSampling))

    class OtherSignature:
        def forward(self, query: Any) -> Any:
            return query

    assert "forward(" in str(interface_problem(OtherSignature))


def test_broken_registry_is_not_applicable(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    fake = types.ModuleType("fake_registry")
    fake.Registry = type("Registry", (), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_registry", fake)
    impl, ctx = activation()
    with pytest.raises(NotApplicable, match="interface differs"):
        impl.activate(ctx, "fake_registry")


def test_kernel_unavailable_leaves_the_class_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No kernel build when the registry is imported; a matching class that registers is skipped."""
    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels, "failure", lambda: "RuntimeError: no compiler")
    impl, ctx = activation()
    impl.activate(ctx, "mmengine.registry.registry")  # applies: nothing built yet
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(write_project(tmp_path, "lk_sparse4d_nokernel", BLOCKS))
        assert not hasattr(module.DeformableFeatureAggregation.forward, "__wrapped__")
        reason = ctx.record.details["skipped"][f"{module.__name__}.DeformableFeatureAggregation"]
        assert "no compiler" in reason
    finally:
        impl.deactivate(ctx)
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith("lk_sparse4d_nokernel")]:
            del sys.modules[name]


RUN = """
import sys, importlib, torch
sys.path.insert(0, {root!r})
blocks = importlib.import_module("lk_sparse4d_e2e.models.blocks")
m = blocks.DeformableFeatureAggregation(embed_dims=32, num_groups=4, num_levels=1, num_cams=2,
                                        kps_generator=dict(type="KeyPoints"))
bs, a = 1, 5
anchor = torch.zeros(bs, a, 11); anchor[..., 0] = 5; anchor[..., 7] = 1
proj = torch.eye(4).expand(bs, 2, 4, 4).clone(); proj[..., 2, 3] = 10
out = m(torch.randn(bs, a, 32), anchor, torch.randn(bs, a, 32), [torch.randn(bs, 2, 32, 4, 6)],
        dict(projection_mat=proj, image_wh=torch.full((bs, 2, 2), 20.0)))
out.sum().backward()
"""


@pytest.mark.parametrize("blocks", ["upstream", "fork"])
def test_end_to_end_summary(run_loongkit: Callable[..., Any], tmp_path: Path, blocks: str) -> None:
    write_project(tmp_path, "lk_sparse4d_e2e", BLOCKS if blocks == "upstream" else FORK)
    result = run_loongkit(RUN.format(root=str(tmp_path)), env={"LOONGKIT_DAG": "1"})
    assert result.returncode == 0, result.stderr
    row = result.feature("dag")
    if blocks == "upstream":
        assert row["active"] and row["calls"] == 1, row
        assert "mmengine.registry.registry" in str(row["targets"]), row
    else:
        assert row["state"] == "not applicable" and "interface differs" in row["reason"], row
