"""LOONGKIT_MMDET_MODULES against an mmcv 1.x Registry test double (mmdet 2.x is not installed here; the
real-package test waits for an mmdet 2.x stack), and LOONGKIT_HF_ACC_COMPILE with the torch 2.10 gate
faked against the real accelerate and transformers."""

from __future__ import annotations

import copy
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from loongkit_ops.compile import common
from loongkit_ops.plugin import plugin as ops_plugin

from loongkit_core import requirements
from loongkit_core.feature import State
from loongkit_core.runtime import Runtime
from loongkit_core.testing import skip_outside_declaration

OPS = {feature.name: feature for feature in ops_plugin.features}  # the declarations the tests skip by


@pytest.fixture
def runtime(loongkit_runtime: Callable[..., Runtime]) -> Iterator[Callable[..., Runtime]]:
    torch._dynamo.reset()  # compiled code of one test must not serve the next
    yield loongkit_runtime
    torch._dynamo.reset()


def fake_versions(monkeypatch: pytest.MonkeyPatch, **versions: str) -> None:
    real = requirements.installed

    def fake(module: str) -> Any:
        if module in versions:
            return requirements.Installed(module, module, versions[module])
        return real(module)

    monkeypatch.setattr(requirements, "installed", fake)


# -- an mmcv 1.x Registry, as mmcv/utils/registry.py (1.3-1.7) behaves -----------------------------------
def build_from_cfg(cfg: dict[str, Any], registry: Registry, default_args: dict[str, Any] | None = None) -> Any:
    args = dict(cfg)
    obj_type = args.pop("type")
    obj_cls = registry.get(obj_type) if isinstance(obj_type, str) else obj_type
    if obj_cls is None:
        raise KeyError(f"{obj_type} is not in the {registry.name} registry")
    for key, value in (default_args or {}).items():
        args.setdefault(key, value)
    return obj_cls(**args)


class Registry:
    def __init__(self, name: str, build_func: Callable[..., Any] | None = None, parent: Registry | None = None):
        self._name = name
        self._module_dict: dict[str, type] = {}
        self._children: dict[str, Registry] = {}
        self.build_func = build_func or (parent.build_func if parent else build_from_cfg)
        self.parent = parent

    @property
    def name(self) -> str:
        return self._name

    @property
    def module_dict(self) -> dict[str, type]:
        return self._module_dict

    def get(self, key: str) -> type | None:
        if key in self._module_dict:
            return self._module_dict[key]
        return self.parent.get(key) if self.parent is not None else None

    def build(self, *args: Any, **kwargs: Any) -> Any:
        return self.build_func(*args, **kwargs, registry=self)

    def _register_module(self, module_class: type, module_name: str | None = None, force: bool = False) -> None:
        if not inspect.isclass(module_class):
            raise TypeError(f"module must be a class, but got {type(module_class)}")
        names = [module_name or module_class.__name__]
        for name in names:
            if not force and name in self._module_dict:
                raise KeyError(f"{name} is already registered in {self.name}")
            self._module_dict[name] = module_class

    def register_module(self, name: str | None = None, force: bool = False, module: type | None = None) -> Any:
        if module is not None:
            self._register_module(module_class=module, module_name=name, force=force)
            return module

        def _register(cls: type) -> type:
            self._register_module(module_class=cls, module_name=name, force=force)
            return cls

        return _register


TARGET = "mmdet.models.builder"
MMDET = {"LOONGKIT_MMDET_MODULES": "1"}


