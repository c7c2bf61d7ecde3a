"""End to end: 2 ranks x 8 DataLoader workers on a 2-CPU node (fake tree) under torchrun, and workers' cv2."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from loongkit_numa.fake_cgroups import write_cgroup_tree

from loongkit_core.testing import free_port

pytest.importorskip("torch")

SCRIPT = """
import os
import torch
from torch.utils.data import DataLoader

loader = DataLoader(list(range(16)), batch_size=4, num_workers=8)
print(f"rank {os.environ['LOCAL_RANK']} num_workers={loader.num_workers}", flush=True)
"""

WARNING = "DataLoader num_workers=8 x 2 local ranks = 16 > 2 CPUs available to this node's job; suggest num_workers=1"


def warning_lines(logs: str, message: str) -> list[str]:
    return [line for line in logs.splitlines() if "level=warning" in line and message in line]


def _torchrun(tmp_path: Path, run_loongkit: Any, port: int, script_text: str = SCRIPT, **extra: str) -> Any:
    root = tmp_path / "sysroot"
    write_cgroup_tree(root, version=2, cpus="0-1", cpu_max="max 100000")
    script = tmp_path / "train.py"
    script.write_text(script_text)
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    env = {"LOONGKIT_CONFIG_GUARDS": "1", "LOONGKIT_SYSFS_ROOT": str(root), **extra}
    return run_loongkit(env=env, argv=[torchrun, "--nproc-per-node", "2", "--master-port", str(port), str(script)],
                        cwd=str(tmp_path), timeout=240)


@pytest.mark.slow
def test_two_ranks_eight_workers_warn_once_per_node(tmp_path: Path, run_loongkit: Any) -> None:
    r = _torchrun(tmp_path, run_loongkit, free_port())
    assert r.returncode == 0, r.stderr
    assert sorted(line for line in r.stdout.splitlines() if line.startswith("rank")) == [
        "rank 0 num_workers=8", "rank 1 num_workers=8"]
    lines = warning_lines(r.logs(), WARNING)
    assert len(lines) == 1 and "rank=0" in lines[0], r.logs()  # local rank 0 only
    row = r.feature("config_guards")
    assert row["active"] and WARNING in row["config"]["findings"]
    # torchrun set OMP_NUM_THREADS=1 because the user did not: not reported as the user's choice.
    assert row["details"]["user_thread_vars"]["OMP_NUM_THREADS"] == "torchrun default 1 (unset by the user)"


@pytest.mark.slow
def test_two_ranks_apply_fix_clamps_workers(tmp_path: Path, run_loongkit: Any) -> None:
    r = _torchrun(tmp_path, run_loongkit, free_port(), LOONGKIT_CONFIG_GUARDS_APPLY_FIX="1")
    assert r.returncode == 0, r.stderr
    assert sorted(line for line in r.stdout.splitlines() if line.startswith("rank")) == [
        "rank 0 num_workers=1", "rank 1 num_workers=1"]
    logs = r.logs()
    assert len(warning_lines(logs, WARNING)) == 1, logs
    assert len(warning_lines(logs, "DataLoader num_workers 8 -> 1")) == 1, logs  # each change, once per node
    assert "DataLoader num_workers 8 -> 1" in r.feature("config_guards")["config"]["changes"]


# Issue 17: the job sets its intra-op pool after torch's import (where the boot check ran), before
# its DataLoader; 4 threads x 2 ranks on 2 CPUs must be found like the inter-op pool and num_workers.
INTRA_SCRIPT = """
import os
import torch
from torch.utils.data import DataLoader

torch.set_num_threads(4)
loader = DataLoader(list(range(8)), batch_size=4, num_workers=2)
batches = sum(1 for _ in loader)
print(f"rank {os.environ['LOCAL_RANK']} threads={torch.get_num_threads()} batches={batches}", flush=True)
"""

INTRA = ("torch intra-op threads (torch.set_num_threads)=4 x 2 local ranks = 8 > 2 CPUs available to this node's "
         "job; suggest torch.set_num_threads(1)")


@pytest.mark.slow
@pytest.mark.parametrize("fix", ["0", "1"])
def test_two_ranks_intra_op_threads_set_by_the_job(tmp_path: Path, run_loongkit: Any, fix: str) -> None:
    r = _torchrun(tmp_path, run_loongkit, free_port(), INTRA_SCRIPT, LOONGKIT_CONFIG_GUARDS_APPLY_FIX=fix)
    assert r.returncode == 0, r.stderr
    threads = 1 if fix == "1" else 4
    assert sorted(line for line in r.stdout.splitlines() if line.startswith("rank")) == [
        f"rank 0 threads={threads} batches=2", f"rank 1 threads={threads} batches=2"]
    logs = r.logs()
    lines = warning_lines(logs, INTRA)
    assert len(lines) == 1 and "rank=0" in lines[0], logs  # local rank 0 only, once
    config = r.feature("config_guards")["config"]
    assert INTRA in config["findings"]
    assert any("inter-op threads" in f for f in config["findings"])  # what was found before, still found
    assert any("num_workers=2 x 2 local ranks" in f for f in config["findings"])
    if fix == "1":
        assert "torch.set_num_threads(1) (was 4)" in config["changes"]
        assert len(warning_lines(logs, "torch.set_num_threads(1) (was 4)")) == 1, logs


CV2_STANDIN = """
_threads = 8


