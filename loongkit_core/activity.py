"""Feature activity across the processes of a job: what the Summary's '*' and call counts add up.

Counting stays in each process (``record.calls += 1``: no lock, no syscall on the hot path). What
leaves a process is a small JSON report in a per-node *channel* directory:

* a DataLoader worker (fork, spawn, forkserver, persistent or not) reports its counts, as the
  difference from what it inherited at fork, to its main process: from a daemon thread once a
  second while they change, when its worker loop returns, and on SIGTERM (how multiprocessing ends
  daemonic workers at interpreter exit). A worker that dies keeps what it last flushed;
* at exit a main process folds its workers' reports into its records (``worker_calls``,
  ``workers``) and, when it is one of several local ranks (torchrun), publishes its totals; local
  rank 0 waits briefly for the node's other ranks and shows the node's view (which ranks had each
  feature active).

The channel lives in the first usable of ``/dev/shm``, ``$TMPDIR``, ``/tmp``, under a ``loongkit-<uid>``
directory that passes the log directory's checks (ours, 0700, no symlinks); a main process hands its
path to its children in ``_LOONGKIT_ACTIVITY``. Nothing here touches the training's own streams or
process group, and every failure only loses counts (never the run).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from loongkit_core.record import Record

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~5 ms in every booting process)
if TYPE_CHECKING:
    from typing import Any

ENV = "_LOONGKIT_ACTIVITY"  # "<channel dir>:<main pid>", set by a main process for its children
FLUSH_INTERVAL = 1.0  # seconds between a worker's reports while its counts change
NODE_WAIT = 5.0  # how long local rank 0 waits at exit for the node's other ranks


# Plain classes, not dataclasses: a booting process imports this module (see loongkit_core.feature).
class Totals(Record):
    """One main process's view of a feature: its own calls and its DataLoader workers'."""

    __slots__ = ("calls", "worker_calls", "workers")

    def __init__(self, calls: int = 0, worker_calls: int = 0, workers: int = 0) -> None:
        self.calls = calls
        self.worker_calls = worker_calls
        self.workers = workers  # distinct DataLoader worker ids that ran it

    def to_json(self) -> dict[str, int]:
        return {"calls": self.calls, "worker_calls": self.worker_calls, "workers": self.workers}


class NodeView(Record):
    """Local rank 0's view of the node: each local rank's totals per feature (missing: no report)."""

    __slots__ = ("expected", "ranks")
    _fields = ("ranks", "expected")

    def __init__(self, ranks: dict[int, dict[str, Totals]] | None = None, expected: int = 0) -> None:
        self.ranks: dict[int, dict[str, Totals]] = {} if ranks is None else ranks
        self.expected = expected

    def missing(self) -> list[int]:
        return [r for r in range(self.expected) if r not in self.ranks]


# --------------------------------------------------------------------------------------------------
# The channel directory


def _root_candidates() -> list[str]:
    return [d for d in ("/dev/shm", os.environ.get("TMPDIR", ""), "/tmp") if d]


def channel_root() -> str | None:
    """``<tmpfs>/loongkit-<uid>``, created 0700 and checked like a log directory; None if none works."""
    from loongkit_core import log

    for base in _root_candidates():
        path = os.path.join(base, f"loongkit-{os.geteuid()}")
        try:
            log.ensure_private_dir(path)
            return path
        except OSError:
            continue
    return None


def node_key(pid: int, local_world_size: int | None, environ: Mapping[str, str]) -> str:
    """The channel of one job on one node: a torchrun node's local ranks share their agent's (their
    parent's) and the rendezvous port; a lone main process has its own."""
    if local_world_size and local_world_size > 1:
        port = environ.get("MASTER_PORT", "")
        restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return f"node-{os.getppid()}-{port}-{restart}"
    return f"proc-{pid}"


def _write(path: str, payload: Mapping[str, Any]) -> None:
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        import json  # a report is written at the first count or exit, not at boot

        json.dump(payload, fh)
    os.replace(tmp, path)


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as fh:
            import json

            data = json.load(fh)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _remove(directory: str) -> None:
    """Remove a channel directory: its files, then it (shutil, which imports bz2 and lzma at every main
    process's exit, only for something else in it)."""
    try:
        for name in os.listdir(directory):
            with contextlib.suppress(FileNotFoundError):  # another process removed it first
                os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
    except FileNotFoundError:
        pass
    except OSError:  # a subdirectory, or a report written meanwhile
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


def _calls(data: Mapping[str, Any]) -> dict[str, int]:
    raw = data.get("calls")
    if not isinstance(raw, dict):
        return {}
    return {str(k): int(v) for k, v in raw.items() if isinstance(v, int) and v > 0}


# --------------------------------------------------------------------------------------------------
# The main process's side


class MainChannel:
    """Where one main process's workers report, and (multi-rank) where the node's ranks meet."""

    def __init__(self, directory: str, pid: int, local_rank: int | None, local_world_size: int | None) -> None:
        self.directory = directory
        self.pid = pid
        self.local_rank = local_rank
        self.local_world_size = local_world_size or 1

    @classmethod
    def open(cls, pid: int, local_rank: int | None, local_world_size: int | None,
             environ: Mapping[str, str] | None = None) -> MainChannel | None:
        root = channel_root()
        if root is None:
            return None
        directory = os.path.join(root, node_key(pid, local_world_size, os.environ if environ is None else environ))
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return None
        return cls(directory, pid, local_rank, local_world_size)

    def handoff(self) -> str:
        """The value of ``_LOONGKIT_ACTIVITY`` for this process's children."""
        return f"{self.directory}:{self.pid}"

    def worker_totals(self) -> dict[str, Totals]:
        """Every report of this process's workers, summed per feature."""
        totals: dict[str, Totals] = {}
        ids: dict[str, set[int]] = {}
        prefix = f"w-{self.pid}-"
        try:
            names = [n for n in os.listdir(self.directory) if n.startswith(prefix) and n.endswith(".json")]
        except OSError:
            return totals
        for name in names:
            data = _read(os.path.join(self.directory, name))
            if data is None:
                continue
            worker_id = data.get("worker_id")
            for feature, n in _calls(data).items():
                t = totals.setdefault(feature, Totals())
                t.worker_calls += n
                ids.setdefault(feature, set()).add(int(worker_id) if isinstance(worker_id, int) else -1)
        for feature, seen in ids.items():
            totals[feature].workers = len(seen)
        return totals

    def publish_rank(self, totals: Mapping[str, Totals], rank: int | None) -> None:
        if self.local_rank is None or self.local_world_size <= 1:
            return
        payload = {"rank": rank, "local_rank": self.local_rank, "pid": self.pid,
                   "features": {k: v.to_json() for k, v in totals.items()}}
        with contextlib.suppress(OSError):
            _write(os.path.join(self.directory, f"r-{self.local_rank}.json"), payload)

    def node_view(self, wait: float = NODE_WAIT) -> NodeView:
        """Local rank 0: the node's ranks' totals, waiting up to ``wait`` seconds for all of them."""
        view = NodeView(expected=self.local_world_size)
        deadline = time.monotonic() + wait
        while True:
            for local in range(self.local_world_size):
                if local in view.ranks:
                    continue
                data = _read(os.path.join(self.directory, f"r-{local}.json"))
                if data is None or not isinstance(data.get("features"), dict):
                    continue
                view.ranks[local] = {
                    name: Totals(int(t.get("calls", 0)), int(t.get("worker_calls", 0)), int(t.get("workers", 0)))
                    for name, t in data["features"].items() if isinstance(t, dict)}
            if not view.missing() or time.monotonic() >= deadline:
                return view
            time.sleep(0.05)

    def close(self, node: bool) -> None:
        """Remove this process's reports (``node``: the whole node channel, local rank 0 at the end)."""
        if node:
            _remove(self.directory)
            return
        prefix = f"w-{self.pid}-"
        with contextlib.suppress(OSError):
            for name in os.listdir(self.directory):
                if name.startswith(prefix):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.directory, name))
        if self.local_world_size <= 1:
            _remove(self.directory)


