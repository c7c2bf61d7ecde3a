"""The mmdet 2.x / mmcv-full 1.x RetinaNet example (examples/mmdet2_retinanet), shortened, under
`loongkit compare`: train_detector, DataContainer batches, MMDataParallel. Level-1 features other than
the compilers (COMPILE_RESNET, MMDET_MODULES: float32 reordering) must keep the losses bitwise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loongkit_data.datacontainer import NO_CUDA

from loongkit_core.testing import clean_environ

pytestmark = [pytest.mark.integration, pytest.mark.stack1]
ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "mmdet2_retinanet" / "train.py"
LOONGKIT = str(Path(sys.executable).parent / "loongkit")


def test_mmdet2_level1_bitwise(tmp_path: Path) -> None:
    mmcv = pytest.importorskip("mmcv")
    if not mmcv.__version__.startswith("1."):
        pytest.skip(f"needs mmcv-full 1.x, found mmcv {mmcv.__version__}")
    pytest.importorskip("mmdet.apis")
    out = tmp_path / "compare.json"
    env = clean_environ()
    env["LOONGKIT_LOGDIR"] = str(tmp_path / "logs")
    r = subprocess.run([LOONGKIT, "compare", "--json", str(out), "--losses", "4", "--strict-losses",
                        "--env", "LOONGKIT_COMPILE_RESNET=0", "--env", "LOONGKIT_MMDET_MODULES=0", "--",
                        sys.executable, str(EXAMPLE), "--iters", "4", "--images", "8", "--batch-size", "2",
                        "--workers", "1", "--scale", "256"],
                       env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert len(data["baseline"]["losses"]) == 4, r.stdout[-3000:]  # TextLoggerHook logged every iteration
    assert len(data["baseline"]["step_times"]) == 4
    assert data["losses"]["bitwise"], r.stdout
    rows = {row["name"]: row for row in data["summary"]["features"]}
    dc = rows["data_container"]
    # train_detector builds its loader through mmdet.apis.train's copy of build_dataloader.
    assert dc["state"] == "applied" and "mmdet.apis.train" in dc["config"]["build_dataloader"], dc
    if torch.cuda.is_available():
        assert dc["active"], dc  # the DataContainer batches were pinned
    else:  # torch cannot pin without a device: nothing pinned, and the Summary says why
        assert not dc["active"] and dc["reason"] == NO_CUDA, dc
    assert rows["pytorch"]["active"]
