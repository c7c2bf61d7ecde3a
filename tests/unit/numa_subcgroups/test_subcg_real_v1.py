"""Sub-cgroups against this machine's real cgroup v1 cpuset hierarchy, in subprocesses.

The NUMA topology is a fake sysfs (``LOONGKIT_SYSFS_ROOT``: CPUs 0 and 1 as two nodes with GPUs),
the cgroups are real (``LOONGKIT_SUBCGROUPS_CGROUP_ROOT=/``). Each run creates
``loongkit-<pid>-rank<r>-{train,data}`` under this process's cpuset group, moves the trainer and its
fork and spawn DataLoader workers in, and must leave nothing behind. On torch < 2.5 the plan finds the
GPUs by index order (``gpus_by_index``): these tests are about the groups, not the GPUs' identity.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from loongkit_numa.cgroup_tree import Hierarchy, locate
from numa_helpers import gpus_by_index

from loongkit_core.testing import free_port
from loongkit_core.testing.topology import two_cpu_two_node, write_topology

pytest.importorskip("torch")

ASYM = {"LOONGKIT_NUMA_AFFINITY_ALLOW_ASYMMETRIC": "1", "LOONGKIT_NUMA_AFFINITY_DATA_WORKER_ON_GPULESS": "1",
        "LOONGKIT_NUMA_AFFINITY_DATA_WORKER_GPULESS_ONLY": "1"}

SCRIPT = """
import json, os, sys
import torch
from torch.utils.data import DataLoader, Dataset

class D(Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, i):
        return torch.tensor([os.getpid(), *sorted(os.sched_getaffinity(0))])

def cpuset(pid):
    return [l.split(":", 2)[2] for l in open(f"/proc/{pid}/cgroup").read().splitlines() if ":cpuset:" in l][0]

if __name__ == "__main__":
    out = {"pid": os.getpid(), "cgroup": cpuset(os.getpid()), "cpus": sorted(os.sched_getaffinity(0)), "workers": {}}
    for ctx in ("fork", "spawn"):
        # persistent workers are still alive when the exit hooks run: cleanup must cope
        it = iter(DataLoader(D(), batch_size=None, num_workers=1, multiprocessing_context=ctx, persistent_workers=True))
        pid, *cpus = next(it).tolist()
        out["workers"][ctx] = {"cgroup": cpuset(pid), "cpus": cpus}
    mount = sys.argv[1]
    out["groups"] = sorted(n for n in os.listdir(mount) if n.startswith(f"loongkit-"))
    with open(sys.argv[2] + f".{os.environ.get('LOCAL_RANK', 0)}", "w") as fh:
        json.dump(out, fh)
