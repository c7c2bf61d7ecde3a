"""LOONGKIT_COMPILE_RESNET against the real mmdet 3.x ResNet (registry-built), compiled by inductor.

Equivalence is checked in float64: there the compiled and the eager backbone agree to ~1e-14, so a
tolerance of 1e-10 (relative) catches any change of the computation. (In float32, train-mode BatchNorm
over few values is ill-conditioned enough that merely reordered sums move some gradients by ~1e-2.)"""

from __future__ import annotations

import copy
import textwrap
from collections.abc import Callable, Iterator

import pytest
import torch

from loongkit_core.feature import State
from loongkit_core.runtime import Runtime

pytestmark = pytest.mark.integration
TARGET = "mmdet.models.backbones.resnet"


@pytest.fixture
def runtime(loongkit_runtime: Callable[..., Runtime]) -> Iterator[Callable[..., Runtime]]:
    pytest.importorskip("mmdet")
    torch._dynamo.reset()
    yield lambda environ: loongkit_runtime(environ, {"compile_resnet": TARGET})
    torch._dynamo.reset()


def build(**cfg: object) -> torch.nn.Module:
    import mmdet.models  # noqa: F401  (registers the backbones)
    from mmdet.registry import MODELS

    return MODELS.build(dict(type="ResNet", out_indices=(0, 1, 2, 3), **cfg))


def compare(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> None:
    oa, ob = a(x), b(x)
    for u, v in zip(oa, ob, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-10 * float(v.abs().max()))
    if not torch.is_grad_enabled():
        return
    ws = [torch.randn_like(o) for o in oa]
    sum((o * w).sum() for o, w in zip(oa, ws, strict=True)).backward()
    sum((o * w).sum() for o, w in zip(ob, ws, strict=True)).backward()
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10 * float(q.grad.abs().max()), msg=name)


def test_resnet18_compiled_stages_equal_eager(runtime: Callable[..., Runtime]) -> None:
    rt = runtime({"LOONGKIT_COMPILE_RESNET": "1"})
    record = rt.records["compile_resnet"]
    assert record.state == State.APPLIED, record.reason
    torch.manual_seed(0)
    a = build(depth=18, frozen_stages=1, norm_eval=False).double()
    b = copy.deepcopy(a)  # deep copies are eager (Module.__getstate__ drops the compiled call)
    assert a.layer4._compiled_call_impl is not None and b.layer4._compiled_call_impl is None
    assert list(a.state_dict()) == list(b.state_dict())
    x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    a.train()
    b.train()
    compare(a, b, x)
    assert not a.layer1.training and a.layer1[0].conv1.weight.grad is None  # frozen_stages kept
    for m, n in zip(a.modules(), b.modules(), strict=True):
        if isinstance(m, torch.nn.BatchNorm2d):
            torch.testing.assert_close(m.running_var, n.running_var, rtol=1e-10, atol=1e-12)
    a.eval()
    b.eval()
    with torch.no_grad():
        compare(a, b, x)
    cfg = record.config
    assert cfg["compiled"] == {f"ResNet.layer{i}": 1 for i in range(1, 5)}
    assert cfg["fallback"] == {} and cfg["compiles"] >= 4 and cfg["compile_seconds"] > 0
    assert record.calls == 8


def test_resnet50_with_cp_and_norm_eval(runtime: Callable[..., Runtime]) -> None:
    rt = runtime({"LOONGKIT_COMPILE_RESNET": "1"})
    record = rt.records["compile_resnet"]
    torch.manual_seed(0)
    a = build(depth=50, with_cp=True, norm_eval=True)
    assert all(getattr(a, n)._compiled_call_impl is None for n in a.res_layers)
    assert record.config["eager"] == {f"ResNet.layer{i}": "with_cp (reentrant checkpoint kept eager)"
                                      for i in range(1, 5)}
    a.train()
    assert not any(m.training for m in a.modules() if isinstance(m, torch.nn.BatchNorm2d))


def test_resnet_end_to_end_summary(run_loongkit: Callable[..., object]) -> None:
    pytest.importorskip("mmdet")
    code = textwrap.dedent("""
        import torch
        import mmdet.models
        from mmdet.registry import MODELS
        net = MODELS.build(dict(type="ResNet", depth=18, num_stages=1, out_indices=(0,), strides=(1,),
                                dilations=(1,)))
        out = net(torch.randn(1, 3, 32, 32))
        out[0].sum().backward()
        print("OK", tuple(out[0].shape))
    """)
    result = run_loongkit(code, env={"LOONGKIT_COMPILE_RESNET": "1", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK (1, 64, 8, 8)" in result.stdout
    row = result.feature("compile_resnet")
    assert row["state"] == "active" and row["calls"] == 1
    assert row["config"]["compiled"] == {"ResNet.layer1": 1} and row["config"]["compile_seconds"] > 0
    assert "compiled" in result.logs()
