"""Without a GPU/PPU, compile features stay off under LOONGKIT_ALL; their own variable still enables them."""

from __future__ import annotations

from pathlib import Path

from loongkit_core.runtime import Runtime
from loongkit_core.testing.topology import intel_2s_8gpu

COMPILERS = ("compile_resnet", "openvla", "mmdet_modules", "compile_pi0pytorch", "hf_acc_compile")


def _resolve(env: dict[str, str]) -> Runtime:
    rt = Runtime(env, arm=False)
    rt.boot(configure_logging=False)
    return rt


def test_no_accelerator_keeps_compilers_off_under_all(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    rt = _resolve({"LOONGKIT_ALL": "3", "LOONGKIT_SYSFS_ROOT": str(tmp_path)})
    for name in COMPILERS:
        record = rt.records[name]
        assert not record.enabled and record.reason.startswith("off by hardware policy: no GPU/PPU"), name
    assert "Off by hardware policy: compile_resnet" in rt.summary_text()
    assert rt.records["fused_adamw"].enabled  # only the compilers are affected


def test_explicit_variable_wins(tmp_path: Path) -> None:
    rt = _resolve({"LOONGKIT_ALL": "1", "LOONGKIT_OPENVLA": "1", "LOONGKIT_SYSFS_ROOT": str(tmp_path)})
    assert rt.records["openvla"].enabled and rt.records["openvla"].explicit


def test_with_gpus_the_compilers_follow_all(tmp_path: Path) -> None:
    intel_2s_8gpu(tmp_path / "sys")
    rt = _resolve({"LOONGKIT_ALL": "3", "LOONGKIT_SYSFS_ROOT": str(tmp_path / "sys")})
    assert all(rt.records[name].enabled for name in COMPILERS)
