"""The BEVFormer-tiny example (examples/bevformer_tiny), shortened, under `loongkit compare`.

LOONGKIT_BEVFORMER must recognise the example's own classes (registered in mmengine's MODELS by its
projects/ package) and patch every one of them; its code must run (the Summary's star); the losses
must agree as README command 1 checks them: the first loss (same weights, same batch) within the
fused kernels' 2e-5, the others within the drift training makes of any 1-ulp difference.
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
EXAMPLE = ROOT / "examples" / "bevformer_tiny" / "train.py"
LOONGKIT = str(Path(sys.executable).parent / "loongkit")
SHORT = ["--iters", "4", "--scenes", "1", "--frames", "6", "--workers", "1"]
CLASSES = ("TemporalSelfAttention", "SpatialCrossAttention", "MSDeformableAttention3D", "CustomMSDeformableAttention")
# README command 1's checks (noxfile.BEV_FIRST_TOLERANCE / BEV_TOLERANCE): the first loss within the
# fused kernels' 2e-5; the window within what training makes of a 1-ulp difference.
FIRST_TOLERANCE, TOLERANCE = 2e-5, 5e-2


def test_bevformer_example_patched_and_losses_within_tolerance(tmp_path: Path) -> None:
    pytest.importorskip("mmdet")
    pytest.importorskip("scipy")
    out = tmp_path / "compare.json"
    env = clean_environ()
    env["LOONGKIT_LOGDIR"] = str(tmp_path / "logs")
    command = [LOONGKIT, "compare", "--json", str(out), "--losses", "4", "--tolerance", str(TOLERANCE),
               "--first-tolerance", str(FIRST_TOLERANCE), "--strict-losses", "--", sys.executable, str(EXAMPLE),
               *SHORT]
    r = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert len(data["baseline"]["losses"]) == 4 and len(data["loongkit"]["losses"]) == 4, r.stdout[-3000:]
    assert data["losses"]["compared"] == 4
    assert data["losses"]["bitwise"] or data["losses"]["max_rel_diff"] <= TOLERANCE, data["losses"]
    assert data["first_loss"]["rel_diff"] <= FIRST_TOLERANCE, data["first_loss"]
    rows = {row["name"]: row for row in data["summary"]["features"]}
    bev = rows["bevformer"]
    assert bev["active"], bev  # the patched code ran: the Summary's star
    patched = " ".join(str(key) for key in (bev.get("details", {}).get("patched") or {}))
    for name in CLASSES:
        assert f"{name} (projects.mmdet3d_plugin" in patched, (name, bev)
    assert not bev.get("details", {}).get("not_applicable"), bev
    assert rows["fused_adamw"]["active"], rows["fused_adamw"]
    assert "Loongkit Feature Summary" in r.stdout
