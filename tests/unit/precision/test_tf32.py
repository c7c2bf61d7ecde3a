"""LOONGKIT_ALLOW_TF32 on the installed torch's real API (fp32_precision from 2.9, the legacy allow_tf32 flags
before), the legacy branch with a stand-in too, and end to end."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from loongkit_precision import tf32

torch = pytest.importorskip("torch")


NEW_API = tf32.new_api(torch.backends)
# Each API is tested for real where the installed torch has it (the compat rows run the older ones).
needs_new_api = pytest.mark.skipif(not NEW_API, reason=f"torch {torch.__version__} has no fp32_precision API "
                                   "(torch >= 2.9): its legacy allow_tf32 flags are tested instead")
needs_legacy_api = pytest.mark.skipif(NEW_API, reason=f"torch {torch.__version__} has the fp32_precision API: "
                                      "the legacy flags are tested for real on torch < 2.9 (nox -s compat-torch2.4)")


# -- the torch >= 2.9 fp32_precision API, for real, in a fresh interpreter (process-global state) --------
def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


@needs_new_api
def test_new_api_detected_by_attribute() -> None:
    assert tf32.new_api(torch.backends)
    legacy = SimpleNamespace(cuda=SimpleNamespace(matmul=SimpleNamespace(allow_tf32=False)))
    assert not tf32.new_api(legacy)


@needs_new_api
def test_new_api_sets_tf32_and_never_touches_legacy_flags() -> None:
    out = _python(
        "import torch; from loongkit_precision import tf32\n"
        "applied, kept = tf32.apply_new(torch.backends)\n"
        "b = torch.backends\n"
        "print(applied, kept, b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision)"
    )
    assert out == "{'matmul': 'tf32', 'conv': 'tf32', 'rnn': 'tf32'} {} tf32 tf32 tf32"


@needs_new_api
@pytest.mark.parametrize(("setup", "expected_kept"), [
    ("torch.backends.cuda.matmul.fp32_precision = 'ieee'", {"matmul": "ieee"}),
    ("torch.backends.cudnn.conv.fp32_precision = 'ieee'", {"conv": "ieee"}),
    ("torch.backends.cuda.matmul.allow_tf32 = False", {"matmul": "ieee"}),  # legacy API before us
    ("torch.backends.fp32_precision = 'ieee'", {"matmul": "ieee"}),  # inherited
])
def test_user_choice_is_kept(setup: str, expected_kept: dict[str, str]) -> None:
    out = _python(f"import torch; from loongkit_precision import tf32\n{setup}\n"
                  "applied, kept = tf32.apply_new(torch.backends)\nprint(kept)")
    kept = eval(out)  # a dict literal printed by the child
    for key, value in expected_kept.items():
        assert kept[key] == value


# The feature as its plugin declares it, activated and undone outside a Runtime in a fresh interpreter (the
# switches are process-global): defines b (torch.backends), impl, ctx and rec (its record).
_STANDALONE = (
    "import torch\n"
    "from loongkit_core.context import ActivationContext\n"
    "from loongkit_precision.plugin import plugin\n"
    "from loongkit_precision.tf32 import AllowTF32\n"
    "b = torch.backends\n"
    "feature = plugin.feature('allow_tf32')\n"
    "ctx = ActivationContext.standalone(feature); rec = ctx.record; impl = AllowTF32(feature)\n"
)


@needs_new_api
def test_deactivate_restores_exact_values() -> None:
    out = _python(
        _STANDALONE
        + "before = (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision)\n"
        "impl.activate(ctx, 'torch')\n"
        "during = b.cuda.matmul.fp32_precision\n"
        "impl.deactivate(ctx)\n"
        "after = (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision)\n"
        "print(during, before == after, rec.config, rec.reason)"
    ).splitlines()[-1]
    assert out == ("tf32 True {'matmul': 'tf32', 'cudnn': 'tf32', 'cudnn_rnn': 'tf32'} no CUDA device")


def _switches() -> tuple[str, str, str]:
    b = torch.backends
    return b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision


@needs_new_api
@pytest.mark.parametrize("cuda", [False, True])
def test_default_deactivate_restores_and_reapplies(loongkit_runtime, monkeypatch: pytest.MonkeyPatch,
                                                   cuda: bool) -> None:  # type: ignore[no-untyped-def]
    """apply -> the default FeatureImpl.deactivate (no override) -> the switches and the global hook
    dict are as found -> apply again sets them again. ``cuda``: the watch hook is installed too."""
    from loongkit_core.feature import State

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    torch.backends.cudnn.rnn.fp32_precision = "ieee"  # the user's choice: kept, and still there after undo
    try:
        before = _switches()
        hooks = dict(torch.nn.modules.module._global_forward_pre_hooks)
        rt = loongkit_runtime({"LOONGKIT_ALLOW_TF32": "1"}, activate={"allow_tf32": "torch"})
        record = rt.records["allow_tf32"]
        for _ in range(2):
            assert record.state == State.APPLIED
            assert _switches() == ("tf32", "tf32", "ieee")
            assert len(torch.nn.modules.module._global_forward_pre_hooks) == len(hooks) + int(cuda)
            rt.deactivate("allow_tf32")
            assert _switches() == before
            assert dict(torch.nn.modules.module._global_forward_pre_hooks) == hooks
            rt.activate(record, "torch")
        assert len(rt.contexts["allow_tf32"].patcher) == 2 + int(cuda)  # nothing stacked on the first apply
    finally:
        torch.backends.cudnn.rnn.fp32_precision = "tf32"


# -- the torch < 2.9 branch with a stand-in backend object ---------------------------------------------
class _LegacyTorch:
    def __init__(self, precision: str = "highest") -> None:
        self.precision = precision

    def get_float32_matmul_precision(self) -> str:
        return self.precision


def _legacy_backends(matmul: bool = False, cudnn: bool = True) -> SimpleNamespace:
    return SimpleNamespace(cuda=SimpleNamespace(matmul=SimpleNamespace(allow_tf32=matmul)),
                           cudnn=SimpleNamespace(allow_tf32=cudnn))


@needs_legacy_api
def test_legacy_flags_set_and_restored_on_real_torch() -> None:
    out = _python(
        _STANDALONE
        + "b.cuda.matmul.allow_tf32 = False\n"  # torch's default since 1.12, set explicitly for the check
        "before = (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32)\n"
        "impl.activate(ctx, 'torch')\n"
        "during = (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32)\n"
        "impl.deactivate(ctx)\n"
        "after = (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32)\n"
        "print(during, before == after, rec.config, rec.details['api'])"
    ).splitlines()[-1]
    assert out == "(True, True) True {'matmul': 'tf32', 'cudnn': 'tf32'} allow_tf32 (legacy)"


def test_legacy_sets_both_switches() -> None:
    backends = _legacy_backends()
    assert not tf32.new_api(backends)
    applied, kept = tf32.apply_legacy(backends, _LegacyTorch())
    assert applied == {"matmul": "tf32", "cudnn": "tf32"} and kept == {}
    assert backends.cuda.matmul.allow_tf32 is True and backends.cudnn.allow_tf32 is True


def test_legacy_keeps_users_matmul_precision() -> None:
    backends = _legacy_backends()
    applied, kept = tf32.apply_legacy(backends, _LegacyTorch("medium"))
    assert kept == {"matmul": "float32_matmul_precision=medium"}
    assert backends.cuda.matmul.allow_tf32 is False and applied["matmul"] == "ieee"


# -- end to end ---------------------------------------------------------------------------------------
CODE = "import torch; a = torch.randn(8, 8); print('ok', float((a @ a).sum()) == float((a @ a).sum()))"


def test_summary_row_on_cpu(run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = run_loongkit(CODE, {"LOONGKIT_ALLOW_TF32": "1"})
    assert r.returncode == 0, r.stderr and "ok True" in r.stdout
    row = r.feature("allow_tf32")
    if NEW_API:
        config, api = {"matmul": "tf32", "cudnn": "tf32", "cudnn_rnn": "tf32"}, "fp32_precision"
    else:
        config, api = {"matmul": "tf32", "cudnn": "tf32"}, "allow_tf32 (legacy)"
    assert row["config"] == config
    assert not row["active"] and row["reason"] == "no CUDA device"
    assert row["details"]["api"] == api
    # No training step and nothing ran: the Summary is in the log (stdout keeps the program's output).
    assert f"allow_tf32                       {config}  [no CUDA device]" in r.logs()


def test_under_loongkit_run(run_loongkit) -> None:  # type: ignore[no-untyped-def]
    launcher = shutil.which("loongkit-run") or str(Path(sys.executable).parent / "loongkit-run")
    r = run_loongkit(env={"LOONGKIT_ALL": "1"}, prelude=False, argv=[launcher, sys.executable, "-c", CODE])
    assert r.returncode == 0, r.stderr
    assert r.feature("allow_tf32")["state"] == "applied" and r.summaries_printed == 1


@needs_new_api
def test_users_ieee_kept_with_import_all(run_loongkit) -> None:  # type: ignore[no-untyped-def]
    code = ("import os, torch\ntorch.backends.cuda.matmul.fp32_precision = 'ieee'\n"
            "os.environ['LOONGKIT_ALLOW_TF32'] = '1'\nimport loongkit_core.all\n"
            "print('now', torch.backends.cuda.matmul.fp32_precision)")
    r = run_loongkit(code, {"LOONGKIT_LOGLEVEL": "info"}, prelude=False)
    assert "now ieee" in r.stdout, r.stderr
    row = r.feature("allow_tf32")
    assert row["config"]["matmul"] == "ieee" and row["details"]["kept_user_settings"] == {"matmul": "ieee"}
    assert "kept the user's precision setting" in r.logs()


def test_not_applicable_on_old_torch(run_loongkit, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # A stand-in torch distribution 1.13 shadows the real one's metadata: the gate reads metadata only.
    site = tmp_path / "site"
    dist = site / "torch-1.13.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 1.13.1\n")
    r = run_loongkit("print('hi')", {"LOONGKIT_ALLOW_TF32": "1", "PYTHONPATH": str(site)})
    row = r.feature("allow_tf32")
    assert row["state"] == "not applicable" and row["reason"] == "torch 1.13.1 outside >=2.0.0"


def test_bad_option_value(run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = run_loongkit(CODE, {"LOONGKIT_ALLOW_TF32": "tru", "LOONGKIT_ALL": "0"})
    assert r.summary["features"] == []  # type: ignore[index]
    assert "LOONGKIT_ALLOW_TF32='tru' is invalid" in r.logs()
