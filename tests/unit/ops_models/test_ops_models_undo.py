"""BEVFORMER, UNIAD and DAG undo through the default FeatureImpl.deactivate (ctx.patcher.undo()): apply ->
undo -> every class, module global and Registry exactly as before -> apply again patches again. And the
Summary's row of BEVFORMER and UNIAD names every class they patched (issue 16): in full in the log and the
JSON; on stdout, within 120 characters, the classes that fit and a count of the others (issue 23).

Against the upstream-style test modules registered in the mmcv 1.x Registry double (and a Sparse4D-style
project, tests/integration/ops_kernels/upstream_sparse4d_project.py, registering in it as
benchmarks/models.py does); an mmcv-like multi_scale_deform_attn module stands in for mmcv's."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from loongkit_ops import kernels
from loongkit_ops.patches import registry
from loongkit_ops.plugin import plugin

from loongkit_core.context import ActivationContext
from loongkit_core.summary import LINE_WIDTH, render

HERE = Path(__file__).parent
TARGET = "mmcv.utils.registry"
FUNCTION = "multi_scale_deformable_attn_pytorch"


def _load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kit = _load(HERE / "models_testkit.py", "lk_models_testkit_undo")
double = _load(HERE / "mmcv1_registry_double.py", "lk_registry_double_undo")
sparse4d = _load(HERE.parents[1] / "integration" / "ops_kernels" / "upstream_sparse4d_project.py", "lk_sparse4d_undo")


@pytest.fixture
def mmcv1(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    assert kernels.load() is not None, kernels.failure()
    fake = types.ModuleType(TARGET)
    fake.Registry = type("Registry", (double.Registry,), {})  # type: ignore[attr-defined]  # fresh class per test
    for parent in ("mmcv", "mmcv.utils"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, TARGET, fake)
    yield fake
    kit.remove_projects()


def feature(name: str) -> tuple[Any, ActivationContext]:
    impl = plugin.impl(plugin.feature(name))
    return type(impl)(impl.feature), ActivationContext.standalone(impl.feature, logger="test")


def state(*owners: Any) -> list[dict[str, Any]]:
    """Every attribute the owners hold themselves (classes, modules), by identity."""
    return [dict(vars(o)) for o in owners]


def cycle(impl: Any, ctx: ActivationContext, targets: tuple[str, ...], check: Callable[[], None],
          snapshot: Callable[[], Any]) -> None:
    prior = snapshot()
    for _ in range(2):
        for target in targets:
            impl.activate(ctx, target)
        check()
        impl.deactivate(ctx)
        assert snapshot() == prior
        assert len(ctx.patcher) == 0 and not registry.hooked()


MMCV_MSDA = """
import torch


def multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations, attention_weights):
    return value


class MultiScaleDeformableAttention(torch.nn.Module):
    def forward(self, query, key=None, value=None, identity=None, query_pos=None, key_padding_mask=None,
                reference_points=None, spatial_shapes=None, level_start_index=None):
        return multi_scale_deformable_attn_pytorch(value, spatial_shapes, reference_points, query)
