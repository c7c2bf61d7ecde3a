"""loongkit-numa logs through the core's logger (ctx.log): what its callbacks say in a DataLoader worker
lands in the job's loongkit log, the file the Summary's ``Log:`` names (forked workers append to their
parent's file, each record with the worker's pid and role), not on the job's stderr.

A sub-cgroups data worker that cannot join its group warns (the real cgroup v1 cpuset of this machine,
where one can be used); a NUMA-bound data worker says where it was bound (a recorded 2-node topology over
CPUs 0 and 1)."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from loongkit_core.testing.topology import two_cpu_two_node, write_topology

pytest.importorskip("torch")

SCRIPT = """
import json, os, sys
import torch
from torch.utils.data import DataLoader, Dataset

class D(Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, i):
        return torch.tensor([os.getpid()])

if __name__ == "__main__":
    handoff = os.environ.get("_LOONGKIT_SUBCGROUPS_WORKER")
    if handoff:  # the data group is gone before the worker starts: it cannot join it
        os.rmdir(json.loads(handoff)["group"])
    pids = sorted({int(b[0]) for b in DataLoader(D(), batch_size=1, num_workers=1, multiprocessing_context="fork")})
    print("WORKERS " + json.dumps(pids), flush=True)
"""


def workers_and_logs(r: Any) -> tuple[list[int], Path, dict[int, str]]:
    """The workers' pids, the log the Summary points to, and each worker's records in it (by pid)."""
    assert r.returncode == 0, r.stderr
    pids = next(json.loads(line.split(" ", 1)[1]) for line in r.stdout.splitlines() if line.startswith("WORKERS "))
    main_log = Path(r.summary["log"])
    assert main_log.is_file() and main_log.parent == r.logdir, r.summary["log"]
    lines = main_log.read_text().splitlines()
    logs = {pid: "\n".join(line for line in lines if f"pid={pid} " in line) for pid in pids}
    assert not [p for pid in pids for p in main_log.parent.glob(f"loongkit-*-{pid}.log")]  # no file of their own
    return pids, main_log, logs


def usable_cpuset() -> str | None:
    """None when this process may create cpuset groups under its own (cgroup v1), else why not."""
    from loongkit_numa.cgroup_tree import locate

    found = locate("/")
    if isinstance(found, str):
        return found
    if found.version != 1:
        return f"cpuset is cgroup v{found.version} here"
    probe = os.path.join(found.own_dir, f"loongkit-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as exc:
        return f"mkdir {probe}: {errno.errorcode.get(exc.errno or 0)}"
    if not {0, 1} <= set(os.sched_getaffinity(0)):
        return "needs CPUs 0 and 1"
    return None


def test_subcgroups_warning_in_a_worker_is_in_the_jobs_log(tmp_path: Path, run_loongkit: Any) -> None:
    why = usable_cpuset()
    if why:
        pytest.skip(f"real cgroup v1 cpuset not usable here: {why}")
    sysroot = tmp_path / "sysfs"
    write_topology(sysroot, nodes=2, cores_per_node=1, smt=1, gpus_per_node=(1, 0))
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    r = run_loongkit(argv=[sys.executable, str(script)], cwd=str(tmp_path), timeout=240, env={
        "LOONGKIT_SUBCGROUPS": "1", "LOONGKIT_SYSFS_ROOT": str(sysroot), "LOONGKIT_SUBCGROUPS_CGROUP_ROOT": "/",
        "LOONGKIT_NUMA_AFFINITY_ALLOW_ASYMMETRIC": "1", "LOONGKIT_NUMA_AFFINITY_DATA_WORKER_ON_GPULESS": "1",
        "LOONGKIT_NUMA_AFFINITY_DATA_WORKER_GPULESS_ONLY": "1"})
    pids, _, logs = workers_and_logs(r)  # the workers' records in the log the Summary points to
    assert r.feature("subcgroups")["state"] in ("applied", "active"), r.feature("subcgroups")
    warning = "subcgroups: worker 0: cannot join"
    assert [pid for pid, text in logs.items() if warning in text] == pids, (logs, r.stderr)
    line = next(line for line in logs[pids[0]].splitlines() if warning in line)
    assert "level=warning" in line and "role=worker" in line, line
    assert warning not in r.stderr, r.stderr  # stdlib logging's last resort wrote it there


def test_numa_affinity_worker_binding_is_in_the_jobs_log(tmp_path: Path, run_loongkit: Any) -> None:
    if not {0, 1} <= set(os.sched_getaffinity(0)):
        pytest.skip("needs CPUs 0 and 1 to bind")
    sysroot = tmp_path / "sysfs"
    two_cpu_two_node(sysroot)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    r = run_loongkit(argv=[sys.executable, str(script)], cwd=str(tmp_path), timeout=240, env={
        "LOONGKIT_NUMA_AFFINITY": "1", "LOONGKIT_SYSFS_ROOT": str(sysroot), "LOONGKIT_LOGLEVEL": "info"})
    pids, _, logs = workers_and_logs(r)
    assert r.feature("numa_affinity")["state"] == "active", r.feature("numa_affinity")
    said = "numa_affinity: worker 0: data worker bound to CPUs 0"
    assert [pid for pid, text in logs.items() if said in text] == pids, (logs, r.stderr)
