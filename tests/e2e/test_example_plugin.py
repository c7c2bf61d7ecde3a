"""The plugin authoring kit end to end: pip-install the example distribution and use it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loongkit_core.testing import clean_environ

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "loongkit-plugin-example"

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("example-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(EXAMPLE)], check=True)
    return target


def test_listed_by_loongkit_features(installed: Path) -> None:
    env = clean_environ()
    env["PYTHONPATH"] = str(installed)
    loongkit = shutil.which("loongkit") or str(Path(sys.executable).parent / "loongkit")
    out = subprocess.run([loongkit, "features"], env=env, capture_output=True, text=True, check=True).stdout
    assert "LOONGKIT_EXAMPLE_ANOMALY" in out and "plugin example 0.1.0" in out


TRAIN = ("import torch\nw = torch.ones(3, requires_grad=True)\nopt = torch.optim.SGD([w], lr=0.1)\n"
         "for _ in range(2):\n    (w * 2).sum().backward()\n    opt.step()\n"
         "print('anomaly', torch.is_anomaly_enabled())")


def test_activated_by_its_variable(installed: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = run_loongkit(TRAIN, {"PYTHONPATH": str(installed), "LOONGKIT_EXAMPLE_ANOMALY": "1"})
    assert r.returncode == 0, r.stderr
    assert "anomaly True" in r.stdout
    row = r.feature("example_anomaly")
    assert row["active"] and row["calls"] == 2 and row["config"] == {"check_nan": True}
    assert "example_anomaly                * {'check_nan': True}" in r.stdout


def test_level_3_only_under_all_3(installed: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = run_loongkit(TRAIN, {"PYTHONPATH": str(installed), "LOONGKIT_ALL": "1"})
    assert "anomaly False" in r.stdout
    r = run_loongkit(TRAIN, {"PYTHONPATH": str(installed), "LOONGKIT_ALL": "3"})
    assert "anomaly True" in r.stdout


def test_bad_option_falls_back(installed: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = run_loongkit(TRAIN, {"PYTHONPATH": str(installed), "LOONGKIT_EXAMPLE_ANOMALY": "1",
                             "LOONGKIT_EXAMPLE_ANOMALY_CHECK_NAN": "sometimes"})
    assert r.feature("example_anomaly")["config"] == {"check_nan": True}
    assert "LOONGKIT_EXAMPLE_ANOMALY_CHECK_NAN='sometimes' is invalid" in r.logs()


def test_default_deactivate_restores_and_reapplies(installed: Path, loongkit_runtime,  # type: ignore[no-untyped-def]
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The example has no deactivate of its own: the default one (ctx.patcher.undo()) puts back the
    anomaly mode found and the original Tensor.backward; activating again works the same."""
    import torch

    from loongkit_core.feature import State

    monkeypatch.syspath_prepend(str(installed))  # the pip-installed distribution and its entry point

    before = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    original_backward = torch.Tensor.__dict__["backward"]
    rt = loongkit_runtime({"LOONGKIT_EXAMPLE_ANOMALY": "1", "LOONGKIT_EXAMPLE_ANOMALY_CHECK_NAN": "0"},
                          activate={"example_anomaly": "torch"})
    record = rt.records["example_anomaly"]
    for rounds in (1, 2):
        assert record.state == State.APPLIED, record.reason
        assert (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) == (True, False)
        torch.ones(2, requires_grad=True).sum().backward()
        assert record.calls == rounds
        rt.deactivate("example_anomaly")
        assert (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) == before
        assert torch.Tensor.__dict__["backward"] is original_backward
        rt.activate(record, "torch")
    assert len(rt.contexts["example_anomaly"].patcher) == 2  # the mode and the wrapper, not stacked
