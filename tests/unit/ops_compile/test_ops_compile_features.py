"""The compile features through the runtime: applies, not applicable, broken target, bad option.

mmdet is not installed here: COMPILE_RESNET and MMDET_MODULES run against faithful stand-ins (the real
mmdet ResNet is tested in tests/integration/ops_compile). OPENVLA uses the real transformers Llama."""

from __future__ import annotations

import copy
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


@pytest.fixture
def cheap_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "BACKEND", "aot_eager")  # dynamo + AOTAutograd, no inductor codegen


def fake_versions(monkeypatch: pytest.MonkeyPatch, **versions: str) -> None:
    real = requirements.installed

    def fake(module: str) -> Any:
        if module in versions:
            return requirements.Installed(module, module, versions[module])
        return real(module)

    monkeypatch.setattr(requirements, "installed", fake)


def fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> types.ModuleType:
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent not in sys.modules:
            monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def activated(rt: Runtime, name: str, target: str | None) -> Any:
    record = rt.records[name]
    assert record.state == State.ARMED, record.reason
    rt.activate(record, target)
    return record


# -- COMPILE_RESNET (stand-in with mmdet's ResNet structure) -------------------------------------------
class Block(torch.nn.Module):
    def __init__(self, c: int, with_cp: bool) -> None:
        super().__init__()
        self.with_cp = with_cp
        self.conv = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def inner(x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x + self.bn(self.conv(x)))

        if self.with_cp and x.requires_grad:
            return torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=True)
        return inner(x)


class ResNet(torch.nn.Module):
    """mmdet's shape: stem, ``res_layers`` names, frozen_stages, norm_eval in train()."""

    def __init__(self, stages: int = 2, frozen_stages: int = -1, norm_eval: bool = False,
                 with_cp: bool = False) -> None:
        super().__init__()
        self.frozen_stages, self.norm_eval = frozen_stages, norm_eval
        self.stem = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.res_layers = []
        for i in range(stages):
            name = f"layer{i + 1}"
            self.add_module(name, torch.nn.Sequential(Block(4, with_cp), Block(4, with_cp)))
            self.res_layers.append(name)
        self._freeze_stages()

    def _freeze_stages(self) -> None:
        for i in range(1, self.frozen_stages + 1):
            m = getattr(self, f"layer{i}")
            m.eval()
            for p in m.parameters():
                p.requires_grad = False

    def train(self, mode: bool = True) -> ResNet:
        super().train(mode)
        self._freeze_stages()
        if mode and self.norm_eval:
            for m in self.modules():
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.eval()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.stem(x)
        outs = []
        for name in self.res_layers:
            x = getattr(self, name)(x)
            outs.append(x)
        return tuple(outs)


RESNET = {"LOONGKIT_COMPILE_RESNET": "1"}
RESNET_TARGET = "mmdet.models.backbones.resnet"


def test_resnet_not_applicable_without_mmdet(runtime: Callable[..., Runtime]) -> None:
    skip_outside_declaration(OPS["compile_resnet"], "torch")
    record = runtime(RESNET).records["compile_resnet"]
    assert record.state == State.NOT_APPLICABLE
    assert "mmdet" in record.reason


