"""`loongkit tune` end to end: the real monitor, loongkit-run, LOONGKIT_DATALOADER_WORKERS, torchrun.

The job's data loading waits (like reading files) rather than computing, so more DataLoader workers
make it truly faster even on a loaded 2-core machine; LOONGKIT_ALL=1 is planted to crash and
LOONGKIT_ALL=2 to change the losses. Tune must choose the worker count and exclude both, with the
reason, inside its budget.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loongkit_core.testing import clean_environ

LOONGKIT = shutil.which("loongkit") or str(Path(sys.executable).parent / "loongkit")
TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")

JOB = """
import os, time
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

class Waiting(Dataset):
    def __len__(self):
        return 4096
    def __getitem__(self, i):
        time.sleep(0.03)  # waits like a file read: workers overlap it
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), i % 2

if os.environ.get("PLANT") and os.environ.get("LOONGKIT_ALL") == "1":
    raise RuntimeError("planted crash under LOONGKIT_ALL=1")
shift = 0.5 if os.environ.get("PLANT") and os.environ.get("LOONGKIT_ALL") == "2" else 0.0
distributed = "RANK" in os.environ
if distributed:
    torch.distributed.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
if distributed:
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = Waiting()
sampler = DistributedSampler(data, shuffle=False) if distributed else None
loader = DataLoader(data, batch_size=8, num_workers=0, sampler=sampler)
for step, (x, y) in enumerate(loader):
    # The step's own work (a wait, like the data): longer than two workers take per batch (240 ms / 2), so
    # with two workers the main process is the bottleneck and every step lasts ~130 ms. Without it their
    # steps alternate between the two workers' start offset and the rest of the 240 ms period, and the
    # median is that offset (39 ms at load 2 here): a second worker started over 200 ms late (a loaded or
    # slower machine) would leave workers=2 no 1.3x over the baseline.
    time.sleep(0.13)
    loss = F.cross_entropy(model(x), y) + shift
    opt.zero_grad(); loss.backward(); opt.step()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"step {step} loss: {loss.item():.6f}", flush=True)
if distributed:
    torch.distributed.destroy_process_group()
"""


def tune(tmp_path: Path, command: list[str], *args: str, plant: bool, timeout: float) -> tuple[dict, str]:
    env = clean_environ()
    if plant:
        env["PLANT"] = "1"
    out = tmp_path / "out"
    proc = subprocess.run([LOONGKIT, "tune", "--out", str(out), *args, "--", *command], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "tune.json").read_text()), proc.stdout


@pytest.mark.slow
def test_tune_chooses_the_worker_count_and_excludes_the_planted(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    doc, stdout = tune(tmp_path, [sys.executable, str(script)], "--steps", "12", "--budget", "4",
                       "--max-level", "2", "--repeats", "2", plant=True, timeout=300)
    assert doc["elapsed_s"] <= 240
    base = doc["baseline"]
    # The real monitor's figures: a loader with no workers, waiting most of the step.
    assert base["trials"][0]["workers"] == 0 and base["data_wait_share"] > 0.3
    ranked = {r["key"]: r for r in doc["ranked"]}
    assert doc["ranked"][0]["key"] == "workers=2", stdout
    assert doc["winner"]["env"] == {"LOONGKIT_DATALOADER_WORKERS": "1", "LOONGKIT_DATALOADER_WORKERS_COUNT": "2"}
    assert ranked["workers=2"]["trials"][0]["workers"] == 2  # the feature really changed the job's loader
    assert ranked["workers=2"]["speedup"] > 1.3
    assert ranked["ALL=1"]["status"] == "excluded"
    assert ranked["ALL=1"]["reason"] == "crashed: exit code 1 (RuntimeError: planted crash under LOONGKIT_ALL=1)"
    assert ranked["ALL=2"]["status"] == "excluded" and ranked["ALL=2"]["reason"].startswith("changes results")
    assert "export LOONGKIT_DATALOADER_WORKERS_COUNT=2" in stdout and " winner " in stdout
    assert (tmp_path / "out" / "tune.png").exists() or "matplotlib not installed" in stdout


@pytest.mark.slow
def test_tune_under_torchrun_reads_rank_zero(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    command = [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script)]
    doc, stdout = tune(tmp_path, command, "--steps", "12", "--budget", "1", "--max-level", "1",
                       "--repeats", "1", plant=False, timeout=300)
    # What this test is for is rank 0's figures under torchrun (the baseline trial); a 1-minute budget
    # keeps it to the baseline and a trial or two (4 minutes took 109 s of CI for trials it never checked).
    assert doc["elapsed_s"] <= 120
    first = doc["baseline"]["trials"][0]
    assert first["ok"] and first["steps"] == 12, stdout
    assert Path(first["summary"]).exists()  # rank 0's file: the template path itself
    assert "loongkit tune:" in stdout and "median step" in stdout
