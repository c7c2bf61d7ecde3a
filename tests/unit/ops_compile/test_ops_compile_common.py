"""The shared compile helper: in-place compile, fallback to eager, accounting, deepcopy/state_dict."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from loongkit_ops.compile import common

from loongkit_core.context import ActivationContext
from loongkit_core.feature import Category, Feature, FeatureRecord


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.fc(x)))


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Callable[..., None]:
        return lambda msg, **kw: self.lines.append((level, msg, kw))


@pytest.fixture
def ctx() -> ActivationContext:
    feature = Feature(name="compile_test", env="LOONGKIT_COMPILE_TEST", level=1, category=Category.OPS,
                      description="test")
    return ActivationContext(FeatureRecord(feature), env=None, logger=Log(), on_import=lambda m, cb: None)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def reset_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_in_place_equals_eager(ctx: ActivationContext) -> None:
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    compiler = common.Compiler(ctx, backend="aot_eager")
    assert compiler.compile_module(net, "Net")
    assert list(net.state_dict()) == list(ref.state_dict())  # no _orig_mod. prefix
    x = torch.randn(8, 6)
    out, want = net(x), ref(x)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    out.square().sum().backward()
    want.square().sum().backward()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(net.bn.running_mean, ref.bn.running_mean)
    assert ctx.record.calls == 1
    cfg = compiler.config
    assert cfg["compiled"] == {"Net": 1} and cfg["compiles"] >= 1 and cfg["compile_seconds"] > 0
    assert cfg["fallback"] == {} and cfg["extra_memory_mb"] >= 0
    assert any(msg == "compiled" for _, msg, _ in ctx.log.lines)

    net.eval()
    ref.eval()
    torch.testing.assert_close(net(x), ref(x), rtol=0, atol=1e-6)  # eval switch: BN running stats used
    copied = copy.deepcopy(net)  # EMA-style copies are plain eager modules of their own
    assert copied._compiled_call_impl is None
    assert not compiler.compile_module(net, "Net")  # a second install is refused, not nested
    assert compiler.config["eager"] == {"Net": "compiled by this feature"}
    compiler.uncompile()
    assert net._compiled_call_impl is None


def failing_backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
    raise RuntimeError("inductor exploded")


def test_compile_error_falls_back_to_eager_for_good(ctx: ActivationContext) -> None:
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    compiler = common.Compiler(ctx, backend=failing_backend)
    compiler.compile_module(net, "Net")
    x = torch.randn(8, 6)
    out = net(x)  # the compile fails; training goes on eagerly
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)
    out.sum().backward()
    assert "inductor exploded" in compiler.config["fallback"]["Net"]
    assert any(level == "error" and kw["module"] == "Net" for level, _, kw in ctx.log.lines)
    calls = ctx.record.calls
    net(x)  # no second attempt
    assert ctx.record.calls == calls
    # torch's running stats were updated once per call, as in eager
    ref(x)
    torch.testing.assert_close(net.bn.running_mean, ref.bn.running_mean)


def test_user_errors_and_oom_propagate_unchanged(ctx: ActivationContext) -> None:
    compiler = common.Compiler(ctx, backend="aot_eager")

    def oom(*args: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory")

    def wrong(*args: Any) -> Any:
        raise ValueError("bad input")

    eager_calls: list[int] = []
    guarded = compiler.guard(oom, lambda *a: eager_calls.append(1), "oom")
    with pytest.raises(torch.OutOfMemoryError):
        guarded(1)
    guarded = compiler.guard(wrong, lambda *a: eager_calls.append(1), "wrong")
    with pytest.raises(ValueError, match="bad input"):
        guarded(1)
    assert eager_calls == [] and compiler.config["fallback"] == {}

    net = Net()
    compiler.compile_module(net, "Net")
    with pytest.raises(RuntimeError) as got:  # the shape error eager raises, not a compiler wrapper
        net(torch.randn(8, 5))
    with pytest.raises(RuntimeError) as want:
        Net()(torch.randn(8, 5))
    assert type(got.value) is type(want.value)


def test_compiler_error_classification() -> None:
    from torch._dynamo.exc import BackendCompilerFailed, Unsupported

    assert common.is_compiler_error(Unsupported("x"))
    assert common.is_compiler_error(BackendCompilerFailed.__new__(BackendCompilerFailed))
    assert not common.is_compiler_error(RuntimeError("x"))