# --------------------------------------------------------------------------------------------------
# A DataLoader worker's side


class WorkerReporter:
    """Flushes one worker's counts to its main process's channel (see the module docstring)."""

    def __init__(self, directory: str, main_pid: int, worker_id: int,
                 counts: Callable[[], Mapping[str, int]], baseline: Mapping[str, int]) -> None:
        self.path = os.path.join(directory, f"w-{main_pid}-{os.getpid()}.json")
        self.worker_id = worker_id
        self._counts = counts
        self._baseline = dict(baseline)
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def delta(self) -> dict[str, int]:
        now = self._counts()
        return {k: n - self._baseline.get(k, 0) for k, n in now.items() if n - self._baseline.get(k, 0) > 0}

    def flush(self) -> None:
        """Write the report if the counts changed since the last one; never raises."""
        try:
            with self._lock:
                delta = self.delta()
                if delta == self._last:
                    return
                _write(self.path, {"pid": os.getpid(), "worker_id": self.worker_id, "calls": delta})
                self._last = delta
        except Exception:
            pass

    def start(self, interval: float = FLUSH_INTERVAL) -> None:
        thread = threading.Thread(target=self._loop, args=(interval,), name="loongkit-activity", daemon=True)
        thread.start()
        self._install_sigterm()

    def stop(self) -> None:
        self._stop.set()
        self.flush()

    def _loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.flush()

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
                return  # someone else handles it; the periodic flush covers us
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except (ValueError, OSError):
            pass

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def parse_handoff(value: str | None) -> tuple[str, int] | None:
    """``(directory, main pid)`` from ``_LOONGKIT_ACTIVITY``, or None when absent or malformed."""
    if not value:
        return None
    directory, sep, pid = value.rpartition(":")
    if not sep or not pid.isdigit() or not os.path.isabs(directory):
        return None
    return directory, int(pid)


def job_directory() -> tuple[str, int] | None:
    """``(channel directory, main pid)`` for this process: a main process's own channel, or the one
    its DataLoader workers report to. Plugins may keep their own per-process reports there (a file
    name prefix of their own, written atomically; the directory is removed when the main process, or
    local rank 0 of a torchrun node, ends)."""
    return parse_handoff(os.environ.get(ENV))


def write_report(path: str, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` as JSON to ``path`` atomically (readers never see half a file)."""
    _write(path, payload)


def read_report(path: str) -> dict[str, Any] | None:
    """A report written by :func:`write_report`, or None if missing or unreadable."""
    return _read(path)


def merged(records: Iterable[Any]) -> dict[str, Totals]:
    """Totals of this process's records (own calls and the worker figures folded into them)."""
    return {r.feature.name: Totals(r.calls, r.worker_calls, r.workers) for r in records
            if r.enabled and (r.calls or r.worker_calls)}
