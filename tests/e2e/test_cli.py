"""The loongkit command line: features, doctor, info."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from loongkit_core.testing import clean_environ

LOONGKIT = shutil.which("loongkit") or str(Path(sys.executable).parent / "loongkit")
SEED_VARIABLES = [
    "LOONGKIT_DATA_CONTAINER", "LOONGKIT_DATA_PREFETCH", "LOONGKIT_MMENGINE_DATA_PREFETCH", "LOONGKIT_IMNORMALIZE",
    "LOONGKIT_DISTORTION", "LOONGKIT_PYTORCH", "LOONGKIT_PAGE_CACHE_LIMIT", "LOONGKIT_NUMA_AFFINITY",
    "LOONGKIT_SUBCGROUPS", "LOONGKIT_CONFIG_GUARDS", "LOONGKIT_COMPILE_RESNET", "LOONGKIT_FUSED_ADAMW",
    "LOONGKIT_OPENVLA", "LOONGKIT_MMDET_MODULES", "LOONGKIT_DICE_LOSS", "LOONGKIT_DAG", "LOONGKIT_VOXELIZATION",
    "LOONGKIT_BEVFORMER", "LOONGKIT_UNIAD", "LOONGKIT_BEVFUSION", "LOONGKIT_HF_ACC_COMPILE",
    "LOONGKIT_DYNAMIC_SHAPE_FIX", "LOONGKIT_COMPILE_PI0PYTORCH", "LOONGKIT_DONATED_BUFFER_FIX", "LOONGKIT_ALLOW_TF32",
]
SEED_LEVELS = {"LOONGKIT_IMNORMALIZE": 3, "LOONGKIT_DISTORTION": 3, "LOONGKIT_PAGE_CACHE_LIMIT": 2,
               "LOONGKIT_SUBCGROUPS": 2, "LOONGKIT_VOXELIZATION": 3, "LOONGKIT_BEVFUSION": 3,
               "LOONGKIT_HF_ACC_COMPILE": 3}


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = clean_environ()
    full.update(env or {})
    return subprocess.run([LOONGKIT, *args], env=full, capture_output=True, text=True, timeout=120)


def test_features_lists_every_seed_variable_with_its_level() -> None:
    r = _run("features", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["env"]: row for row in json.loads(r.stdout)["features"]}
    for var in SEED_VARIABLES:
        assert var in rows, var
        assert rows[var]["level"] == SEED_LEVELS.get(var, 1), var
        assert rows[var]["applies_here"]  # "yes" or a reason
    assert rows["LOONGKIT_DONATED_BUFFER_FIX"]["applies_here"].startswith("not applicable: torch")


def test_features_text_and_enabled_marker() -> None:
    r = _run("features", env={"LOONGKIT_ALLOW_TF32": "1"})
    assert "LOONGKIT_ALLOW_TF32" in r.stdout and "[enabled now]" in r.stdout


def test_doctor(tmp_path: Path) -> None:
    r = _run("doctor", "--json", env={"LOONGKIT_ALL": "1", "LOONGKIT_SYSFS_ROOT": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["python"].startswith("3.") and report["versions"]["torch"].startswith("2.")
    assert report["settings"]["all"] == 1 and report["settings"]["sysfs_root"] == str(tmp_path)
    assert "allow_tf32" in report["enabled"]
    assert report["cpu_vendor"] == "unknown"  # an empty root: nothing to read, nothing raised


def test_info_shows_resolution_and_warnings() -> None:
    r = _run("info", "python", "train.py", env={"LOONGKIT_ALL": "1", "LOONGKIT_ALOW_TF32": "1"})
    assert r.returncode == 0
    assert "did you mean LOONGKIT_ALLOW_TF32?" in r.stdout
    assert "allow_tf32" in r.stdout and "will apply on import of torch" in r.stdout
