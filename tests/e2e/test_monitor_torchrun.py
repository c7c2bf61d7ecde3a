"""LOONGKIT_MONITOR under torchrun: two gloo DDP ranks, one slowed on purpose. The slowed rank is
flagged as a straggler and the other is not (under DDP both ranks' steps last as long; the fast rank
waits inside backward and DDP's buffer broadcast, which the monitor counts as synchronisation).
MAX_STEPS stops every rank at the same step with exit code 0."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from loongkit_core.testing import free_port

pytest.importorskip("torch")

SCRIPT = r'''
import sys, time
import torch, torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
steps, slow = int(sys.argv[1]), float(sys.argv[2])
torch.manual_seed(0)
# BatchNorm: DDP broadcasts its buffers at each forward, a second place where the fast rank waits
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for (x,) in DataLoader(TensorDataset(torch.randn(steps * 4, 8)), batch_size=4):
    if rank == 1:
        time.sleep(slow)  # the planted straggler
    time.sleep(0.01)
    loss = model(x).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
'''


def torchrun(run_loongkit: Any, tmp_path: Path, steps: int, slow: float, env: dict[str, str] | None = None) -> Any:
    script = tmp_path / "ddp.py"
    script.write_text(SCRIPT)
    launcher = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    return run_loongkit(argv=[launcher, "--nproc-per-node", "2", "--master-port", str(free_port()), str(script),
                              str(steps), str(slow)],
                        env={"LOONGKIT_MONITOR": "1", "OMP_NUM_THREADS": "1", **(env or {})}, timeout=300)


def details(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    return next(f for f in data["features"] if f["name"] == "monitor")["details"]["monitor"]


@pytest.mark.slow
def test_the_slowed_rank_is_flagged_and_the_other_is_not(run_loongkit: Any, tmp_path: Path) -> None:
    r = torchrun(run_loongkit, tmp_path, steps=40, slow=0.04)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rank0 = details(r.summary_path)
    rank1 = details(r.summary_path.with_name("summary.rank1.json"))
    assert rank0["distributed"] and rank1["distributed"]
    assert rank0["steps"] == rank1["steps"] == 40
    assert [s["rank"] for s in rank0["stragglers"]] == [1]
    scores = {int(k): v["straggler_score"] for k, v in rank0["ranks"].items()}
    assert scores[1] >= 0.10 > scores[0]
    # the planted 40 ms, seen as rank 1's own time over rank 0's (within scheduling noise)
    lag = rank0["ranks"]["1"]["own_median_s"] - rank0["ranks"]["0"]["own_median_s"]
    assert lag == pytest.approx(0.04, abs=0.015)
    # both ranks' steps last as long (DDP): the wall time alone could not tell them apart
    assert rank0["ranks"]["0"]["step_median_s"] == pytest.approx(rank0["ranks"]["1"]["step_median_s"], rel=0.1)
    assert "ranks" not in rank1  # only rank 0 gathers
    assert "rank 1: " in r.stdout and "<- straggler" in r.stdout
    assert r.stdout.count("<- straggler") == 1
    assert r.summaries_printed == 1


@pytest.mark.slow
def test_max_steps_stops_every_rank_at_the_same_step(run_loongkit: Any, tmp_path: Path) -> None:
    r = torchrun(run_loongkit, tmp_path, steps=40, slow=0.0, env={"LOONGKIT_MONITOR_MAX_STEPS": "7"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "done" not in r.stdout  # neither rank reached the script's end
    for path in (r.summary_path, r.summary_path.with_name("summary.rank1.json")):
        d = details(path)
        assert d["steps"] == 7 and d["stopped_at_max_steps"] is True
    assert "stopped at LOONGKIT_MONITOR_MAX_STEPS" in r.stdout
