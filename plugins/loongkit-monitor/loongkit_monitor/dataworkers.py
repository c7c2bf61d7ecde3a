"""DataLoader workers report their CPU time, memory and page faults to their main process.

Each worker (fork, spawn, forkserver; persistent or not) runs a daemon thread that samples the
worker four times a second for its first two seconds, then every second (:func:`procstat.sample`;
private memory, which costs milliseconds to read, every second sample) and rewrites one small JSON
file in the core's activity channel, ``mon-<main pid>-<worker pid>.json``
(:func:`loongkit_core.activity.job_directory`), with its first samples and a history thinned to at
most :data:`MAX_SAMPLES` entries. The worker loop's return (end of an epoch, shutdown) writes a last
one. Nothing goes through the DataLoader's own queues, and a failure only loses the report.

The main process reads the files at exit (:func:`read_reports`) and :func:`summarise` turns them
into the figures of a time window: CPUs kept busy per worker slot, memory growth per worker.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loongkit_monitor import procstat

PREFIX = "mon-"
INTERVAL = 1.0  # seconds between a worker's samples once past the first ones (a sample costs the worker CPU)
EARLY_INTERVAL, EARLY_SAMPLES = 0.25, 8  # denser at first, so that short runs get a span to measure
PRIVATE_EVERY = 2  # smaps_rollup (the dearest read) is read at the first, the last and every second sample
MAX_SAMPLES = 64  # history kept per worker (rewritten each second: kept small); thinned past KEEP_FIRST
KEEP_FIRST = 16  # the first samples stay: the warm steps start among them


def report_path(directory: str, main_pid: int, pid: int) -> str:
    return os.path.join(directory, f"{PREFIX}{main_pid}-{pid}.json")


class WorkerSampler:
    """In one DataLoader worker: samples it and writes its report (see the module docstring)."""

    def __init__(self, directory: str, main_pid: int, worker_id: int, interval: float = INTERVAL) -> None:
        self.path = report_path(directory, main_pid, os.getpid())
        self.worker_id = worker_id
        self.interval = interval
        self.affinity = sorted(procstat.affinity())
        self.samples: list[procstat.Usage] = []
        self.taken = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.flush()

    def flush(self, ended: bool = False) -> None:
        """Take a sample and rewrite the report; never raises."""
        try:
            with self._lock:
                private = ended or self.taken % PRIVATE_EVERY == 0
                self.samples.append(procstat.sample(private=private, thread=False))
                self.taken += 1
                if len(self.samples) > MAX_SAMPLES:
                    later = self.samples[KEEP_FIRST:]
                    self.samples = self.samples[:KEEP_FIRST] + later[::2] + ([later[-1]] if len(later) % 2 == 0 else [])
                from loongkit_core import activity

                activity.write_report(self.path, {
                    "pid": os.getpid(), "worker_id": self.worker_id, "affinity": self.affinity, "ended": ended,
                    "samples": [s.to_json() for s in self.samples]})
        except Exception:
            pass

    def start(self) -> None:
        threading.Thread(target=self._loop, name="loongkit-monitor", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.flush(ended=True)

    def _loop(self) -> None:
        while not self._stop.wait(EARLY_INTERVAL if self.taken < EARLY_SAMPLES else self.interval):
            self.flush()


@dataclass
class WorkerReport:
    pid: int
    worker_id: int
    affinity: frozenset[int]
    samples: list[procstat.Usage] = field(default_factory=list)


def parse_report(data: dict[str, Any]) -> WorkerReport | None:
    try:
        samples = [u for u in (procstat.Usage.from_json(s) for s in data.get("samples", [])) if u is not None]
        return WorkerReport(int(data["pid"]), int(data.get("worker_id", -1)),
                            frozenset(int(c) for c in data.get("affinity", [])), samples)
    except (KeyError, TypeError, ValueError):
        return None


def read_reports(directory: str, main_pid: int, remove: bool = False) -> list[WorkerReport]:
    """Every report of ``main_pid``'s workers (``remove``: delete the files once read)."""
    from loongkit_core import activity

    prefix = f"{PREFIX}{main_pid}-"
    found: list[WorkerReport] = []
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(prefix) and n.endswith(".json"))
    except OSError:
        return found
    for name in names:
        path = os.path.join(directory, name)
        data = activity.read_report(path)
        report = parse_report(data) if data is not None else None
        if report is not None and report.samples:
            found.append(report)
        if remove:
            with contextlib.suppress(OSError):
                os.unlink(path)
    return found


@dataclass
class WorkerFigures:
    """The workers over a window of the run."""

    processes: int  # worker processes that reported (a non-persistent loader starts new ones each epoch)
    slots: int  # distinct worker ids
    cpu_used: float | None  # CPUs kept busy by all worker slots together (None: no span to measure)
    rss_growth: float | None  # mean growth of a worker process over the window, bytes
    private_growth: float | None  # same for private memory (copy-on-write shows here, not in RSS)
    rss_mean: float | None  # mean RSS of a worker at its last sample
    majflt: int  # major page faults of all workers in the window
    minflt: int
    affinity: frozenset[int] = frozenset()
    cpu_wait_share: float | None = None  # mean share of a worker's time spent waiting for a CPU

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["affinity"] = sorted(self.affinity)
        return out


def _window(samples: Sequence[procstat.Usage], t_from: float, t_to: float) -> list[procstat.Usage]:
    return [s for s in samples if t_from <= s.t <= t_to]


def summarise(reports: Iterable[WorkerReport], t_from: float, t_to: float) -> WorkerFigures:
    """Figures of the workers' samples inside ``[t_from, t_to]`` (wall clock, ``time.time()``).

    A worker slot's busy CPUs are its CPU seconds over the seconds it was observed alive inside the
    window (so a loader that restarts its workers every epoch is not counted once per generation);
    the job's workers keep the sum of their slots busy.
    """
    reports = list(reports)
    per_slot: dict[int, list[float]] = {}  # worker id -> [cpu seconds, seconds observed, seconds waiting]
    growth_rss: list[float] = []
    growth_private: list[float] = []
    last_rss: list[float] = []
    majflt = minflt = 0
    affinity: frozenset[int] = frozenset()
    for report in reports:
        affinity |= report.affinity
        inside = _window(report.samples, t_from, t_to)
        if len(inside) < 2:
            continue
        first, last = inside[0], inside[-1]
        with_private = [s for s in inside if s.private is not None]
        slot = per_slot.setdefault(report.worker_id, [0.0, 0.0, 0.0])
        slot[0] += last.cpu_s - first.cpu_s
        slot[1] += last.t - first.t
        if first.run_delay_s is not None and last.run_delay_s is not None:
            slot[2] += last.run_delay_s - first.run_delay_s
        growth_rss.append(last.rss - first.rss)
        if len(with_private) >= 2:
            growth_private.append(float(with_private[-1].private or 0) - float(with_private[0].private or 0))
        last_rss.append(last.rss)
        majflt += last.majflt - first.majflt
        minflt += last.minflt - first.minflt
    rates = [cpu / span for cpu, span, _ in per_slot.values() if span > 0]
    waiting = [delay / span for _, span, delay in per_slot.values() if span > 0]

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    return WorkerFigures(
        processes=len(reports), slots=len({r.worker_id for r in reports}),
        cpu_used=sum(rates) if rates else None, rss_growth=mean(growth_rss), private_growth=mean(growth_private),
        rss_mean=mean(last_rss), majflt=majflt, minflt=minflt, affinity=affinity,
        cpu_wait_share=min(1.0, sum(waiting) / len(waiting)) if waiting else None)
