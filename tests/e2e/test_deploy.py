"""torchrun jobs deployed as users deploy them (issue 22): containers sharing /dev/shm (two jobs whose
agents are both PID 1 with MASTER_PORT 29500), a restarted pod reusing /dev/shm after a SIGKILL, a
rank that dies, two agents as two nodes. Each job's Summary counts its own ranks only, names global
ranks, says which ranks sent nothing and why, and leaves nothing in /dev/shm.

Containers are PID (and network: both agents bind port 29500) namespaces from ``unshare``: root only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from loongkit_core.testing import free_port, loongkit_environ

pytest.importorskip("torch")

# Rank 0 prints its activity channel; ``kill`` SIGKILLs that rank before step 2 (after writing the time).
SCRIPT = r'''
import os, sys, time
import torch, torch.distributed as dist
print("CHANNEL", os.environ.get("_LOONGKIT_ACTIVITY", "").rpartition(":")[0], flush=True)
dist.init_process_group("gloo")
rank = dist.get_rank()
steps, pause, kill, slow = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(steps):
    if rank == kill and step == 2:
        with open(os.environ["KILL_STAMP"], "w") as fh:
            fh.write(repr(time.time()))
        os.kill(os.getpid(), 9)
    time.sleep(pause + (0.1 if rank == slow else 0.0))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    print("STEP", rank, step, flush=True)
dist.barrier()
dist.destroy_process_group()
'''

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TIMEOUT = 240  # seconds per job: a few steps, but four interpreters importing torch on a loaded 2-core machine


def _namespaces() -> str | None:
    """Why separate PID + network namespaces cannot be made here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return "Linux namespaces only"
    if os.geteuid() != 0:
        return "needs root for unshare --pid --net (a container runtime's part)"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare (util-linux) and ip (iproute2)"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--net", "sh", "-c", "ip link set lo up"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return f"unshare --pid --net unavailable here: {probe.stderr.strip()[:200]}"
    return None