@pytest.fixture
def mmdet2(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    fake_versions(monkeypatch, mmdet="2.28.2")
    monkeypatch.setattr(common, "BACKEND", "aot_eager")
    for parent in ("mmdet", "mmdet.models"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    builder = types.ModuleType(TARGET)
    builder.MODELS = Registry("models", parent=Registry("mmcv models"))  # type: ignore[attr-defined]
    builder.LOSSES = builder.MODELS  # type: ignore[attr-defined]  # mmdet 2.x: every kind shares MODELS
    monkeypatch.setitem(sys.modules, TARGET, builder)
    return builder


class Before(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sin() * 2


def collision_loss_class() -> type:
    class CollisionLoss(torch.nn.Module):
        def __init__(self, weight: float = 1.0) -> None:
            super().__init__()
            self.weight = weight

        def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return self.weight * torch.relu(1.0 - (pred - target).norm(dim=-1)).mean()

    return CollisionLoss


def test_mmdet_modules_not_applicable_without_mmdet2(runtime: Callable[..., Runtime]) -> None:
    skip_outside_declaration(OPS["mmdet_modules"], "torch")
    record = runtime(MMDET).records["mmdet_modules"]
    assert record.state == State.NOT_APPLICABLE and "mmdet" in record.reason


def test_mmdet_modules_compiles_filtered_registrations(runtime: Callable[..., Runtime],
                                                       mmdet2: types.ModuleType) -> None:
    skip_outside_declaration(OPS["mmdet_modules"], "torch")
    mmdet2.MODELS.register_module(module=Before, name="Before")  # registered before activation
    rt = runtime({**MMDET, "LOONGKIT_COMPILE_MMDET_MODULES_FILTER": "CollisionLoss, Before"})
    record = rt.records["mmdet_modules"]
    rt.activate(record, TARGET)
    assert record.state == State.APPLIED, record.reason
    cls = mmdet2.LOSSES.register_module()(collision_loss_class())  # the user's project, after mmdet
    mmdet2.MODELS.register_module(name="Other")(collision_loss_class())

    loss = mmdet2.MODELS.build(dict(type="CollisionLoss", weight=0.5))
    other = mmdet2.MODELS.build(dict(type="Other"))
    assert loss._compiled_call_impl is not None and other._compiled_call_impl is None
    assert isinstance(loss, cls)
    ref = copy.deepcopy(loss)
    pred = torch.randn(4, 6, 2, requires_grad=True)
    target = torch.randn(4, 6, 2)
    out, want = loss(pred, target), ref(pred, target)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
    (g,) = torch.autograd.grad(out, pred)
    (h,) = torch.autograd.grad(want, pred)
    torch.testing.assert_close(g, h, rtol=1e-6, atol=1e-7)
    before = mmdet2.MODELS.build(dict(type="Before"))
    torch.testing.assert_close(before(pred), pred.sin() * 2)
    cfg = record.config
    assert cfg["filter"] == ["CollisionLoss", "Before"] and sorted(cfg["patched"]) == ["Before", "CollisionLoss"]
    assert cfg["compiled"] == {"CollisionLoss": 1, "Before": 1} and record.calls == 2

    rt.deactivate("mmdet_modules")
    assert "_register_module" not in vars(mmdet2.MODELS) and "__init__" not in vars(Before)


def test_mmdet_modules_bad_filter_uses_default(runtime: Callable[..., Runtime], mmdet2: types.ModuleType,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    skip_outside_declaration(OPS["mmdet_modules"], "torch")
    from loongkit_ops.compile.mmdet_modules import MMDetModulesOptions

    from loongkit_core.settings import load_settings

    options, warnings = load_settings(MMDetModulesOptions, environ={"LOONGKIT_COMPILE_MMDET_MODULES_FILTER": "a-b"})
    assert options.names == ("CollisionLoss",)
    assert any(w.startswith("LOONGKIT_COMPILE_MMDET_MODULES_FILTER='a-b' is invalid") for w in warnings), warnings
    rt = runtime({**MMDET, "LOONGKIT_COMPILE_MMDET_MODULES_FILTER": " , "})
    record = rt.records["mmdet_modules"]
    assert record.state == State.ARMED, record.reason
    rt.activate(record, TARGET)
    assert record.state == State.APPLIED
    assert record.config["filter"] == ["CollisionLoss"]


def test_mmdet_modules_broken_target(runtime: Callable[..., Runtime], mmdet2: types.ModuleType) -> None:
    skip_outside_declaration(OPS["mmdet_modules"], "torch")
    mmdet2.MODELS = object()  # type: ignore[attr-defined]
    rt = runtime(MMDET)
    record = rt.records["mmdet_modules"]
    rt.activate(record, TARGET)
    assert record.state == State.NOT_APPLICABLE
    assert record.reason == f"{TARGET}.MODELS is not an mmcv 1.x Registry (module_dict/_register_module)"


# -- HF_ACC_COMPILE ---------------------------------------------------------------------------------------
HF = {"LOONGKIT_HF_ACC_COMPILE": "1"}


def test_hf_acc_not_applicable_on_installed_torch(runtime: Callable[..., Runtime]) -> None:
    record = runtime(HF).records["hf_acc_compile"]
    assert record.state == State.NOT_APPLICABLE
    assert record.reason == f"torch {requirements.installed('torch').version} outside ==2.10.*"


@pytest.fixture
def accelerate_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState, PartialState

    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    yield accelerate
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def test_hf_acc_switches_inductor_on_and_guards(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch,
                                                accelerate_state: Any) -> None:
    from accelerate.utils import DynamoBackend

    fake_versions(monkeypatch, torch="2.10.0")
    rt = runtime(HF)
    record = rt.records["hf_acc_compile"]
    rt.activate(record, "accelerate")
    assert record.state == State.APPLIED, record.reason
    acc = accelerate_state.Accelerator(cpu=True)
    assert acc.state.dynamo_plugin.backend == DynamoBackend.INDUCTOR
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    prepared = acc.prepare(model)
    x = torch.randn(4, 8)
    torch.testing.assert_close(prepared(x), ref(x), rtol=1e-5, atol=1e-6)
    assert record.config["switched_on"] == 1 and record.calls == 1 and record.config["compiles"] >= 1


def test_hf_acc_keeps_user_backend(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch,
                                   accelerate_state: Any) -> None:
    from accelerate.utils import DynamoBackend

    fake_versions(monkeypatch, torch="2.10.1")
    rt = runtime(HF)
    rt.activate(rt.records["hf_acc_compile"], "accelerate")
    acc = accelerate_state.Accelerator(cpu=True, dynamo_backend="eager")
    assert acc.state.dynamo_plugin.backend == DynamoBackend.EAGER
    assert rt.records["hf_acc_compile"].config["user_backend"] == "eager"


def test_hf_acc_fa2_attention_interface_kept_out_of_graph(runtime: Callable[..., Runtime],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          accelerate_state: Any) -> None:
    modeling_utils = pytest.importorskip("transformers.modeling_utils")
    mapping = modeling_utils.AttentionInterface._global_mapping

    def flash_stand_in(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v, None

    monkeypatch.setitem(mapping, "flash_attention_2", flash_stand_in)
    fake_versions(monkeypatch, torch="2.10.0", transformers="4.57.1")
    captured: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        captured.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    def layer(q: torch.Tensor) -> torch.Tensor:
        out, _ = modeling_utils.ALL_ATTENTION_FUNCTIONS["flash_attention_2"](None, q, q, q, None)
        return out * 2

    q = torch.randn(2, 3, 5, 4)
    torch.compile(layer, backend=backend)(q)
    assert any("softmax" in t for t in captured)  # without the fix, dynamo traces into the attention call
    torch._dynamo.reset()
    captured.clear()
    rt = runtime(HF)
    record = rt.records["hf_acc_compile"]
    rt.activate(record, "accelerate")
    assert mapping["flash_attention_2"] is not flash_stand_in
    torch.testing.assert_close(torch.compile(layer, backend=backend)(q), layer(q))
    assert captured and not any("softmax" in t for t in captured)  # ran outside the graph
    assert "outside the compiled graph" in record.config["fa2_disabled"]
    accelerator = accelerate_state.Accelerator
    patched = {k: vars(accelerator)[k] for k in ("__init__", "prepare_model")}
    rt.deactivate("hf_acc_compile")  # the default deactivate: ctx.patcher.undo()
    assert mapping["flash_attention_2"] is flash_stand_in
    assert all(vars(accelerator)[k] is getattr(v, "__wrapped__", None) for k, v in patched.items())
    assert len(rt.contexts["hf_acc_compile"].patcher) == 0
    rt.activate(record, "accelerate")  # and again
    assert mapping["flash_attention_2"] is not flash_stand_in
    assert vars(accelerator)["__init__"] is not patched["__init__"].__wrapped__
    rt.deactivate("hf_acc_compile")
    assert mapping["flash_attention_2"] is flash_stand_in


def test_hf_acc_fa2_untouched_on_other_transformers(runtime: Callable[..., Runtime],
                                                    monkeypatch: pytest.MonkeyPatch, accelerate_state: Any) -> None:
    fake_versions(monkeypatch, torch="2.10.0", transformers="4.56.2")
    rt = runtime(HF)
    record = rt.records["hf_acc_compile"]
    rt.activate(record, "accelerate")
    assert record.config["fa2_disabled"] == "not needed (transformers is not 4.57.*)"