"""


def mmcv_msda_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """What LOONGKIT_BEVFORMER's mmcv part checks of mmcv.ops.multi_scale_deform_attn."""
    module = types.ModuleType("lk_fake_mmcv_msda")
    exec(compile(MMCV_MSDA, module.__name__, "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_bevformer_apply_undo_apply(mmcv1: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    (bev,) = kit.install_projects(mmcv1.Registry("attention"), mmcv1.Registry("loss"))
    fake_mmcv = mmcv_msda_module(monkeypatch)
    impl, ctx = feature("bevformer")
    classes = (bev.SpatialCrossAttention, bev.MSDeformableAttention3D, bev.TemporalSelfAttention)

    def check() -> None:
        assert all(getattr(c.forward, "__loongkit_feature__", None) == "bevformer" for c in classes)
        assert getattr(bev.multi_scale_deformable_attn_pytorch, "__loongkit_original__", None) is not None
        assert getattr(fake_mmcv.multi_scale_deformable_attn_pytorch, "__loongkit_original__", None) is not None
        assert mmcv1.Registry in registry.hooked() and len(ctx.record.details["patched"]) == 3  # type: ignore[arg-type]

    cycle(impl, ctx, (TARGET, fake_mmcv.__name__), check,
          lambda: (state(*classes, mmcv1.Registry, fake_mmcv), bev.__dict__[FUNCTION]))


def test_uniad_apply_undo_apply(mmcv1: types.ModuleType) -> None:
    bev, uniad = kit.install_projects(mmcv1.Registry("attention"), mmcv1.Registry("loss"), uniad=True)
    impl, ctx = feature("uniad")
    classes = (uniad.SpatialCrossAttention, uniad.TemporalSelfAttention, uniad.CollisionLoss,
               bev.MSDeformableAttention3D)

    def check() -> None:
        patched = {k.split(" ")[0] for k in ctx.record.details["patched"]}  # type: ignore[union-attr]
        assert patched == {"SpatialCrossAttention", "TemporalSelfAttention", "MotionDeformableAttention",
                           "MSDeformableAttention3D", "CollisionLoss"}, ctx.record.details
        assert all(getattr(c.forward, "__loongkit_feature__", None) == "uniad" for c in classes)

    cycle(impl, ctx, (TARGET,), check,
          lambda: (state(*classes, uniad.MotionDeformableAttention, mmcv1.Registry), uniad.__dict__[FUNCTION],
                   bev.__dict__[FUNCTION]))


def test_dag_apply_undo_apply(mmcv1: types.ModuleType, tmp_path: Path) -> None:
    package = "lk_sparse4d_undo_project"
    sys.path.insert(0, str(tmp_path))
    try:
        blocks = importlib.import_module(sparse4d.write_project(tmp_path, package, sparse4d.source(TARGET)))
        impl, ctx = feature("dag")
        dfa = blocks.DeformableFeatureAggregation

        def check() -> None:
            assert "forward" in vars(dfa) and vars(dfa)["forward"].__wrapped__ is not None
            assert ctx.record.details["patched"] == [f"{dfa.__module__}.DeformableFeatureAggregation"]

        cycle(impl, ctx, (TARGET,), check, lambda: state(dfa, mmcv1.Registry))
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith(package)]:
            del sys.modules[name]


def summary_row(ctx: ActivationContext, line_width: int | None = None) -> str:
    """The feature's row: in full (the log file's Summary) by default, else as stdout prints it."""
    ctx.record.enabled = True  # the test's record: render lists enabled features only
    (row,) = [line for line in render([ctx.record], line_width=line_width).splitlines()
              if line.startswith(ctx.feature.name)]
    return row


def assert_every_class_in_the_summary(ctx: ActivationContext) -> None:
    """Every patched class: named in the log's row and in the JSON Summary; stdout's row (within LINE_WIDTH)
    names those that fit and counts exactly the others."""
    assert isinstance(ctx.config, dict)
    full = summary_row(ctx)
    for name in ctx.config:
        assert name in full, full
    assert ctx.record.to_json()["config"] == ctx.config
    short = summary_row(ctx, LINE_WIDTH)
    assert len(short) <= LINE_WIDTH, short
    shown = [name for name in ctx.config if repr(name) in short]
    assert shown, short
    if len(shown) < len(ctx.config):
        assert short.endswith(f"+{len(ctx.config) - len(shown)} more}}  [disabled]"), short


FORK_DECODER = """
from lk_upstream_bevformer import ATTENTION, multi_scale_deformable_attn_pytorch
from lk_upstream_bevformer import MSDeformableAttention3D as Base


@ATTENTION.register_module()
class CustomMSDeformableAttention(Base):
    def forward(self, query, key=None, value=None, identity=None, query_pos=None, key_padding_mask=None,
                reference_points=None, spatial_shapes=None, level_start_index=None, flag="decoder", **kwargs):
        _ = (self.sampling_offsets, self.attention_weights, self.value_proj, self.output_proj,
             multi_scale_deformable_attn_pytorch)
        return super().forward(query, key, value, identity, query_pos, key_padding_mask, reference_points,
                               spatial_shapes, level_start_index, **kwargs)
"""


def test_bevformer_summary_row_names_every_class(mmcv1: types.ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    kit.install_projects(mmcv1.Registry("attention"), mmcv1.Registry("loss"))
    (tmp_path / "lk_decoder_fork.py").write_text(FORK_DECODER)  # the decoder's attention, as BEVFormer has one
    fake_mmcv = mmcv_msda_module(monkeypatch)
    impl, ctx = feature("bevformer")
    impl.activate(ctx, TARGET)
    try:
        kit.load_file(tmp_path / "lk_decoder_fork.py", "lk_decoder_fork")
        impl.activate(ctx, fake_mmcv.__name__)
        assert ctx.config == {
            "mmcv.MultiScaleDeformableAttention": "loongkit::ms_deform_attn (CPU)",
            "SpatialCrossAttention": "batched gather/scatter",
            "MSDeformableAttention3D": "loongkit::ms_deform_attn_fused",
            "TemporalSelfAttention": "loongkit::ms_deform_attn_fused",
            "CustomMSDeformableAttention": "loongkit::ms_deform_attn",
        }, ctx.config
        assert_every_class_in_the_summary(ctx)
    finally:
        impl.deactivate(ctx)
        sys.modules.pop("lk_decoder_fork", None)


def test_uniad_summary_row_names_every_class(mmcv1: types.ModuleType) -> None:
    kit.install_projects(mmcv1.Registry("attention"), mmcv1.Registry("loss"), uniad=True)
    impl, ctx = feature("uniad")
    impl.activate(ctx, TARGET)
    try:
        assert ctx.config == {
            "SpatialCrossAttention": "batched gather/scatter",
            "MSDeformableAttention3D": "loongkit::ms_deform_attn_fused",
            "TemporalSelfAttention": "loongkit::ms_deform_attn_fused",
            "MotionDeformableAttention": "loongkit::ms_deform_attn",
            "CollisionLoss": "vectorised",
        }, ctx.config
        assert "CollisionLoss" in summary_row(ctx)
        assert_every_class_in_the_summary(ctx)
    finally:
        impl.deactivate(ctx)


def test_a_class_left_to_the_other_feature_says_so(mmcv1: types.ModuleType) -> None:
    """BEVFORMER and UNIAD both on: the class BEVFORMER patched shows as its in UNIAD's row."""
    kit.install_projects(mmcv1.Registry("attention"), mmcv1.Registry("loss"), uniad=True)
    (first, ctx1), (second, ctx2) = feature("bevformer"), feature("uniad")
    first.activate(ctx1, TARGET)
    second.activate(ctx2, TARGET)
    try:
        assert ctx2.config["MSDeformableAttention3D"] == "by LOONGKIT_BEVFORMER", ctx2.config  # type: ignore[index]
    finally:
        second.deactivate(ctx2)
        first.deactivate(ctx1)
