"""LOONGKIT_MMDET_MODULES against the real mmdet 2.28 registry (mmcv-full 1.x), compiled by inductor on CPU.

In mmdet 2.x ``mmdet.models.builder.LOSSES`` *is* ``MODELS`` (one Registry object, child of mmcv's
``MODELS``), so ``build_loss`` goes through the very registry the feature patches. Losses register when
``mmdet.models.losses`` is imported, i.e. after ``mmdet.models.builder`` (the feature's target) finished
importing: the end-to-end run takes the "registered later" path (the wrapped ``_register_module``), the
in-process tests (mmdet already imported) the "already in ``module_dict``" path.

Equivalence is checked in float64 with rtol=1e-10 (compiled and eager agree to ~1e-16 there; any change
of the computation shows far above that)."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator

import pytest
import torch
from loongkit_ops.compile.common import MARK

from loongkit_core.feature import State
from loongkit_core.runtime import Runtime

pytestmark = [pytest.mark.integration, pytest.mark.stack1]
builder = pytest.importorskip("mmdet.models.builder", reason="needs mmdet 2.x (mmdet.models.builder, mmcv-full 1.x)")
TARGET = "mmdet.models.builder"
FEATURE = "mmdet_modules"
ENV = {"LOONGKIT_MMDET_MODULES": "1", "LOONGKIT_COMPILE_MMDET_MODULES_FILTER": "SmoothL1Loss"}


@pytest.fixture
def runtime(loongkit_runtime: Callable[..., Runtime]) -> Iterator[Runtime]:
    import mmdet.models  # noqa: F401  (registers the losses before activation: the module_dict path)

    torch._dynamo.reset()
    yield loongkit_runtime(ENV, {FEATURE: TARGET})
    torch._dynamo.reset()


def test_registry_facts() -> None:
    import mmdet.models  # noqa: F401

    assert builder.LOSSES is builder.MODELS  # build_loss == MODELS.build
    assert "SmoothL1Loss" in builder.MODELS.module_dict and "L1Loss" in builder.MODELS.module_dict


def test_smooth_l1_built_by_registry_is_compiled_and_equal(runtime: Runtime) -> None:
    from mmdet.models.builder import MODELS, build_loss

    record = runtime.records[FEATURE]
    assert record.state == State.APPLIED, record.reason
    cfg = dict(type="SmoothL1Loss", beta=0.5, loss_weight=2.0)
    compiled = build_loss(cfg)
    impl = compiled._compiled_call_impl
    assert impl is not None and getattr(impl, MARK) == FEATURE
    assert MODELS.build(cfg)._compiled_call_impl is not None  # the other build path too
    eager_loss = type(compiled)(beta=0.5, loss_weight=2.0)
    assert eager_loss._compiled_call_impl is not None  # built directly: compiled too (__init__ is wrapped)
    eager_loss._compiled_call_impl = None  # the same class, but run eagerly: the reference

    torch.manual_seed(1234)
    for _ in range(2):  # fresh random inputs; the second call reuses the compiled graph
        pred = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
        target = torch.randn(8, 4, dtype=torch.float64)
        weight = torch.rand(8, 4, dtype=torch.float64)
        ref_pred = pred.detach().clone().requires_grad_()
        out = compiled(pred, target, weight=weight, avg_factor=5.0)
        ref = eager_loss(ref_pred, target, weight=weight, avg_factor=5.0)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
        out.backward()
        ref.backward()
        assert pred.grad is not None and ref_pred.grad is not None
        torch.testing.assert_close(pred.grad, ref_pred.grad, rtol=1e-10, atol=1e-12)

    config = record.config
    assert config["patched"] == ["SmoothL1Loss"] and config["filter"] == ["SmoothL1Loss"]
    assert config["compiled"] == {"SmoothL1Loss": 3} and config["fallback"] == {}
    assert config["compiles"] >= 1 and config["compile_seconds"] > 0
    assert record.calls == 2


def test_module_not_in_filter_left_alone(runtime: Runtime) -> None:
    from mmdet.models.builder import build_loss

    l1_cls = builder.MODELS.get("L1Loss")
    assert not hasattr(l1_cls.__init__, "__wrapped__")  # its __init__ is mmdet's own
    l1 = build_loss(dict(type="L1Loss"))
    assert l1._compiled_call_impl is None
    x, y = torch.randn(3, 2), torch.randn(3, 2)
    assert torch.equal(l1(x, y), (x - y).abs().mean())
    config = runtime.records[FEATURE].config
    assert "L1Loss" not in config["compiled"] and "L1Loss" not in config["patched"]
    assert runtime.records[FEATURE].calls == 0


def test_end_to_end_summary_names_the_compiled_loss(run_loongkit: Callable[..., object]) -> None:
    code = textwrap.dedent("""
        import torch
        from mmdet.models.builder import build_loss
        loss = build_loss(dict(type="SmoothL1Loss", beta=1.0))
        other = build_loss(dict(type="L1Loss"))
        pred = torch.randn(4, 4, requires_grad=True)
        out = loss(pred, torch.randn(4, 4)) + other(pred, torch.randn(4, 4))
        out.backward()
        print("OK", loss._compiled_call_impl is not None, other._compiled_call_impl is None,
              bool(torch.isfinite(pred.grad).all()))
    """)
    result = run_loongkit(argv=[sys.executable, "-c", code], env={**ENV, "LOONGKIT_LOGLEVEL": "info"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK True True True" in result.stdout, result.stdout[-2000:]
    row = result.feature(FEATURE)
    assert row["state"] == "active" and row["calls"] == 1, row
    config = row["config"]
    assert config["patched"] == ["SmoothL1Loss"] and config["compiled"] == {"SmoothL1Loss": 1}, config
    assert config["fallback"] == {} and config["compile_seconds"] > 0, config
    logs = result.logs()
    assert "registered_later=['SmoothL1Loss']" in logs  # armed before mmdet.models.losses registered it
    assert "mmdet module will be compiled at construction" in logs
