"""The mmdet 3.x RetinaNet example (examples/mmdet_retinanet), shortened, under `loongkit compare`.

Level-1 features other than COMPILE_RESNET must leave the losses bitwise identical (plain SGD, seeded,
deterministic). COMPILE_RESNET (inductor) reorders float32 sums: its losses may differ, but only by
rounding, so the first difference is tiny (a feature that changed the computation would jump).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loongkit_core.testing import clean_environ

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "mmdet_retinanet" / "train.py"
LOONGKIT = str(Path(sys.executable).parent / "loongkit")
SHORT = ["--iters", "4", "--images", "8", "--batch-size", "2", "--workers", "1", "--scale", "256"]


def compare(tmp_path: Path, *options: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    pytest.importorskip("mmdet")
    out = tmp_path / "compare.json"
    env = clean_environ()
    env["LOONGKIT_LOGDIR"] = str(tmp_path / "logs")
    r = subprocess.run([LOONGKIT, "compare", "--json", str(out), "--losses", "4", *options, "--",
                        sys.executable, str(EXAMPLE), *SHORT], env=env, capture_output=True, text=True,
                       timeout=600, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return r, json.loads(out.read_text())


def rows(data: dict) -> dict[str, dict]:
    return {row["name"]: row for row in data["summary"]["features"]}


def test_level1_without_compile_is_bitwise(tmp_path: Path) -> None:
    r, data = compare(tmp_path, "--env", "LOONGKIT_COMPILE_RESNET=0", "--strict-losses")
    assert data["baseline"]["losses"] and len(data["baseline"]["losses"]) == 4  # mmengine logged every iter
    assert len(data["baseline"]["step_times"]) == 4 and len(data["baseline"]["data_times"]) == 4
    assert data["losses"]["bitwise"], r.stdout
    assert "first 4 losses: bitwise identical" in r.stdout
    features = rows(data)
    assert features["pytorch"]["active"], features["pytorch"]  # the DataLoader path ran
    assert not features.get("compile_resnet", {}).get("active")  # LOONGKIT_COMPILE_RESNET=0 wins
    assert "Loongkit Feature Summary" in r.stdout


@pytest.mark.slow
def test_level1_with_compile_differs_only_by_rounding(tmp_path: Path) -> None:
    # Without a GPU the hardware policy keeps compile features off under LOONGKIT_ALL: force it here.
    r, data = compare(tmp_path, "--env", "LOONGKIT_COMPILE_RESNET=1")
    assert rows(data)["compile_resnet"]["active"], r.stdout[-3000:]
    first = data["first_difference"]
    # Identical, or first different by float32 rounding (mmengine prints 7 digits: ~1e-7 relative).
    assert first is None or first["rel_diff"] < 1e-5, (first, data["baseline"]["losses"], data["loongkit"]["losses"])
