"""LOONGKIT_NUMA_AFFINITY under torchrun: every rank and its DataLoader workers run where
`loongkit numa plan` says (a recorded 2-node topology on this 2-CPU machine)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loongkit_core.hardware import parse_cpulist
from loongkit_core.testing import clean_environ, free_port
from loongkit_core.testing.topology import two_cpu_two_node

pytest.importorskip("torch")

SCRIPT = '''
import json, os, sys, torch
from torch.utils.data import DataLoader, Dataset

class Where(Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, i):
        return torch.tensor(sorted(os.sched_getaffinity(0)))

if __name__ == "__main__":
    rank = int(os.environ["LOCAL_RANK"])
    workers = {}
    for ctx in ("fork", "spawn"):
        seen = [b[0].tolist() for b in DataLoader(Where(), batch_size=1, num_workers=1, multiprocessing_context=ctx)]
        workers[ctx] = seen[0]
    print("RESULT " + json.dumps({"rank": rank, "train": sorted(os.sched_getaffinity(0)), "workers": workers}),
          flush=True)
'''


@pytest.mark.slow
def test_ranks_and_workers_follow_the_plan(tmp_path: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 usable CPUs to bind two ranks apart")
    root = tmp_path / "sysfs"
    two_cpu_two_node(root)
    loongkit = shutil.which("loongkit") or str(Path(sys.executable).parent / "loongkit")
    env = clean_environ()
    plan = json.loads(subprocess.run([loongkit, "numa", "plan", "--sysfs-root", str(root), "--nproc-per-node", "2",
                                      "--json"], env=env, capture_output=True, text=True, check=True).stdout)
    expected = {r["local_rank"]: (sorted(parse_cpulist(r["training_cpus"])), sorted(parse_cpulist(r["data_cpus"])))
                for r in plan["ranks"]}
    assert expected == {0: ([0], [0]), 1: ([1], [1])}

    script = tmp_path / "where.py"
    script.write_text(SCRIPT)
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    r = run_loongkit(env={"LOONGKIT_NUMA_AFFINITY": "1", "LOONGKIT_SYSFS_ROOT": str(root), "OMP_NUM_THREADS": "1"},
                     argv=[torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), str(script)],
                     cwd=str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr
    results = [json.loads(line.split(" ", 1)[1]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 2
    for result in results:
        train, data = expected[result["rank"]]
        assert result["train"] == train, result
        assert result["workers"] == {"fork": data, "spawn": data}, result
    row = r.feature("numa_affinity")
    assert row["active"], row
