"""loongkit-ops features undo through the default FeatureImpl.deactivate (ctx.patcher.undo(); that no
impl overrides it and no module writes the feature record is the conformance check's, run on every
plugin): apply -> undo -> exactly the prior state -> apply again works. The compile features, the
torch.compile fixes and the fused optimizers here (stand-ins for mmdet / lerobot, the real transformers
and torch config objects); the model features (BEVFORMER, UNIAD, DAG) in
tests/unit/ops_models/test_ops_models_undo.py."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from loongkit_ops.compile import common
from loongkit_ops.plugin import plugin

from loongkit_core import requirements
from loongkit_core.feature import State
from loongkit_core.runtime import Runtime
from loongkit_core.testing import skip_outside_declaration


# -- helpers ---------------------------------------------------------------------------------------------
@pytest.fixture
def runtime(loongkit_runtime: Callable[..., Runtime]) -> Iterator[Callable[..., Runtime]]:
    torch._dynamo.reset()
    yield loongkit_runtime
    torch._dynamo.reset()


def fake_versions(monkeypatch: pytest.MonkeyPatch, **versions: str) -> None:
    real = requirements.installed

    def fake(module: str) -> Any:
        return requirements.Installed(module, module, versions[module]) if module in versions else real(module)

    monkeypatch.setattr(requirements, "installed", fake)


def fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> types.ModuleType:
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent not in sys.modules:
            monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def own(cls: type) -> dict[str, Any]:
    """What a patch could change on a class: its own attributes, by identity."""
    return dict(vars(cls))


def cycle(rt: Runtime, name: str, target: str, check: Callable[[], None], before: Callable[[], Any]) -> None:
    """Apply, check, undo (exact prior state, nothing left in the patcher), apply and check again."""
    record = rt.records[name]
    prior = before()
    for _ in range(2):
        rt.activate(record, target)
        assert record.state == State.APPLIED, record.reason
        check()
        rt.deactivate(name)
        assert before() == prior
        assert len(rt.contexts[name].patcher) == 0


# -- the compile features ----------------------------------------------------------------------------
class Stages(torch.nn.Module):
    """mmdet's ResNet in the shape the feature reads: ``res_layers`` naming stage modules."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = torch.nn.Linear(2, 2)
        self.res_layers = ["layer1"]


class PI0Pytorch(torch.nn.Module):
    def __init__(self, config: Any = None) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def needs_flag(module: Any, flag: str) -> None:
    """Skip where the installed torch's config has no ``flag`` for the fix to switch (older than its declaration)."""
    if not hasattr(module, flag):
        pytest.skip(f"torch {requirements.installed('torch').version} has no {module.__name__}.{flag}")