"""


def real_cpuset() -> Hierarchy | str:
    """This process's real cpuset group, or why sub-cgroups cannot be tried here."""
    found = locate("/")
    if isinstance(found, str):
        return found
    if found.version != 1:
        return f"this machine's cpuset is cgroup v{found.version}, not v1"
    probe = os.path.join(found.own_dir, f"loongkit-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
    except OSError as exc:
        return f"mkdir {probe} failed: {errno.errorcode.get(exc.errno or 0)} {exc.strerror}"
    try:
        for name in ("cpuset.cpus", "cpuset.mems"):
            with open(os.path.join(found.own_dir, name)) as src, open(os.path.join(probe, name), "w") as dst:
                dst.write(src.read().strip())
    except OSError as exc:
        return f"writing cpuset files in {probe} failed: {errno.errorcode.get(exc.errno or 0)} {exc.strerror}"
    finally:
        os.rmdir(probe)
    if not {0, 1} <= set(os.sched_getaffinity(0)):
        return "needs CPUs 0 and 1"
    return found


@pytest.fixture
def cpuset_v1() -> Hierarchy:
    found = real_cpuset()
    if isinstance(found, str):
        pytest.skip(f"real cgroup v1 cpuset not usable here: {found}")
    return found


def ours(h: Hierarchy) -> list[str]:
    return sorted(n for n in os.listdir(h.own_dir) if n.startswith("loongkit-") and "-rank" in n)


def own_cpuset() -> str:
    return next(line for line in Path("/proc/self/cgroup").read_text().splitlines() if ":cpuset:" in line)


def test_trainer_and_its_fork_and_spawn_workers_in_real_groups(tmp_path: Path, run_loongkit: Any,
                                                               cpuset_v1: Hierarchy) -> None:
    """Trainer on CPU 0 (its GPU's node), data workers on CPU 1 (the GPU-less node), per the plan."""
    sysroot = tmp_path / "sysfs"
    write_topology(sysroot, nodes=2, cores_per_node=1, smt=1, gpus_per_node=(1, 0))
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    before, mine = ours(cpuset_v1), own_cpuset()
    out = tmp_path / "out.json"
    r = run_loongkit(argv=[sys.executable, str(script), cpuset_v1.own_dir, str(out)], cwd=str(tmp_path), env={
        "LOONGKIT_SUBCGROUPS": "1", "LOONGKIT_SYSFS_ROOT": str(sysroot), "LOONGKIT_SUBCGROUPS_CGROUP_ROOT": "/",
        "LOONGKIT_LOGLEVEL": "info", **ASYM, **gpus_by_index()}, timeout=240)
    assert r.returncode == 0, r.stderr
    got = json.loads(Path(f"{out}.0").read_text())
    pid = got["pid"]
    base = "" if cpuset_v1.own_path == "/" else cpuset_v1.own_path
    train, data = f"{base}/loongkit-{pid}-rank0-train", f"{base}/loongkit-{pid}-rank0-data"
    assert got["cgroup"] == train and got["cpus"] == [0]
    assert got["workers"]["fork"] == {"cgroup": data, "cpus": [1]}
    assert got["workers"]["spawn"] == {"cgroup": data, "cpus": [1]}
    assert sorted(set(got["groups"]) - set(before)) == sorted([train.rsplit("/", 1)[1], data.rsplit("/", 1)[1]])
    row = r.feature("subcgroups")
    assert row["state"] == "active", row
    assert row["details"]["train_cpuset"] == "cpus 0 mems 0"
    # The fake second node has no memory on this one-node machine: the real parent's mems are used.
    assert row["details"]["data_cpuset"] == "cpus 1 mems 0"
    assert "data memory nodes 1 are not in this cgroup's mems 0" in r.logs()
    # Removed at exit, although a persistent worker and the resource tracker outlived the exit hooks.
    assert ours(cpuset_v1) == before
    assert "cleanup" not in r.stderr, r.stderr
    assert own_cpuset() == mine


@pytest.mark.slow
def test_torchrun_two_ranks_each_in_its_node_group(tmp_path: Path, run_loongkit: Any, cpuset_v1: Hierarchy) -> None:
    sysroot = tmp_path / "sysfs"
    two_cpu_two_node(sysroot)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    before = ours(cpuset_v1)
    out = tmp_path / "out.json"
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    argv = [torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "--rdzv-id", "lkjob", str(script),
            cpuset_v1.own_dir, str(out)]
    r = run_loongkit(argv=argv, cwd=str(tmp_path), timeout=300, env={
        "LOONGKIT_SUBCGROUPS": "1", "LOONGKIT_SYSFS_ROOT": str(sysroot), "LOONGKIT_SUBCGROUPS_CGROUP_ROOT": "/",
        **gpus_by_index()})
    assert r.returncode == 0, r.stderr
    base = "" if cpuset_v1.own_path == "/" else cpuset_v1.own_path
    for rank in (0, 1):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        # torchrun's run id (TORCHELASTIC_RUN_ID) is the job tag both ranks share.
        assert got["cgroup"] == f"{base}/loongkit-lkjob-rank{rank}-train" and got["cpus"] == [rank]
        for ctx in ("fork", "spawn"):
            assert got["workers"][ctx] == {"cgroup": f"{base}/loongkit-lkjob-rank{rank}-data", "cpus": [rank]}
    assert ours(cpuset_v1) == before


def test_numa_affinity_is_switched_off_and_groups_follow_its_plan(tmp_path: Path, run_loongkit: Any,
                                                                   cpuset_v1: Hierarchy) -> None:
    sysroot = tmp_path / "sysfs"
    two_cpu_two_node(sysroot)
    code = ("import os; print('CG', [l for l in open('/proc/self/cgroup').read().splitlines() if ':cpuset:' in l][0],"
            " sorted(os.sched_getaffinity(0)))")
    r = run_loongkit(code, env={"LOONGKIT_SUBCGROUPS": "1", "LOONGKIT_NUMA_AFFINITY": "1", "LOCAL_RANK": "1",
                                "LOCAL_WORLD_SIZE": "2", "LOONGKIT_SYSFS_ROOT": str(sysroot),
                                "LOONGKIT_SUBCGROUPS_CGROUP_ROOT": "/", **gpus_by_index()})
    assert r.returncode == 0, r.stderr
    numa = r.feature("numa_affinity")
    assert numa["state"] == "not applicable" and numa["reason"] == "switched off by LOONGKIT_SUBCGROUPS"
    assert r.feature("subcgroups")["state"] == "active"
    line = next(x for x in r.stdout.splitlines() if x.startswith("CG"))
    assert "-rank1-train" in line and line.endswith("[1]")
    assert "switched off by LOONGKIT_SUBCGROUPS" in r.logs()  # the Summary block (local rank 1 logs it)
