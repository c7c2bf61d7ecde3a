"""The node channel (loongkit_core.activity): named per job instance whatever the PID namespace, its
members' liveness from flock (SIGKILL and other namespaces included), the last member or the sweep
removes it, never a live one; local rank 0 does not wait for a rank that ended; finish() re-entered
by torchrun's SIGTERM during the exit callbacks keeps what they produce."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from loongkit_core import activity

TORCHRUN_ENV = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_RUN_ID": "none", "GROUP_RANK": "0"}


@pytest.fixture(autouse=True)
def _not_stopping(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(activity, "_stopping", [])
    monkeypatch.setattr(activity, "_agent", [])


def test_node_key_names_the_job_instance_not_only_its_pids(monkeypatch: pytest.MonkeyPatch) -> None:
    key = activity.node_key(10, 2, TORCHRUN_ENV)
    assert key == activity.node_key(10, 2, TORCHRUN_ENV)  # every local rank of one agent agrees
    assert key.startswith(f"node-{activity.pid_namespace()}-{os.getppid()}-{activity.start_time(os.getppid())}-0-")
    # two containers: both agents PID 1, same MASTER_PORT, other PID namespaces
    monkeypatch.setattr(activity, "pid_namespace", lambda: 4026532000)
    other_container = activity.node_key(10, 2, TORCHRUN_ENV)
    assert other_container != key
    # a restarted pod in a namespace with the same inode: its agent started later
    monkeypatch.setattr(activity, "start_time", lambda pid: 123456)
    assert activity.node_key(10, 2, TORCHRUN_ENV) != other_container
    # the next torchrun restart round, another node's agent on this host, another rendezvous
    for change in ({"TORCHELASTIC_RESTART_COUNT": "1"}, {"GROUP_RANK": "1"}, {"TORCHELASTIC_RUN_ID": "job2"}):
        assert activity.node_key(10, 2, {**TORCHRUN_ENV, **change}) != activity.node_key(10, 2, TORCHRUN_ENV)
    assert activity.node_key(10, 1, {}) == "proc-4026532000-10-123456"


def test_start_time_and_namespace_of_this_process() -> None:
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("no /proc")
    assert activity.start_time(os.getpid()) > 0 and activity.pid_namespace() > 0
    assert activity.start_time(os.getpid()) >= activity.start_time(os.getppid())
    assert activity.start_time(2**22 + 7) == 0  # no such pid


def _open(root: Path, local: int, rank: int | None = None) -> activity.MainChannel:
    channel = activity.MainChannel.open(os.getpid(), local, 2, TORCHRUN_ENV, rank=local if rank is None else rank,
                                        root=str(root))
    assert channel is not None
    return channel


def test_the_last_member_to_leave_removes_the_channel(tmp_path: Path) -> None:
    rank0, rank1 = _open(tmp_path, 0), _open(tmp_path, 1)
    assert rank0.directory == rank1.directory and rank0.locks
    directory = Path(rank0.directory)
    assert activity.peer_state(rank0.directory, local_rank=1) == activity.ALIVE
    assert activity.peer_state(rank0.directory, local_rank=5) == activity.ABSENT
    rank1.publish_rank({"f": activity.Totals(3)}, 1)
    rank1.close()  # rank 1 ends first: the channel stays for local rank 0
    assert directory.is_dir() and (directory / "r-1.json").exists()
    assert activity.peer_state(rank0.directory, local_rank=1) == activity.GONE
    view = rank0.node_view(wait=5.0)
    assert view.ranks == {1: {"f": activity.Totals(3)}} and view.silent == {0: view.silent[0]}
    rank0.close()
    assert not directory.exists() and os.listdir(tmp_path) == []


def test_node_view_does_not_wait_for_a_rank_that_ended_and_names_global_ranks(tmp_path: Path) -> None:
    # node 1 of a 2x2 job: local ranks 0, 1 are global ranks 2, 3; rank 3 ended without a report
    rank2, rank3 = _open(tmp_path, 0, rank=2), _open(tmp_path, 1, rank=3)
    rank2.publish_rank({"f": activity.Totals(1)}, 2)
    rank3.forget()  # as the kernel does for a SIGKILLed rank: its locks are gone, its files stay
    start = time.monotonic()
    view = rank2.node_view(wait=30.0)
    assert time.monotonic() - start < 2.0
    assert sorted(view.ranks) == [2] and list(view.silent) == [3]
    assert "ended without one" in view.silent[3]
    rank2.close()
    assert not Path(rank2.directory).exists()  # the last live member cleans up after the dead one


def test_a_live_rank_is_waited_for_then_named(tmp_path: Path) -> None:
    rank0, rank1 = _open(tmp_path, 0), _open(tmp_path, 1)
    rank0.publish_rank({}, 0)
    clock = [0.0]
    view = rank0.node_view(wait=2.0, clock=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s))
    assert clock[0] == pytest.approx(2.0, abs=activity.POLL) and view.silent == {1: "none within 2 s (still running)"}
    # once torchrun's agent stops the job (SIGTERM), a live rank gets STOP_WAIT at most
    activity.mark_stopping()
    start = time.monotonic()
    view = rank0.node_view(wait=30.0)
    assert time.monotonic() - start <= activity.STOP_WAIT + 0.5
    assert view.silent == {1: "not waited for: the job was being stopped"}
    rank1.close()
    rank0.close()


HOLDER = textwrap.dedent('''
    import os, sys, time
    from loongkit_core import activity
    env = {"MASTER_PORT": sys.argv[3], "TORCHELASTIC_RESTART_COUNT": "0"}
    channel = activity.MainChannel.open(os.getpid(), int(sys.argv[2]), 2, env, rank=int(sys.argv[2]), root=sys.argv[1])
    print(channel.directory, flush=True)
    time.sleep(120)
''')


def _holder(root: Path, local: int, *prefix: str, port: int = 29500) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([*prefix, sys.executable, "-c", HOLDER, str(root), str(local), str(port)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, "the holder did not open a channel"
    return proc, line


def test_sweep_removes_a_killed_jobs_channel_and_keeps_a_live_one(tmp_path: Path) -> None:
    live, live_dir = _holder(tmp_path, 0)
    dead, dead_dir = _holder(tmp_path, 0, port=29501)  # another job: another channel
    try:
        assert live_dir != dead_dir
        Path(dead_dir, "r-1.json").write_text("{}")
        dead.send_signal(signal.SIGKILL)
        dead.wait(30)
        legacy = tmp_path / "node-1-29500-0"  # an older loongkit's channel: no lock file, left alone
        legacy.mkdir()
        half = tmp_path / f".node-x.{os.getpid()}"  # a creator killed between mkdir and rename
        half.mkdir()
        os.utime(half, (time.time() - 2 * activity.STALE_TEMP,) * 2)
        assert activity.sweep(str(tmp_path)) == [os.path.basename(dead_dir)]
        assert not Path(dead_dir).exists() and Path(live_dir).is_dir() and legacy.is_dir() and not half.exists()
        assert activity.peer_state(live_dir, local_rank=0) == activity.ALIVE
    finally:
        live.kill()
        live.wait(30)
    assert activity.sweep(str(tmp_path)) == [os.path.basename(live_dir)]


def _can_unshare() -> str | None:
    if os.geteuid() != 0:
        return "needs root (unshare --pid)"
    if shutil.which("unshare") is None:
        return "no unshare"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
    return None if probe.returncode == 0 else f"unshare --pid failed: {probe.stderr.decode(errors='replace')}"


def test_a_member_in_another_pid_namespace_counts_as_alive_until_killed(tmp_path: Path) -> None:
    why = _can_unshare()
    if why:
        pytest.skip(why)
    proc, directory = _holder(tmp_path, 1, "unshare", "--pid", "--fork", "--mount-proc", "--kill-child")
    try:
        member = activity.members(directory)[0]
        assert member.ns != activity.pid_namespace() and member.local_rank == 1
        assert activity.peer_state(directory, local_rank=1) == activity.ALIVE
        assert activity.sweep(str(tmp_path)) == []
    finally:
        proc.kill()  # unshare --kill-child: its child (the holder, PID 1 there) gets SIGKILL too
        proc.wait(30)
    deadline = time.monotonic() + 10
    while activity.peer_state(directory, local_rank=1) != activity.GONE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert activity.peer_state(directory, local_rank=1) == activity.GONE
    assert activity.sweep(str(tmp_path)) == [os.path.basename(directory)]


def test_sigterm_during_exit_callbacks_keeps_what_they_produce(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's SIGTERM arriving while the monitor's exit callback runs: before, the handler re-entered
    finish() (the callback already popped) and wrote a Summary without it, then killed the process."""
    from loongkit_core.runtime import Runtime

    for name in list(os.environ):
        if name.startswith("LOONGKIT_"):
            monkeypatch.delenv(name)
    rt = Runtime(environ={}, arm=False)
    rt.boot(configure_logging=False)
    died: list[int] = []
    monkeypatch.setattr(rt, "_die_of", died.append)
    monkeypatch.setattr(rt.process, "role", "main")
    monkeypatch.setattr(rt, "summary_text", lambda extra=None, full=False: "")
    produced: list[str] = []

    def callback() -> None:
        rt._on_sigterm(signal.SIGTERM, None)  # what the signal handler does, arriving here
        assert died == []  # not yet: the callback goes on
        produced.append("report")

    from loongkit_core.feature import Category, Feature, FeatureRecord

    record = FeatureRecord(Feature(name="x", env="LOONGKIT_X", level=1, category=Category.DATA, description="x"))
    rt._register_exit(record, callback)
    rt.finish()
    assert produced == ["report"] and died == [signal.SIGTERM] and rt._summary_done
    assert activity.stopping() is not None
    rt.finish()  # atexit after a handled signal: nothing twice
    assert died == [signal.SIGTERM]