def _job(tmp: Path, steps: int, pause: float = 0.0, *, kill: int = -1, slow: int = -1, container: bool = False,
         port: int | None = None, torchrun_args: tuple[str, ...] = (), prelude: bool = True,
         env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start a 2-rank torchrun job of SCRIPT (``container``: as PID 1 of its own PID and network
    namespaces, sharing /dev/shm, on port 29500)."""
    tmp.mkdir(parents=True, exist_ok=True)
    script = tmp / "job.py"
    script.write_text(SCRIPT)
    full = loongkit_environ({"LOONGKIT_MONITOR": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                             "KILL_STAMP": str(tmp / "killed"), **(env or {})}, tmp=tmp, prelude=prelude)
    args = [*torchrun_args] or ["--nproc-per-node", "2", "--master-port", str(29500 if container else port)]
    command = [TORCHRUN, *args, str(script), str(steps), str(pause), str(kill), str(slow)]
    if container:
        inner = " ".join(command)
        command = ["unshare", "--pid", "--fork", "--mount-proc", "--net", "--kill-child", "sh", "-c",
                   f"ip link set lo up && exec {inner}"]
    return subprocess.Popen(command, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait(proc: subprocess.Popen[str]) -> str:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"job still running after {TIMEOUT} s:\n{out[-4000:]}")
    return out


def _channels(out: str) -> set[str]:
    return {line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("CHANNEL ") and " " in line}


def _summary(path: Path) -> dict[str, Any]:
    assert path.exists(), f"no JSON Summary at {path}"
    return json.loads(path.read_text())


def _monitor(summary: dict[str, Any]) -> dict[str, Any]:
    return next(f for f in summary["features"] if f["name"] == "monitor")


def _calls(row: dict[str, Any]) -> dict[int, int]:
    return {int(r): t["calls"] for r, t in row.get("node", {}).items()}


@pytest.mark.slow
def test_two_containers_sharing_dev_shm_with_the_same_master_port(tmp_path: Path) -> None:
    """Both agents are PID 1 in their namespace with MASTER_PORT 29500: before, both jobs shared
    node-1-29500-0, and job B's local rank 0 removed it while job A still ran (A lost rank 1)."""
    why = _namespaces()
    if why:
        pytest.skip(why)
    a = _job(tmp_path / "a", steps=5, pause=1.2, container=True)  # still training when B has ended
    b = _job(tmp_path / "b", steps=3, container=True)
    out_b, out_a = _wait(b), _wait(a)
    assert a.returncode == 0, out_a[-4000:]
    assert b.returncode == 0, out_b[-4000:]
    for out, tmp, steps in ((out_a, tmp_path / "a", 5), (out_b, tmp_path / "b", 3)):
        summary = _summary(tmp / "summary.json")
        row = _monitor(summary)
        assert _calls(row) == {0: steps, 1: steps}, (row.get("node"), out[-3000:])
        details = row["details"]["monitor"]
        assert details["steps"] == steps and sorted(map(int, details["ranks"])) == [0, 1], details["notes"]
        assert not any("cannot write" in n or "no monitor report" in n for n in details["notes"]), details["notes"]
        assert f"(ranks 0,1 of 2, {2 * steps} calls)" in out, out[-3000:]
        assert not any(os.path.exists(c) for c in _channels(out))
    assert _channels(out_a).isdisjoint(_channels(out_b)), (out_a[-2000:], out_b[-2000:])


@pytest.mark.slow
def test_a_restarted_pod_does_not_read_the_dead_jobs_channel(tmp_path: Path) -> None:
    """A pod's /dev/shm outlives its containers. Before, the channel of a job whose local rank 0 was
    SIGKILLed (an OOM kill) stayed there, and the restarted job, PID 1 again with the same port, read
    its reports. Now the dead job's survivors remove it; a container killed whole (its agent too)
    leaves it for the next job's sweep; the restarted job never reads either."""
    why = _namespaces()
    if why:
        pytest.skip(why)
    # 1. local rank 0 SIGKILLed: torchrun stops rank 1, which leaves last and removes the channel
    first = _job(tmp_path / "oom", steps=40, pause=0.05, kill=0, container=True)
    out = _wait(first)
    assert first.returncode != 0 and (tmp_path / "oom" / "killed").exists(), out[-3000:]
    dead = _channels(out)
    assert len(dead) == 1, out[-3000:]
    assert not any(os.path.exists(c) for c in dead), f"the dead job's channel stayed: {dead}"
    # 2. the whole container SIGKILLed mid-training (agent and ranks): nobody can clean up
    whole = _job(tmp_path / "whole", steps=400, pause=0.05, container=True)
    assert whole.stdout is not None
    seen: list[str] = []
    for line in whole.stdout:
        seen.append(line)
        if sum(line.startswith("STEP ") for line in seen) >= 4:
            break
    os.killpg(whole.pid, signal.SIGKILL)  # unshare --kill-child: PID 1 dies, and the namespace with it
    whole.communicate(timeout=60)
    left = _channels("".join(seen))
    assert len(left) == 1 and all(os.path.isdir(c) for c in left), "".join(seen)[-3000:]
    # 3. the restarted job: its own channel, its own counts; it sweeps the one left behind
    again = _job(tmp_path / "again", steps=3, container=True)
    out = _wait(again)
    assert again.returncode == 0, out[-4000:]
    assert _channels(out).isdisjoint(dead | left)
    row = _monitor(_summary(tmp_path / "again" / "summary.json"))
    assert _calls(row) == {0: 3, 1: 3}, row.get("node")
    assert row["details"]["monitor"]["steps"] == 3
    assert "(ranks 0,1 of 2, 6 calls)" in out, out[-3000:]
    assert not any(os.path.exists(c) for c in left | _channels(out)), "the killed container's channel stayed"


@pytest.mark.slow
def test_a_killed_rank_is_named_and_the_job_ends_as_fast_as_bare(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed: before, torchrun's SIGTERM re-entered finish() during rank 0's exit callbacks
    (its Summary lost the monitor section), or rank 0 waited 5 s + 5 s for reports that could not come."""
    ended: dict[str, float] = {}
    outputs: dict[str, str] = {}
    for name, prelude in (("bare", False), ("ours", True)):
        tmp = tmp_path / name
        proc = _job(tmp, steps=200, pause=0.02, kill=1, port=free_port(), prelude=prelude)
        out = _wait(proc)
        end = time.time()
        assert proc.returncode != 0 and (tmp / "killed").exists(), out[-3000:]
        ended[name] = end - float((tmp / "killed").read_text())
        outputs[name] = out
    out = outputs["ours"]
    print(f"SIGKILL of rank 1 to the end of torchrun: bare {ended['bare']:.2f} s, loongkit {ended['ours']:.2f} s")
    assert ended["ours"] <= ended["bare"] + 2.0, (ended, out[-3000:])
    summary = _summary(tmp_path / "ours" / "summary.json")
    row = _monitor(summary)
    details = row["details"].get("monitor")
    assert details is not None, f"rank 0's Summary lost its monitor section: {out[-3000:]}"
    assert list(details["silent_ranks"]) == ["1"] and "ended without" in details["silent_ranks"]["1"], details
    assert "rank 1 sent no monitor report: its process ended without one (killed or crashed)" in out, out[-3000:]
    assert "No activity report from rank 1: its process ended without one" in out, out[-3000:]
    assert "Training monitor: no report" not in out
    assert not any(os.path.exists(c) for c in _channels(out))


@pytest.mark.slow
def test_two_agents_as_two_nodes_name_their_global_ranks(tmp_path: Path) -> None:
    """Two torchrun agents on 127.0.0.1 (c10d rendezvous), 2 ranks each, rank 3 slowed: node 1's rows
    name ranks 2,3 (before: 0,1, its local ranks); global rank 0 sees all four through the store."""
    port = free_port()
    jobs = []
    summaries = tmp_path / "summaries"
    summaries.mkdir()
    for node in range(2):
        args = ("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "lk-two-nodes", "--max-restarts", "0")
        jobs.append(_job(tmp_path / f"node{node}", steps=8, pause=0.02, slow=3, torchrun_args=args,
                         env={"LOONGKIT_SUMMARY_JSON": str(summaries / "summary-{rank}.json")}))
    outs = [_wait(job) for job in jobs]
    for job, out in zip(jobs, outs, strict=True):
        assert job.returncode == 0, out[-4000:]
    rows = {}
    for rank in (0, 2):  # the local ranks 0 of the two nodes (c10d assigns which agent is node 1)
        row = _monitor(_summary(summaries / f"summary-{rank}.json"))
        rows[rank] = row
        assert sorted(_calls(row)) == [rank, rank + 1], row.get("node")
    texts = [line for out in outs for line in out.splitlines() if line.startswith("monitor ")]
    assert len(texts) == 2 and any("(ranks 2,3 of 2, 16 calls)" in t for t in texts), texts
    assert any("(ranks 0,1 of 2, 16 calls)" in t for t in texts), texts
    node1 = rows[2]["details"]["monitor"]
    assert sorted(map(int, node1["ranks"])) == [2, 3], node1
    job = rows[0]["details"]["monitor"]
    assert sorted(map(int, job["ranks"])) == [0, 1, 2, 3], job["notes"]
    assert [s["rank"] for s in job["stragglers"]] == [3], job["stragglers"]
    assert "silent_ranks" not in job and "silent_ranks" not in node1
    assert not any(os.path.exists(c) for out in outs for c in _channels(out))
