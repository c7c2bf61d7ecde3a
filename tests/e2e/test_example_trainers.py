"""The plain-PyTorch examples, shortened, under `loongkit compare`: the DDP classifier under torchrun
(2 CPU ranks) and the tiny Llama through HuggingFace Accelerate. Both use AdamW, which level 1 makes
fused: losses then match within float32 rounding (about one ulp per step), not bitwise."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loongkit_core.testing import TORCH_EXIT_RACE, clean_environ, free_port

ROOT = Path(__file__).resolve().parents[2]
LOONGKIT = shutil.which("loongkit") or str(Path(sys.executable).parent / "loongkit")


def compare(tmp_path: Path, command: list[str], losses: int, *options: str) -> tuple[str, dict]:
    out = tmp_path / "compare.json"
    env = clean_environ()
    env.update(LOONGKIT_LOGDIR=str(tmp_path / "logs"), OMP_NUM_THREADS="1")
    for _ in range(3):  # torchrun: torch's own exit race of a gloo rank is rerun (loongkit_core.testing)
        r = subprocess.run([LOONGKIT, "compare", "--json", str(out), "--losses", str(losses), "--tolerance", "1e-4",
                            "--strict-losses", *options, "--", *command],
                           env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
        if r.returncode == 0 or TORCH_EXIT_RACE not in r.stdout + r.stderr:
            break
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return r.stdout, json.loads(out.read_text())


def active(data: dict, name: str) -> bool:
    return any(row["name"] == name and row["active"] for row in data["summary"]["features"])


@pytest.mark.slow
def test_ddp_classifier_torchrun_two_ranks(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    command = [torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()),
               str(ROOT / "examples/train_classifier.py"), "--steps", "5", "--batch-size", "8", "--workers", "1"]
    stdout, data = compare(tmp_path, command, 5)
    # rank 0 logs: 5 losses per run, each rank's loss over its own half of the global batch
    assert len(data["baseline"]["losses"]) == 5 and len(data["loongkit"]["losses"]) == 5
    assert data["losses"]["compared"] == 5 and data["losses"]["max_rel_diff"] <= 1e-4
    assert active(data, "fused_adamw") and active(data, "pytorch")
    assert stdout.count("Loongkit Feature Summary") == 1  # local rank 0 prints; the agent prints nothing


def test_hf_llama_accelerate(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    command = [sys.executable, str(ROOT / "examples/hf_llama/train.py"), "--steps", "4", "--workers", "1",
               "--seq-len", "32", "--batch-size", "4"]
    # LOONGKIT_OPENVLA (compiling the decoder layers) has its own tests; keep this one fast.
    _, data = compare(tmp_path, command, 4, "--env", "LOONGKIT_OPENVLA=0")
    base = data["baseline"]["losses"]
    assert len(base) == 4 and len(data["baseline"]["step_times"]) == 4
    assert 5.0 < base[0] < 7.0  # about ln(512): an untrained model over a 512-token vocabulary
    assert data["losses"]["max_rel_diff"] <= 1e-4
    assert active(data, "fused_adamw")
