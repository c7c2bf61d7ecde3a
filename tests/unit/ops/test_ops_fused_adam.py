"""LOONGKIT_FUSED_ADAMW / LOONGKIT_FUSED_ADAM: applies, equivalence with torch's own unfused code,
fallbacks, checkpoints, GradScaler, version gate, broken target, bad value, hardware policy, end to end.

Tolerance: the fused kernel evaluates the same update as one expression per element (vectorised,
with fused multiply-adds and the bias corrections folded), torch's for-loop path as a chain of
tensor ops, so single steps differ by about one float32 ulp; after 20 steps with lr 1e-2 the largest
difference seen is 1.2e-7 on parameters of magnitude ~0.1-1. We assert atol=1e-6, rtol=1e-5.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from loongkit_core import requirements
from loongkit_core.feature import State
from loongkit_core.runtime import Runtime

ATOL, RTOL = 1e-6, 1e-5


@pytest.fixture
def runtime(loongkit_runtime: Callable[..., Runtime]) -> Callable[..., Runtime]:
    """Boot a Runtime on an explicit environment, activate the named features on torch.optim."""

    def make(environ: dict[str, str], activate: tuple[str, ...] = ("fused_adamw", "fused_adam")) -> Runtime:
        return loongkit_runtime(environ, dict.fromkeys(activate, "torch.optim"))

    return make


BOTH = {"LOONGKIT_FUSED_ADAMW": "1", "LOONGKIT_FUSED_ADAM": "1"}


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.GELU(), torch.nn.Linear(65, 7))


def train(m: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor],
          scaler: Any = None) -> None:
    for x in batches:
        opt.zero_grad()
        loss = m(x).pow(2).mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)


def fresh_batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())  # fresh data per run
    return [torch.randn(16, 33, generator=g) for _ in range(n)]


# -- applies -------------------------------------------------------------------------------------
def test_adamw_and_adam_are_fused_and_marked_active(runtime: Callable[..., Runtime]) -> None:
    rt = runtime(BOTH)
    m = model(0)
    adamw = torch.optim.AdamW(m.parameters(), lr=1e-3)
    adam = torch.optim.Adam(m.parameters(), lr=1e-3)
    for opt in (adamw, adam):
        assert all(g["fused"] is True for g in opt.param_groups)
        assert opt.defaults["fused"] is True and opt._step_supports_amp_scaling is True
    assert rt.records["fused_adamw"].calls == 0  # created, not yet stepped
    train(m, adamw, fresh_batches(2))
    train(m, adam, fresh_batches(1))
    assert rt.records["fused_adamw"].calls == 2 and rt.records["fused_adam"].calls == 1
    assert rt.records["fused_adamw"].config == {"fused": 1, "fallback": {}}
    assert rt.records["fused_adam"].config == {"fused": 1, "fallback": {}}
    assert all(s["step"].dtype == torch.float32 for s in adamw.state.values())


def test_adam_feature_alone_leaves_adamw_alone(runtime: Callable[..., Runtime]) -> None:
    # torch's AdamW subclasses Adam: the Adam patch must not fuse AdamW behind FUSED_ADAMW=0's back.
    runtime({"LOONGKIT_FUSED_ADAM": "1"}, activate=("fused_adam",))
    m = model(0)
    assert torch.optim.AdamW(m.parameters()).param_groups[0]["fused"] is None
    assert torch.optim.Adam(m.parameters()).param_groups[0]["fused"] is True


def test_registry_held_class_reference_and_subclass(runtime: Callable[..., Runtime]) -> None:
    held = torch.optim.AdamW  # what mmengine's OPTIMIZERS registry keeps

    class MyAdamW(torch.optim.AdamW):
        pass

    runtime(BOTH)
    m = model(0)
    assert held(m.parameters()).param_groups[0]["fused"] is True
    assert MyAdamW(m.parameters()).param_groups[0]["fused"] is True


def test_deactivate_restores_the_class(runtime: Callable[..., Runtime]) -> None:
    before = torch.optim.AdamW.__dict__["__init__"]
    rt = runtime(BOTH)
    assert torch.optim.AdamW.__dict__["__init__"] is not before
    rt.deactivate("fused_adamw")
    assert torch.optim.AdamW.__dict__["__init__"] is before
    assert "add_param_group" not in torch.optim.AdamW.__dict__
    assert torch.optim.AdamW(model(0).parameters()).param_groups[0]["fused"] is None


# -- equivalence with torch's unfused implementation ----------------------------------------------
CASES = {
    "default": {},
    "amsgrad+weight_decay": {"amsgrad": True, "weight_decay": 0.1},
    "maximize": {"maximize": True},
    "betas+eps": {"betas": (0.8, 0.99), "eps": 1e-6},
}


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_equals_unfused(runtime: Callable[..., Runtime], name: str, case: str) -> None:
    runtime(BOTH)
    cls = getattr(torch.optim, name)
    ours, ref = model(1), model(1)
    opt = cls(ours.parameters(), lr=1e-2, **CASES[case])
    base = cls(ref.parameters(), lr=1e-2, fused=False, **CASES[case])  # torch's own unfused path
    assert opt.param_groups[0]["fused"] is True and base.param_groups[0]["fused"] is False
    batches = fresh_batches(20)
    train(ours, opt, batches)
    train(ref, base, batches)
    assert_same(ours, ref)
    assert any((p - q).abs().max() > 0 for p, q in zip(ours.parameters(), model(1).parameters(), strict=True))


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_param_groups_with_different_lrs(runtime: Callable[..., Runtime], name: str) -> None:
    runtime(BOTH)
    cls = getattr(torch.optim, name)
    ours, ref = model(2), model(2)

    def groups(m: torch.nn.Module) -> list[dict[str, Any]]:
        return [{"params": m[0].parameters(), "lr": 3e-2, "weight_decay": 0.05},
                {"params": m[2].parameters(), "lr": 1e-3}]

    opt, base = cls(groups(ours), lr=1e-2), cls(groups(ref), lr=1e-2, fused=False)
    assert [g["fused"] for g in opt.param_groups] == [True, True]
    batches = fresh_batches(15)
    train(ours, opt, batches)
    train(ref, base, batches)
    assert_same(ours, ref)


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_grad_scaler(runtime: Callable[..., Runtime], name: str) -> None:
    runtime(BOTH)
    cls = getattr(torch.optim, name)
    ours, ref = model(3), model(3)
    opt, base = cls(ours.parameters(), lr=1e-2), cls(ref.parameters(), lr=1e-2, fused=False)
    s1 = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    s2 = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    batches = fresh_batches(8)
    batches[3] = batches[3].clone()
    batches[3][0, 0] = float("inf")  # an overflow step: both must skip it and lower the scale
    train(ours, opt, batches, s1)
    train(ref, base, batches, s2)
    assert s1.get_scale() == s2.get_scale() < 2.0**10
    assert_same(ours, ref)


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_state_dict_round_trip(runtime: Callable[..., Runtime], name: str) -> None:
    runtime(BOTH)
    cls = getattr(torch.optim, name)
    first, second = fresh_batches(4), fresh_batches(4)
    ref = model(4)
    base = cls(ref.parameters(), lr=1e-2, amsgrad=True, fused=False)
    train(ref, base, first + second)

    # saved non-fused -> loaded into a (loongkit-)fused optimizer: fused must stay on
    a = model(4)
    a_plain = cls(a.parameters(), lr=1e-2, amsgrad=True, fused=False)
    train(a, a_plain, first)
    saved = copy.deepcopy(a_plain.state_dict())
    assert saved["param_groups"][0]["fused"] is False
    saved["param_groups"][0]["fused"] = None  # what an unpatched, default AdamW writes
    a_fused = cls(a.parameters(), lr=1e-2, amsgrad=True)
    a_fused.load_state_dict(saved)
    assert a_fused.param_groups[0]["fused"] is True and a_fused._step_supports_amp_scaling
    train(a, a_fused, second)
    assert_same(a, ref)

    # saved fused -> loaded into torch's unfused optimizer: the checkpoint carries the user's fused
    b = model(4)
    b_fused = cls(b.parameters(), lr=1e-2, amsgrad=True)
    train(b, b_fused, first)
    saved = copy.deepcopy(b_fused.state_dict())
    assert saved["param_groups"][0]["fused"] is None
    assert b_fused.param_groups[0]["fused"] is True  # saving did not touch the live optimizer
    b_plain = cls(b.parameters(), lr=1e-2, amsgrad=True, fused=False)
    b_plain.load_state_dict(saved)
    assert b_plain.param_groups[0]["fused"] is None
    train(b, b_plain, second)
    assert_same(b, ref)


# -- fallbacks ----------------------------------------------------------------------------------
def _complex_param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (lambda m: torch.optim.AdamW(m.parameters(), differentiable=True), "differentiable=True"),
        (lambda m: torch.optim.AdamW(m.parameters(), foreach=True), "foreach=True set by user"),
        (lambda m: torch.optim.AdamW(m.parameters(), fused=False), "fused=False set by user"),
        (lambda m: torch.optim.AdamW([{"params": m.parameters(), "foreach": True}]), "foreach=True set by user"),
        (lambda m: torch.optim.AdamW([_complex_param()]), "complex parameters"),
        (lambda m: torch.optim.AdamW([torch.nn.Parameter(torch.randn(3, device="meta"))]),
         "device meta has no fused kernel"),
        (lambda m: torch.optim.AdamW([torch.nn.Parameter(torch.randn(3, 3).to_sparse())]), "sparse parameters"),
    ],
)
def test_fallbacks(runtime: Callable[..., Runtime], build: Callable[[torch.nn.Module], Any], reason: str) -> None:
    rt = runtime(BOTH)
    opt = build(model(0))
    assert not any(g["fused"] for g in opt.param_groups)
    assert not getattr(opt, "_step_supports_amp_scaling", False)
    assert rt.records["fused_adamw"].config == {"fused": 0, "fallback": {reason: 1}}


def test_user_fused_true_and_custom_step(runtime: Callable[..., Runtime]) -> None:
    rt = runtime(BOTH)

    class Custom(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:  # e.g. a clipping wrapper around torch's step
            return super().step(closure)

    m = model(0)
    assert torch.optim.AdamW(m.parameters(), fused=True).param_groups[0]["fused"] is True
    assert Custom(m.parameters()).param_groups[0]["fused"] is None
    assert rt.records["fused_adamw"].config == {
        "fused": 0, "fallback": {"fused=True set by user": 1, "Custom overrides step()": 1}}


def test_add_param_group_with_complex_params_unfuses(runtime: Callable[..., Runtime]) -> None:
    rt = runtime(BOTH)
    m = model(0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    assert opt.param_groups[0]["fused"] is True
    opt.add_param_group({"params": [_complex_param()]})
    assert [g["fused"] for g in opt.param_groups] == [None, None]
    assert opt._step_supports_amp_scaling is False
    train(m, opt, fresh_batches(1))  # still steps (torch's unfused path)
    assert rt.records["fused_adamw"].config == {"fused": 0, "fallback": {"add_param_group: complex parameters": 1}}
    opt2 = torch.optim.AdamW(m[0].parameters())
    opt2.add_param_group({"params": m[2].parameters(), "lr": 0.1})
    assert [g["fused"] for g in opt2.param_groups] == [True, True]


# -- gates ---------------------------------------------------------------------------------------
def test_not_applicable_on_old_torch(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    real = requirements.installed

    def fake(module: str) -> Any:
        return requirements.Installed("torch", "torch", "2.3.1") if module == "torch" else real(module)

    monkeypatch.setattr(requirements, "installed", fake)
    rt = runtime(BOTH)
    for name in ("fused_adamw", "fused_adam"):
        assert rt.records[name].state == State.NOT_APPLICABLE
        assert rt.records[name].reason == "torch 2.3.1 outside >=2.4.0"
    assert torch.optim.AdamW(model(0).parameters()).param_groups[0]["fused"] is None


def test_broken_target_signature_without_fused(runtime: Callable[..., Runtime],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    class OldAdamW(torch.optim.Optimizer):
        def __init__(self, params: Any, lr: float = 1e-3) -> None:
            super().__init__(params, {"lr": lr})

    monkeypatch.setattr(torch.optim, "AdamW", OldAdamW)
    monkeypatch.delattr(torch.optim, "Adam")
    rt = runtime(BOTH)
    assert rt.records["fused_adamw"].state == State.NOT_APPLICABLE
    assert rt.records["fused_adamw"].reason == "torch.optim.AdamW.__init__ has no 'fused' parameter"
    assert rt.records["fused_adam"].state == State.NOT_APPLICABLE
    assert rt.records["fused_adam"].reason == "torch.optim has no optimizer class Adam"
    assert "__init__" in OldAdamW.__dict__ and not hasattr(OldAdamW.__init__, "__loongkit_feature__")


def test_bad_value_is_a_warning_and_the_default(run_loongkit: Callable[..., Any]) -> None:
    result = run_loongkit(
        "import torch\nm = torch.nn.Linear(2, 2)\nprint(torch.optim.AdamW(m.parameters()).param_groups[0]['fused'])",
        env={"LOONGKIT_FUSED_ADAMW": "maybe", "LOONGKIT_ALLOW_TF32": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "None"
    assert "LOONGKIT_FUSED_ADAMW='maybe' is invalid" in result.logs()
    assert not any(r["name"] == "fused_adamw" and r["enabled"] for r in result.summary["features"])


# -- hardware policy -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("vendor", "environ", "enabled"),
    [
        ("0x10de", {"LOONGKIT_ALL": "1"}, False),  # NVIDIA: off by default
        ("0x10de", {"LOONGKIT_ALL": "1", "LOONGKIT_FUSED_ADAMW": "1"}, True),  # the variable wins
        ("0x1ded", {"LOONGKIT_ALL": "1"}, True),  # PPU: on
        ("0x1ded", {"LOONGKIT_ALL": "1", "LOONGKIT_FUSED_ADAMW": "0"}, False),
    ],
)
def test_hardware_policy(runtime: Callable[..., Runtime], fake_sysfs: Callable[..., Any], vendor: str,
                         environ: dict[str, str], enabled: bool) -> None:
    topo = fake_sysfs(gpu_vendor=vendor)
    rt = runtime({**environ, "LOONGKIT_SYSFS_ROOT": str(topo.root)}, activate=())
    record = rt.records["fused_adamw"]
    assert record.enabled is enabled
    assert record.policy.startswith("NVIDIA" if vendor == "0x10de" else "Pingtouge PPU")
    assert rt.records["fused_adam"].policy == ""  # the seed's policy names FUSED_ADAMW only


def test_no_gpu_no_policy(runtime: Callable[..., Runtime], fake_sysfs: Callable[..., Any]) -> None:
    topo = fake_sysfs(gpus_per_node=(0, 0))
    rt = runtime({"LOONGKIT_ALL": "1", "LOONGKIT_SYSFS_ROOT": str(topo.root)}, activate=())
    assert rt.records["fused_adamw"].enabled and rt.records["fused_adamw"].policy == ""


# -- end to end ----------------------------------------------------------------------------------
TRAIN = """
import torch
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
for _ in range(5):
    opt.zero_grad()
    m(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
print("fused", opt.param_groups[0]["fused"])
"""


def test_end_to_end_summary(run_loongkit: Callable[..., Any]) -> None:
    result = run_loongkit(TRAIN, env={"LOONGKIT_FUSED_ADAMW": "1", "LOONGKIT_LOGLEVEL": "info"})
    assert result.returncode == 0, result.stderr
    assert "fused True" in result.stdout
    row = result.feature("fused_adamw")
    assert row["active"] and row["calls"] == 5 and row["state"] == "active"
    assert row["config"] == {"fused": 1, "fallback": {}}
    assert "fused_adamw                    * {'fused': 1, 'fallback': {}}" in result.stdout
    assert "optimizer fused" in result.logs()
