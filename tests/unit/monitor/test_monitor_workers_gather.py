"""Worker reports (write, read, summarise over a window) and rank reports (files, the c10d store)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from loongkit_monitor import dataworkers, gather, procstat
from loongkit_monitor.dataworkers import WorkerReport, summarise
from loongkit_monitor.procstat import Usage


def usage(t: float, cpu: float, rss: int = 100 << 20, private: int | None = None, delay: float = 0.0,
          majflt: int = 0) -> Usage:
    return Usage(t, cpu, rss, 10, majflt, private, delay)


def test_persistent_workers_add_up_their_slots() -> None:
    reports = [WorkerReport(pid=10 + i, worker_id=i, affinity=frozenset({i}),
                            samples=[usage(0.0, 0.0), usage(1.0, 0.5, private=1 << 20), usage(11.0, 9.5,
                                     private=201 << 20)])
               for i in range(2)]
    fig = summarise(reports, t_from=1.0, t_to=11.0)
    assert fig.processes == 2 and fig.slots == 2
    assert fig.cpu_used == pytest.approx(1.8)  # each slot 9 CPU-seconds in 10 s
    assert fig.private_growth == pytest.approx(200 << 20)
    assert fig.affinity == frozenset({0, 1})


def test_restarted_workers_are_not_counted_once_per_generation() -> None:
    # one slot, three generations (a non-persistent loader over three epochs), each busy 50 %
    gens = [WorkerReport(pid=100 + g, worker_id=0, affinity=frozenset(),
                         samples=[usage(g * 3.0, 0.0), usage(g * 3.0 + 2.0, 1.0)]) for g in range(3)]
    fig = summarise(gens, t_from=0.0, t_to=100.0)
    assert fig.processes == 3 and fig.slots == 1
    assert fig.cpu_used == pytest.approx(0.5)


def test_samples_outside_the_window_do_not_count() -> None:
    report = WorkerReport(1, 0, frozenset(), [usage(0.0, 0.0, delay=0.0), usage(5.0, 5.0, delay=0.0),
                                              usage(6.0, 5.5, delay=0.25), usage(7.0, 6.0, delay=0.5),
                                              usage(50.0, 40.0)])
    fig = summarise([report], t_from=5.0, t_to=7.0)
    assert fig.cpu_used == pytest.approx(0.5)
    assert fig.cpu_wait_share == pytest.approx(0.25)
    assert summarise([report], t_from=20.0, t_to=30.0).cpu_used is None  # no span inside


def test_sampler_writes_a_report_the_main_process_reads(tmp_path: Path) -> None:
    sampler = dataworkers.WorkerSampler(str(tmp_path), main_pid=4242, worker_id=3)
    sampler.flush()
    sampler.stop()
    other = tmp_path / "mon-999-1.json"  # another main's worker: not ours
    other.write_text(json.dumps({"pid": 1, "worker_id": 0, "samples": [usage(0, 0).to_json()]}))
    found = dataworkers.read_reports(str(tmp_path), 4242, remove=True)
    assert len(found) == 1
    report = found[0]
    assert report.pid == os.getpid() and report.worker_id == 3 and len(report.samples) == 3
    assert report.samples[0].private is not None and report.samples[-1].private is not None
    assert report.affinity == procstat.affinity()
    assert not (tmp_path / f"mon-4242-{os.getpid()}.json").exists()  # removed once read
    assert other.exists()


def test_sampler_history_is_thinned(tmp_path: Path) -> None:
    sampler = dataworkers.WorkerSampler(str(tmp_path), main_pid=1, worker_id=0)
    for _ in range(dataworkers.MAX_SAMPLES + 5):
        sampler.flush()
    assert len(sampler.samples) <= dataworkers.MAX_SAMPLES
    times = [u.t for u in sampler.samples]
    assert times == sorted(times)
    assert len(set(times[:dataworkers.KEEP_FIRST])) == dataworkers.KEEP_FIRST  # the first ones all kept


def test_garbled_reports_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "mon-7-1.json").write_text("{not json")
    (tmp_path / "mon-7-2.json").write_text(json.dumps({"worker_id": 0}))
    assert dataworkers.read_reports(str(tmp_path), 7) == []


# -- ranks ------------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_local_ranks_meet_in_the_node_directory(tmp_path: Path) -> None:
    clock = Clock()
    ranks = [gather.Gatherer(str(tmp_path), r, r, 2, 2, clock=clock, sleep=clock.sleep) for r in range(2)]
    ranks[1].publish({"rank": 1, "own_median_s": 0.05})
    found = ranks[0].collect({"rank": 0, "own_median_s": 0.01})
    assert sorted(found) == [0, 1] and found[1]["own_median_s"] == 0.05
    assert ranks[0].notes == []
    assert ranks[1].collect({"rank": 1}) == {1: {"rank": 1}}  # only local rank 0 collects


def test_a_missing_rank_costs_at_most_the_wait(tmp_path: Path) -> None:
    clock = Clock()
    rank0 = gather.Gatherer(str(tmp_path), 0, 0, 2, 2, clock=clock, sleep=clock.sleep)
    found = rank0.collect({"rank": 0}, wait=1.0)
    assert list(found) == [0]
    assert clock.now == pytest.approx(1.0, abs=gather.POLL)
    assert rank0.silent == {1: "it never joined the node's channel (ended early, or runs without loongkit)"}
    assert rank0.notes == ["rank 1 sent no monitor report: " + rank0.silent[1]]


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Node 1 of a 2x2 job: the activity channel of its local ranks (global ranks 2 and 3)."""
    from loongkit_core import activity

    monkeypatch.setattr(activity, "_stopping", [])
    env = {"MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "0"}
    channels = [activity.MainChannel.open(os.getpid(), local, 2, env, rank=2 + local, root=str(tmp_path))
                for local in range(2)]
    yield channels
    for channel in channels:
        channel.close()


def test_a_rank_that_ended_is_not_waited_for_and_is_named(node: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    dist = pytest.importorskip("torch.distributed")
    store = dist.HashStore() if dist.is_available() else None
    clock = Clock()
    rank2 = gather.Gatherer(node[0].directory, 2, 0, 4, 2, clock=clock, sleep=clock.sleep)
    rank2.capture_store(store)
    node[1].forget()  # rank 3 SIGKILLed: the kernel dropped its locks, its member file stays
    found = rank2.collect({"rank": 2}, wait=30.0)
    assert list(found) == [2] and clock.now < 1.0
    assert rank2.silent == {3: "its process ended without one (killed or crashed)"}
    assert rank2.notes == ["rank 3 sent no monitor report: its process ended without one (killed or crashed)"]
    if store is not None:  # ... and global rank 0 (node 0) learns it from the store: no wait there either
        assert store.check(["loongkit-monitor/0/gone/3"])
        rank0 = gather.Gatherer(None, 0, 0, 4, 2, clock=clock, sleep=clock.sleep)
        rank0.capture_store(store)
        for r in (1, 2):
            store.set(f"loongkit-monitor/0/rank/{r}", json.dumps({"rank": r}))
        start = clock.now
        assert sorted(rank0.collect({"rank": 0}, wait=30.0)) == [0, 1, 2]
        assert clock.now - start < 1.0 and list(rank0.silent) == [3]


def test_a_stopping_job_waits_briefly_for_live_ranks(node: list[Any]) -> None:
    from loongkit_core import activity

    clock = Clock()
    rank2 = gather.Gatherer(node[0].directory, 2, 0, 4, 2, clock=clock, sleep=clock.sleep)
    activity.mark_stopping()  # torchrun's SIGTERM
    assert list(rank2.collect({"rank": 2}, wait=30.0)) == [2]
    assert clock.now == pytest.approx(activity.STOP_WAIT, abs=gather.POLL)
    assert rank2.silent == {3: "not waited for: the job was being stopped"}


def test_global_rank_zero_reads_other_nodes_through_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    clock = Clock()
    # 4 ranks on 2 nodes, no shared directory: only the store connects them
    nodes = [gather.Gatherer(None, r, r % 2, 4, 2, clock=clock, sleep=clock.sleep) for r in range(4)]
    for g in nodes:
        g.capture_store(store)
    for g in nodes[1:]:
        g.publish({"rank": g.rank, "own_median_s": 0.01 * g.rank})
    found = nodes[0].collect({"rank": 0, "own_median_s": 0.0}, wait=1.0)
    assert sorted(found) == [0, 1, 2, 3] and found[3]["own_median_s"] == pytest.approx(0.03)
    assert store.check(["loongkit-monitor/1/rank/3"])  # keyed by the torchrun restart: no stale rounds
    # local rank 0 of the second node (rank 2) is not global rank 0: it sees its node only (no files here)
    assert list(nodes[2].collect({"rank": 2}, wait=0.1)) == [2]


def test_a_dead_store_only_loses_the_other_ranks() -> None:
    class Dead:
        def set(self, key: str, value: str) -> None:
            raise RuntimeError("connection reset")

    g = gather.Gatherer(None, 1, 1, 2, 2)
    g.capture_store(Dead())
    g.publish({"rank": 1})
    assert g.store is None and "torch.distributed store unusable: connection reset" in g.notes[0]