def test_compile_resnet_apply_undo_apply(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    skip_outside_declaration(plugin.feature("compile_resnet"), "torch")
    monkeypatch.setattr(common, "BACKEND", "aot_eager")
    fake_versions(monkeypatch, mmdet="3.3.0")
    fake_module(monkeypatch, "mmdet.models.backbones.resnet", ResNet=Stages)
    built: list[Stages] = []

    def check() -> None:
        built.append(Stages())
        assert built[-1].layer1._compiled_call_impl is not None

    cycle(runtime({"LOONGKIT_COMPILE_RESNET": "1"}), "compile_resnet", "mmdet.models.backbones.resnet", check,
          lambda: own(Stages))
    assert len(built) == 2 and all(m.layer1._compiled_call_impl is None for m in built)  # eager again


def test_compile_pi0_apply_undo_apply(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    skip_outside_declaration(plugin.feature("compile_pi0pytorch"), "torch")
    monkeypatch.setattr(common, "BACKEND", "aot_eager")
    target = "lerobot.policies.pi0.modeling_pi0"
    fake_module(monkeypatch, target, PI0Pytorch=PI0Pytorch)
    rt = runtime({"LOONGKIT_COMPILE_PI0PYTORCH": "1"})
    built: list[PI0Pytorch] = []

    record = rt.records["compile_pi0pytorch"]

    def check() -> None:
        built.append(PI0Pytorch())
        calls = record.calls
        built[-1].forward(torch.ones(1, 2))  # as lerobot calls it: the compiled forward runs
        assert record.calls == calls + 1
        assert record.config["compiled"] == {f"{target}.PI0Pytorch": 1}  # a fresh compiler

    cycle(rt, "compile_pi0pytorch", target, check, lambda: (own(PI0Pytorch), vars(plugin.impl(
        plugin.feature("compile_pi0pytorch"))).get("compiler")))
    calls = record.calls
    for model in built:  # undone: the class's own forward again, nothing left on the instances
        model.forward(torch.ones(1, 2))
        assert "forward" not in vars(model) and model._compiled_call_impl is None
    assert record.calls == calls


def test_openvla_apply_undo_apply(runtime: Callable[..., Runtime]) -> None:
    ml = pytest.importorskip("transformers.models.llama.modeling_llama")
    cfg = ml.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    built: list[Any] = []

    def check() -> None:
        built.append(ml.LlamaDecoderLayer(cfg, 0))
        assert built[-1]._compiled_call_impl is not None

    cycle(runtime({"LOONGKIT_OPENVLA": "1"}), "openvla", ml.__name__, check, lambda: own(ml.LlamaDecoderLayer))
    assert all(m._compiled_call_impl is None for m in built)


def test_mmdet_modules_apply_undo_apply(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    skip_outside_declaration(plugin.feature("mmdet_modules"), "torch")
    double = types.ModuleType("lk_registry_double")
    path = Path(__file__).parents[1] / "ops_models" / "mmcv1_registry_double.py"
    exec(compile(path.read_text(), str(path), "exec"), double.__dict__)
    fake_versions(monkeypatch, mmdet="2.28.2")
    monkeypatch.setattr(common, "BACKEND", "aot_eager")
    models = double.Registry("models")
    fake_module(monkeypatch, "mmdet.models.builder", MODELS=models)

    class CollisionLoss(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    models.register_module(module=CollisionLoss)
    built: list[Any] = []

    def check() -> None:
        built.append(models.build({"type": "CollisionLoss"}))
        assert built[-1]._compiled_call_impl is not None

    cycle(runtime({"LOONGKIT_MMDET_MODULES": "1"}), "mmdet_modules", "mmdet.models.builder", check,
          lambda: (own(CollisionLoss), dict(vars(models))))
    assert all(m._compiled_call_impl is None for m in built)


# -- the torch.compile fixes ------------------------------------------------------------------------------
def config_patch(request: pytest.FixtureRequest, module: Any, **values: Any) -> None:
    stack = contextlib.ExitStack()
    stack.enter_context(module.patch(**values))
    request.addfinalizer(stack.close)


def test_dynamic_shape_fix_apply_undo_apply(request: pytest.FixtureRequest, runtime: Callable[..., Runtime],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo.callback as callback
    import torch._dynamo.config as dconfig
    import torch._inductor.config as iconfig

    needs_flag(dconfig, "enable_cpp_symbolic_shape_guards")
    fake_versions(monkeypatch, torch="2.9.0")
    monkeypatch.delenv("TORCHINDUCTOR_COALESCE_TILING_ANALYSIS", raising=False)
    config_patch(request, dconfig, enable_cpp_symbolic_shape_guards=True)
    config_patch(request, iconfig, **{"triton.coalesce_tiling_analysis": True})
    rt = runtime({"LOONGKIT_DYNAMIC_SHAPE_FIX": "1"})
    record = rt.records["dynamic_shape_fix"]
    handler = callback.callback_handler

    def flags() -> Any:
        return (dconfig.enable_cpp_symbolic_shape_guards, iconfig.triton.coalesce_tiling_analysis,
                "run_start_callbacks" in vars(handler), list(handler.start_callbacks))

    prior = flags()
    assert prior[:3] == (True, True, False)
    for _ in range(2):
        for target in ("torch._dynamo.config", "torch._inductor.config"):
            rt.activate(record, target)
        assert record.state == State.APPLIED, record.reason
        assert flags() == (False, False, True, prior[3])  # the compile-start hook wrapped on the handler
        rt.deactivate("dynamic_shape_fix")
        assert flags() == prior and len(rt.contexts["dynamic_shape_fix"].patcher) == 0


def test_donated_buffer_fix_apply_undo_apply(request: pytest.FixtureRequest, runtime: Callable[..., Runtime],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo.backends.distributed as dist
    import torch._functorch.config as fconfig
    from loongkit_ops import fixes

    needs_flag(fconfig, "donated_buffer")
    fake_versions(monkeypatch, torch="2.8.0")
    monkeypatch.setattr(fixes, "DDP_FIX_MARKERS", ("NoSuchMarker",))  # this torch has the fix: hide it
    config_patch(request, fconfig, donated_buffer=True)
    rt = runtime({"LOONGKIT_DONATED_BUFFER_FIX": "1"})
    record = rt.records["donated_buffer_fix"]
    prior = (own(dist.DDPOptimizer), fconfig.donated_buffer)
    for _ in range(2):
        rt.activate(record, fixes.DDP_MODULE)
        assert record.state == State.APPLIED, record.reason
        wrapped = dist.DDPOptimizer.compile_fn
        with contextlib.suppress(Exception):  # no real DDP here: only the flag switch matters
            wrapped(types.SimpleNamespace(), None, [])
        assert fconfig.donated_buffer is False and record.config["switched_off"] is True
        rt.deactivate("donated_buffer_fix")
        assert (own(dist.DDPOptimizer), fconfig.donated_buffer) == prior


# -- the fused optimizers -----------------------------------------------------------------------------------
def test_fused_adamw_apply_undo_apply(runtime: Callable[..., Runtime]) -> None:
    params = [torch.nn.Parameter(torch.ones(2))]

    def check() -> None:
        opt = torch.optim.AdamW(params, lr=0.1)
        assert opt.param_groups[0]["fused"] is True
        params[0].grad = torch.ones(2)
        opt.step()

    torch.optim.AdamW(params)  # torch hooks the class's step at its first construction: before the snapshot
    rt = runtime({"LOONGKIT_FUSED_ADAMW": "1"})
    cycle(rt, "fused_adamw", "torch.optim", check, lambda: own(torch.optim.AdamW))
    assert torch.optim.AdamW(params).param_groups[0]["fused"] is None
    assert rt.records["fused_adamw"].calls == 2