def test_resnet_not_applicable_outside_mmdet_range(runtime: Callable[..., Runtime],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    skip_outside_declaration(OPS["compile_resnet"], "torch")
    fake_versions(monkeypatch, mmdet="3.4.0")
    record = runtime(RESNET).records["compile_resnet"]
    assert record.state == State.NOT_APPLICABLE
    assert record.reason == "mmdet 3.4.0 outside <=3.3.0,>=1.0.0"


def _compare(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> None:
    oa, ob = a(x), b(x)
    for u, v in zip(oa, ob, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-12)
    if torch.is_grad_enabled():
        ws = [torch.randn_like(o) for o in oa]
        sum((o * w).sum() for o, w in zip(oa, ws, strict=True)).backward()
        sum((o * w).sum() for o, w in zip(ob, ws, strict=True)).backward()
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


def test_resnet_stages_compiled_and_equal(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch,
                                          cheap_backend: None) -> None:
    skip_outside_declaration(OPS["compile_resnet"], "torch")
    fake_versions(monkeypatch, mmdet="2.28.2")
    fake_module(monkeypatch, RESNET_TARGET, ResNet=ResNet)
    record = activated(runtime(RESNET), "compile_resnet", RESNET_TARGET)
    assert record.state == State.APPLIED, record.reason
    torch.manual_seed(0)
    a = ResNet(frozen_stages=1, norm_eval=False).double()
    b = copy.deepcopy(a)  # deep copies are eager: the reference
    assert a.layer1._compiled_call_impl is not None and b.layer1._compiled_call_impl is None
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    a.train()
    b.train()
    _compare(a, b, x)
    assert a.layer1.training is False and a.layer1[0].conv.weight.grad is None  # frozen stage stays frozen
    torch.testing.assert_close(a.layer2[0].bn.running_mean, b.layer2[0].bn.running_mean, rtol=1e-10, atol=1e-12)
    a.eval()
    b.eval()
    with torch.no_grad():
        _compare(a, b, x)
    a.train()
    b.train()
    _compare(a, b, x)
    assert record.calls >= 6
    assert record.config["compiled"] == {"ResNet.layer1": 1, "ResNet.layer2": 1}
    assert record.config["fallback"] == {}


def test_resnet_with_cp_stages_stay_eager(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch,
                                          cheap_backend: None) -> None:
    skip_outside_declaration(OPS["compile_resnet"], "torch")
    fake_versions(monkeypatch, mmdet="3.3.0")
    fake_module(monkeypatch, RESNET_TARGET, ResNet=ResNet)
    record = activated(runtime(RESNET), "compile_resnet", RESNET_TARGET)
    net = ResNet(with_cp=True)
    assert net.layer1._compiled_call_impl is None
    assert record.config["eager"] == {"ResNet.layer1": "with_cp (reentrant checkpoint kept eager)",
                                      "ResNet.layer2": "with_cp (reentrant checkpoint kept eager)"}


def test_resnet_broken_target(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    skip_outside_declaration(OPS["compile_resnet"], "torch")
    fake_versions(monkeypatch, mmdet="3.3.0")
    fake_module(monkeypatch, RESNET_TARGET)  # no ResNet class
    record = activated(runtime(RESNET), "compile_resnet", RESNET_TARGET)
    assert record.state == State.NOT_APPLICABLE
    assert record.reason == f"{RESNET_TARGET} has no ResNet nn.Module class"


def test_resnet_deactivate_restores(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch,
                                    cheap_backend: None) -> None:
    skip_outside_declaration(OPS["compile_resnet"], "torch")
    fake_versions(monkeypatch, mmdet="3.3.0")
    fake_module(monkeypatch, RESNET_TARGET, ResNet=ResNet)
    original = ResNet.__init__
    rt = runtime(RESNET)
    activated(rt, "compile_resnet", RESNET_TARGET)
    net = ResNet()
    assert ResNet.__init__ is not original
    rt.deactivate("compile_resnet")
    assert ResNet.__init__ is original and net.layer1._compiled_call_impl is None


# -- OPENVLA (real transformers, tiny Llama built in code, inductor) ------------------------------------
LLAMA = "transformers.models.llama.modeling_llama"


def test_openvla_llama_layers_compiled_equal(runtime: Callable[..., Runtime]) -> None:
    skip_outside_declaration(OPS["openvla"], "torch")
    ml = pytest.importorskip(LLAMA)
    record = activated(runtime({"LOONGKIT_OPENVLA": "1"}), "openvla", LLAMA)
    assert record.state == State.APPLIED, record.reason
    cfg = ml.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    a = ml.LlamaForCausalLM(cfg).double()
    b = copy.deepcopy(a)
    ids = torch.randint(0, 64, (2, 12))
    la, lb = a(input_ids=ids, labels=ids).loss, b(input_ids=ids, labels=ids).loss
    la.backward()
    lb.backward()
    # Llama's rotary embedding is computed in float32 even in a float64 model: float32-level tolerance.
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-7)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    assert record.config["compiled"] == {"LlamaDecoderLayer": 2}
    assert record.calls == 2 and record.config["compile_seconds"] > 0 and record.config["fallback"] == {}


def test_openvla_broken_target(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    skip_outside_declaration(OPS["openvla"], "torch")
    fake_module(monkeypatch, "fake_llama_target")
    record = activated(runtime({"LOONGKIT_OPENVLA": "1"}), "openvla", "fake_llama_target")
    assert record.state == State.NOT_APPLICABLE
    assert record.reason == "fake_llama_target has no LlamaDecoderLayer nn.Module class"


# -- COMPILE_PI0PYTORCH (stand-in with lerobot's module path, class name and forward signature) --------
PI0_TARGET = "lerobot.policies.pi0.modeling_pi0"


class PI0Pytorch(torch.nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.state_proj = torch.nn.Linear(4, 8)
        self.action_in_proj = torch.nn.Linear(3, 8)
        self.action_out_proj = torch.nn.Linear(8, 3)
        if config.compile_model:  # what lerobot/openpi do with their own switch
            self.forward = torch.compile(self.forward, backend="eager")

    def forward(self, images: Any, img_masks: Any, lang_tokens: Any, lang_masks: Any, state: torch.Tensor,
                actions: torch.Tensor, noise: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        t = time[:, None, None]
        x_t = t * noise + (1 - t) * actions
        h = torch.nn.functional.silu(self.action_in_proj(x_t) + self.state_proj(state)[:, None])
        return torch.nn.functional.mse_loss(noise - actions, self.action_out_proj(h), reduction="none")


def test_pi0_forward_compiled_equal(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch,
                                    cheap_backend: None) -> None:
    skip_outside_declaration(OPS["compile_pi0pytorch"], "torch")
    fake_module(monkeypatch, PI0_TARGET, PI0Pytorch=PI0Pytorch)
    record = activated(runtime({"LOONGKIT_COMPILE_PI0PYTORCH": "1"}), "compile_pi0pytorch", PI0_TARGET)
    assert record.state == State.APPLIED, record.reason
    torch.manual_seed(0)
    a = PI0Pytorch(types.SimpleNamespace(compile_model=False))
    b = copy.deepcopy(a)
    args = ([], [], None, None, torch.randn(2, 4), torch.randn(2, 5, 3), torch.randn(2, 5, 3), torch.rand(2))
    la, lb = a(*args).mean(), b(*args).mean()
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-7)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    assert record.calls == 1 and record.config["compiled"] == {f"{PI0_TARGET}.PI0Pytorch": 1}
    # lerobot's PI0Policy.forward calls `self.model.forward(...)`, bypassing nn.Module.__call__: compiled too
    torch.testing.assert_close(a.forward(*args).mean(), la.detach(), rtol=1e-6, atol=1e-7)
    assert record.calls == 2
    assert "forward" not in a.__dict__ and "forward" not in b.__dict__  # nothing on the instance: copies are eager

    own = PI0Pytorch(types.SimpleNamespace(compile_model=True))  # compiled by its config: left alone
    assert own._compiled_call_impl is None
    assert record.config["eager"] == {f"{PI0_TARGET}.PI0Pytorch": "already compiled by config.compile_model"}


OPENPI_TARGET = "openpi.models_pytorch.pi0_pytorch"


class OpenpiPI0Pytorch(torch.nn.Module):
    """openpi's signature and switch: `pytorch_compile_mode` compiles `sample_actions` only."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)
        if config.pytorch_compile_mode is not None:
            self.sample_actions = torch.compile(self.sample_actions, backend="eager")

    def sample_actions(self, observation: torch.Tensor) -> torch.Tensor:
        return self.proj(observation)

    def forward(self, observation: torch.Tensor, actions: torch.Tensor, noise: Any = None,
                time: Any = None) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.proj(observation), actions, reduction="none")


def test_pi0_openpi_forward_compiled_beside_its_own_switch(runtime: Callable[..., Runtime],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          cheap_backend: None) -> None:
    skip_outside_declaration(OPS["compile_pi0pytorch"], "torch")
    fake_module(monkeypatch, OPENPI_TARGET, PI0Pytorch=OpenpiPI0Pytorch)
    record = activated(runtime({"LOONGKIT_COMPILE_PI0PYTORCH": "1"}), "compile_pi0pytorch", OPENPI_TARGET)
    model = OpenpiPI0Pytorch(types.SimpleNamespace(pytorch_compile_mode="default"))
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    model.forward(x, y)  # openpi's switch compiled sample_actions only: the training forward is ours
    model(x, y)
    assert record.calls == 2 and record.config["compiled"] == {f"{OPENPI_TARGET}.PI0Pytorch": 1}
    assert record.config["eager"] == {}


def test_pi0_deactivate_restores_forward(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch,
                                        cheap_backend: None) -> None:
    skip_outside_declaration(OPS["compile_pi0pytorch"], "torch")
    fake_module(monkeypatch, PI0_TARGET, PI0Pytorch=PI0Pytorch)
    original = PI0Pytorch.__dict__["forward"]
    rt = runtime({"LOONGKIT_COMPILE_PI0PYTORCH": "1"})
    record = activated(rt, "compile_pi0pytorch", PI0_TARGET)
    assert PI0Pytorch.__dict__["forward"] is not original
    policy = PI0Pytorch(types.SimpleNamespace(compile_model=False))
    rt.deactivate("compile_pi0pytorch")
    assert PI0Pytorch.__dict__["forward"] is original and record.state != State.APPLIED
    args = ([], [], None, None, torch.randn(2, 4), torch.randn(2, 5, 3), torch.randn(2, 5, 3), torch.rand(2))
    policy.forward(*args)
    assert record.calls == 0


def test_pi0_not_applicable_on_old_torch(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    fake_versions(monkeypatch, torch="2.5.1")
    record = runtime({"LOONGKIT_COMPILE_PI0PYTORCH": "1"}).records["compile_pi0pytorch"]
    assert record.state == State.NOT_APPLICABLE and record.reason == "torch 2.5.1 outside >=2.6.0"


def test_pi0_broken_target(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    skip_outside_declaration(OPS["compile_pi0pytorch"], "torch")
    fake_module(monkeypatch, PI0_TARGET, PI0Pytorch=object)
    record = activated(runtime({"LOONGKIT_COMPILE_PI0PYTORCH": "1"}), "compile_pi0pytorch", PI0_TARGET)
    assert record.state == State.NOT_APPLICABLE
    assert record.reason == f"{PI0_TARGET} has no PI0Pytorch nn.Module class"