def getNumThreads():
    return _threads


def setNumThreads(n):
    global _threads
    _threads = n
"""

WORKERS_SCRIPT = """
import cv2  # imported before the workers start, as data pipelines do
import torch
from torch.utils.data import DataLoader, Dataset


class Threads(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return cv2.getNumThreads()


if __name__ == "__main__":
    for ctx in ("fork", "spawn"):
        loader = DataLoader(Threads(), batch_size=None, num_workers=2, multiprocessing_context=ctx)
        print(ctx, sorted(set(int(x) for x in loader)), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("fix", ["0", "1"])
def test_cv2_threads_in_fork_and_spawn_workers(tmp_path: Path, run_loongkit: Any, fix: str) -> None:
    # OpenCV is not installed here; a stand-in with its two thread functions shows the worker hook.
    site = tmp_path / "site"
    site.mkdir()
    (site / "cv2.py").write_text(CV2_STANDIN)
    (tmp_path / "workers.py").write_text(WORKERS_SCRIPT)
    root = tmp_path / "sysroot"
    write_cgroup_tree(root, version=1, cpus="0-3", cfs_quota_us="-1")
    env = {"LOONGKIT_CONFIG_GUARDS": "1", "LOONGKIT_CONFIG_GUARDS_APPLY_FIX": fix, "LOONGKIT_SYSFS_ROOT": str(root),
           "PYTHONPATH": str(site)}
    r = run_loongkit(env=env, argv=[sys.executable, str(tmp_path / "workers.py")], cwd=str(tmp_path), timeout=240)
    assert r.returncode == 0, r.stderr
    expected = "[2]" if fix == "1" else "[8]"  # 4 CPUs // (2 workers x 1 rank)
    assert f"fork {expected}" in r.stdout and f"spawn {expected}" in r.stdout, r.stdout
    message = ("OpenCV threads=8 in each of 2 DataLoader workers x 1 local rank = 16 > 4 CPUs available to this "
               "node's job; suggest cv2.setNumThreads(2) in workers")
    assert len(warning_lines(r.logs(), message)) == 1, r.logs()  # worker 0 of the first worker set only


INTEROP_SCRIPT = """
import torch

print("interop at start", torch.get_num_interop_threads(), "intra", torch.get_num_threads(), flush=True)
torch.set_num_interop_threads(2)  # the user's own call after loongkit's fix must not raise
print("interop", torch.get_num_interop_threads(), flush=True)
"""


def test_apply_fix_threads_and_a_later_user_interop_call(tmp_path: Path, run_loongkit: Any) -> None:
    root = tmp_path / "sysroot"
    write_cgroup_tree(root, version=2, cpus="0-7", cpu_max="200000 100000")  # 2 CPUs of quota
    env = {"LOONGKIT_CONFIG_GUARDS": "1", "LOONGKIT_CONFIG_GUARDS_APPLY_FIX": "1", "LOONGKIT_SYSFS_ROOT": str(root),
           "LOCAL_RANK": "0", "RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "OMP_NUM_THREADS": "2"}
    r = run_loongkit(INTEROP_SCRIPT, env=env)
    assert r.returncode == 0, r.stderr
    assert "interop at start 1 intra 1" in r.stdout and "interop 1" in r.stdout, r.stdout
    logs = r.logs()
    assert len(warning_lines(logs, "torch.set_num_interop_threads(2) ignored")) == 1, logs
    changes = r.feature("config_guards")["config"]["changes"]
    assert "set OMP_NUM_THREADS 2 -> 1 for child processes" in changes
    assert any(c.startswith("torch.set_num_interop_threads(1) (was ") for c in changes)  # the host's default
