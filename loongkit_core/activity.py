"""Feature activity across the processes of a job: what the Summary's '*' and call counts add up.

Counting stays in each process (``record.calls += 1``: no lock, no syscall on the hot path). What
leaves a process is a small JSON report in a per-node *channel* directory:

* a DataLoader worker (fork, spawn, forkserver, persistent or not) reports its counts, as the
  difference from what it inherited at fork, to its main process: from a daemon thread once a
  second while they change, when its worker loop returns, and on SIGTERM (how multiprocessing ends
  daemonic workers at interpreter exit). A worker that dies keeps what it last flushed;
* at exit a main process folds its workers' reports into its records (``worker_calls``,
  ``workers``) and, when it is one of several local ranks (torchrun), publishes its totals; local
  rank 0 waits for the node's other ranks and shows the node's view (which global ranks had each
  feature active, and which sent nothing and why).

The channel lives in the first usable of ``/dev/shm``, ``$TMPDIR``, ``/tmp``, under a ``loongkit-<uid>``
directory that passes the log directory's checks (ours, 0700, no symlinks); a main process hands its
path to its children in ``_LOONGKIT_ACTIVITY``. Nothing here touches the training's own streams or
process group, and every failure only loses counts (never the run).

Shared /dev/shm (``docker --ipc=host``, a pod's memory-backed emptyDir kept across container
restarts, several jobs on one host): a channel is named after its job instance on this host, whatever
the PID namespace (:func:`node_key`: the PID namespace's inode, the torchrun agent's pid and start
time, the restart round, the rendezvous). Its members (main processes) hold ``flock`` locks on files
in it, which the kernel drops however a process ends, SIGKILL included, in any namespace sharing the
filesystem:

* ``lock``: every member holds it shared; the last member to leave (it gets it exclusive) removes
  the channel, and a channel whose ``lock`` nobody holds belongs to a job that is gone: :func:`sweep`
  removes it (our uid only, never a live one);
* ``m-<local rank>-<rank>-<pid>-<pid namespace>-<start time>``: one per member, held exclusive by it:
  local rank 0 stops waiting for a peer's report once that lock is free (the peer ended without one),
  falling back to its pid and start time where ``flock`` does not work.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from loongkit_core.record import Record

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at boot (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    from typing import Any

ENV = "_LOONGKIT_ACTIVITY"  # "<channel dir>:<main pid>", set by a main process for its children
FLUSH_INTERVAL = 1.0  # seconds between a worker's reports while its counts change
NODE_WAIT = 5.0  # how long local rank 0 waits at exit for a live local rank's report
STOP_WAIT = 1.0  # ... once the job is being stopped (SIGTERM from the agent, or the agent gone)
POLL = 0.05
LOCK = "lock"
MEMBER = "m-"
STALE_TEMP = 60.0  # seconds after which a half-made channel (its creator died in between) is removed

# A peer's state, as local rank 0 sees it while waiting for its report
ALIVE = "alive"  # it holds its member lock (still running)
GONE = "gone"  # it joined the channel and ended (its lock is free) without a report
ABSENT = "absent"  # it never joined the channel
UNKNOWN = "unknown"  # not in this node's channel (a rank on another node)


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
    """Local rank 0's view of the node: each global rank's totals per feature, and the ranks that sent
    nothing (global rank -> why)."""

    __slots__ = ("expected", "ranks", "silent")
    _fields = ("ranks", "expected", "silent")

    def __init__(self, ranks: dict[int, dict[str, Totals]] | None = None, expected: int = 0,
                 silent: dict[int, str] | None = None) -> None:
        self.ranks: dict[int, dict[str, Totals]] = {} if ranks is None else ranks
        self.expected = expected
        self.silent: dict[int, str] = {} if silent is None else silent

    def missing(self) -> list[int]:
        return sorted(self.silent)


class Member(Record):
    """A main process that joined a channel, from its member file's name."""

    __slots__ = ("local_rank", "name", "ns", "pid", "rank", "start")
    _fields = ("name", "local_rank", "rank", "pid", "ns", "start")

    def __init__(self, name: str, local_rank: int | None, rank: int | None, pid: int, ns: int, start: int) -> None:
        self.name = name
        self.local_rank = local_rank
        self.rank = rank
        self.pid = pid
        self.ns = ns  # inode of its PID namespace (0: unknown)
        self.start = start  # its start time in clock ticks since boot (0: unknown)

    @classmethod
    def parse(cls, name: str) -> Member | None:
        if not name.startswith(MEMBER):
            return None
        parts = name[len(MEMBER):].split("-")
        if len(parts) != 5:
            return None
        try:
            local, rank = (None if p == "x" else int(p) for p in parts[:2])
            return cls(name, local, rank, int(parts[2]), int(parts[3]), int(parts[4]))
        except ValueError:
            return None


def _member_name(local_rank: int | None, rank: int | None, pid: int, ns: int, start: int) -> str:
    return f"{MEMBER}{'x' if local_rank is None else local_rank}-{'x' if rank is None else rank}-{pid}-{ns}-{start}"


# --------------------------------------------------------------------------------------------------
# Identity: which job instance on this host


def pid_namespace() -> int:
    """The inode of this process's PID namespace (two containers' PID 1 differ here); 0 if unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def start_time(pid: int) -> int:
    """When ``pid`` started, in clock ticks since boot (field 22 of /proc/<pid>/stat); 0 if unknown.
    With its pid and PID namespace it names one process on this host, even after its pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _tag(text: str) -> str:
    """FNV-1a of ``text`` (8 hex digits): free-form parts of a name, without hashlib at boot."""
    h = 0x811C9DC5
    for b in text.encode("utf-8", "replace"):
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return f"{h:08x}"


def node_key(pid: int, local_world_size: int | None, environ: Mapping[str, str]) -> str:
    """The channel of one job instance on one node: a torchrun node's local ranks share their agent's
    (their parent's); a lone main process has its own. Unique on this host whatever the PID namespace:
    two containers' agents are both PID 1 with the same MASTER_PORT, but their namespaces differ; a
    restarted pod's agent has the same pid in a new namespace and a new start time."""
    ns = pid_namespace()
    if local_world_size and local_world_size > 1:
        agent = os.getppid()
        restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        rendezvous = "|".join(environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT",
                                                            "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT"))
        return (f"node-{ns}-{agent}-{start_time(agent)}-{restart if restart.isdigit() else 'x'}-"
                f"{_tag(rendezvous)}")
    return f"proc-{ns}-{pid}-{start_time(pid)}"


# --------------------------------------------------------------------------------------------------
# The job is being stopped: waits for reports end early


_stopping: list[float] = []  # time.monotonic() when this process learned that its job is ending
_agent: list[int] = []  # the torchrun agent's pid at boot (a rank's parent), when it has one


def mark_stopping() -> None:
    """The agent stops the job (a SIGTERM to this rank): nobody waits long for reports from now on."""
    if not _stopping:
        _stopping.append(time.monotonic())


def stopping() -> float | None:
    """When this process learned its job is ending (SIGTERM, or its torchrun agent gone), or None."""
    if not _stopping and _agent and os.getppid() != _agent[0]:
        mark_stopping()  # the agent died: this rank was reparented
    return _stopping[0] if _stopping else None


def wait_deadline(deadline: float) -> float:
    """``deadline`` (time.monotonic()), shortened to STOP_WAIT after the job started stopping."""
    since = stopping()
    return deadline if since is None else min(deadline, since + STOP_WAIT)


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


def _flock(fd: int, how: int) -> bool | None:
    """flock(2): True when taken, False when another holder blocks it, None where locks do not work."""
    import fcntl  # only in a process that opens a channel

    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, EINVAL: a filesystem without flock
        return None


def _open_lock(directory: str) -> int | None:
    """An fd on ``directory``'s lock file, which must be ours; None when it has none."""
    try:
        fd = os.open(os.path.join(directory, LOCK), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _same_file(fd: int, path: str) -> bool:
    """``fd`` is still the file at ``path`` (not one a remover renamed away meanwhile)."""
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _join(directory: str) -> tuple[int, bool] | None:
    """Join an existing channel: (its lock fd held shared, whether locks work), or None when there is
    none (or it is being removed: its last member or :func:`sweep` holds it exclusive)."""
    fd = _open_lock(directory)
    if fd is None:
        return None
    import fcntl

    taken = _flock(fd, fcntl.LOCK_SH)
    if taken is not False and _same_file(fd, os.path.join(directory, LOCK)):
        return fd, taken is True
    os.close(fd)
    return None


def _create(root: str, key: str) -> tuple[int, bool] | None:
    """Make the channel ``key`` with its lock already held: built under a temporary name and renamed
    into place, so nobody ever sees it without a holder. None when another rank made it first."""
    import fcntl

    tmp = os.path.join(root, f".{key}.{os.getpid()}")
    _remove(tmp)  # a leftover of an earlier process with our pid
    os.mkdir(tmp, 0o700)
    try:
        fd = os.open(os.path.join(tmp, LOCK), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError:
        _remove(tmp)
        raise
    locks = _flock(fd, fcntl.LOCK_SH) is True
    try:
        os.rename(tmp, os.path.join(root, key))  # fails on an existing (never empty) channel
        return fd, locks
    except OSError:
        os.close(fd)
        _remove(tmp)
        return None


def _enter(root: str, key: str) -> tuple[int, bool] | None:
    """Join channel ``key`` or create it: (lock fd held shared, whether locks work)."""
    directory = os.path.join(root, key)
    for _ in range(100):  # a member leaving last removes it while we join: create it again
        joined = _join(directory)
        if joined is not None:
            return joined
        try:
            made = _create(root, key)
        except OSError:
            return None
        if made is not None:
            return made
        time.sleep(0.01)
    return None


def _retire(root: str, directory: str, lock_fd: int) -> None:
    """Remove a channel whose lock ``lock_fd`` holds exclusive: renamed away first, so the name is
    free at once and a process joining it meanwhile sees that its lock file moved (:func:`_join`)."""
    dead = os.path.join(root, f".dead-{os.path.basename(directory)}-{os.getpid()}")
    try:
        os.rename(directory, dead)
    except OSError:
        dead = directory
    try:
        _remove(dead)
    finally:
        os.close(lock_fd)


def _pid_alive(member: Member, ns: int) -> bool:
    """Without flock: a member in our PID namespace lives while its pid has its start time; one in
    another namespace is taken as alive (its pid means nothing here)."""
    if not member.ns or member.ns != ns or not member.start:
        return True
    return start_time(member.pid) == member.start


def members(directory: str) -> list[Member]:
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [m for m in (Member.parse(n) for n in names if n.startswith(MEMBER)) if m is not None]


def member_alive(directory: str, member: Member) -> bool:
    """Whether ``member`` still runs: it holds its member lock (any PID namespace)."""
    import fcntl

    try:
        fd = os.open(os.path.join(directory, member.name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False  # its channel is being removed: nobody holds it
    except OSError:
        return _pid_alive(member, pid_namespace())
    try:
        taken = _flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)  # also drops the lock we may have taken
    return _pid_alive(member, pid_namespace()) if taken is None else not taken


def peer_state(directory: str, *, local_rank: int | None = None, rank: int | None = None) -> str:
    """ALIVE, GONE or ABSENT: the main process with this local rank (or global rank) in the channel."""
    found = [m for m in members(directory)
             if (local_rank is not None and m.local_rank == local_rank) or (rank is not None and m.rank == rank)]
    if not found:
        return ABSENT
    return ALIVE if any(member_alive(directory, m) for m in found) else GONE


def silence_reason(state: str, wait: float) -> str:
    """Why a rank sent no report, in the Summary's words."""
    if state == GONE:
        return "its process ended without one (killed or crashed)"
    if state == ABSENT:
        return "it never joined the node's channel (ended early, or runs without loongkit)"
    if stopping() is not None:
        return "not waited for: the job was being stopped"
    return f"none within {wait:g} s" + (" (still running)" if state == ALIVE else "")


def sweep(root: str | None = None) -> list[str]:
    """Remove the channels of jobs that are gone (nobody holds their ``lock``: their members ended
    however they ended) and half-made ones; never a live one, never another uid's. The channels
    returned were removed. Channels without a lock file (older loongkit versions) are left alone."""
    import fcntl

    root = channel_root() if root is None else root
    if root is None:
        return []
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.geteuid():
            continue
        if name.startswith((".node-", ".proc-")) and now - st.st_mtime > STALE_TEMP:
            _remove(path)  # its creator died between mkdir and rename
            continue
        if name.startswith(".dead-") and now - st.st_mtime > STALE_TEMP:
            _remove(path)  # its remover died while removing it
            continue
        if not name.startswith(("node-", "proc-")):
            continue
        fd = _open_lock(path)
        if fd is None:
            continue
        taken = _flock(fd, fcntl.LOCK_EX)
        if taken is None:  # no flock here: gone only when every member is provably dead
            ns = pid_namespace()
            found = members(path)
            taken = bool(found) and not any(_pid_alive(m, ns) for m in found)
        if taken and _same_file(fd, os.path.join(path, LOCK)):
            _retire(root, path, fd)
            removed.append(name)
        else:
            os.close(fd)
    return removed


# --------------------------------------------------------------------------------------------------
# The main process's side


def _calls(data: Mapping[str, Any]) -> dict[str, int]:
    raw = data.get("calls")
    if not isinstance(raw, dict):
        return {}
    return {str(k): int(v) for k, v in raw.items() if isinstance(v, int) and v > 0}


class MainChannel:
    """Where one main process's workers report, and (multi-rank) where the node's ranks meet."""

    def __init__(self, directory: str, pid: int, local_rank: int | None, local_world_size: int | None,
                 rank: int | None = None, lock_fd: int = -1, member_fd: int = -1, locks: bool = False) -> None:
        self.directory = directory
        self.pid = pid
        self.local_rank = local_rank
        self.local_world_size = local_world_size or 1
        self.rank = rank
        self._lock_fd = lock_fd  # the channel's lock, held shared while we are a member
        self._member_fd = member_fd  # our member file, held exclusive while we run
        self.locks = locks  # flock works here (else liveness falls back to pids)

    @classmethod
    def open(cls, pid: int, local_rank: int | None, local_world_size: int | None,
             environ: Mapping[str, str] | None = None, rank: int | None = None,
             root: str | None = None) -> MainChannel | None:
        root = channel_root() if root is None else root
        if root is None:
            return None
        key = node_key(pid, local_world_size, os.environ if environ is None else environ)
        entered = _enter(root, key)
        if entered is None:
            return None
        lock_fd, locks = entered
        directory = os.path.join(root, key)
        if local_world_size and local_world_size > 1 and not _agent:
            _agent.append(os.getppid())
        member_fd = -1
        try:
            import fcntl

            name = _member_name(local_rank, rank, pid, pid_namespace(), start_time(pid))
            member_fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                                0o600)
            _flock(member_fd, fcntl.LOCK_EX)
        except OSError:  # no liveness record: local rank 0 waits for our report until its deadline
            pass
        return cls(directory, pid, local_rank, local_world_size, rank, lock_fd, member_fd, locks)

    def handoff(self) -> str:
        """The value of ``_LOONGKIT_ACTIVITY`` for this process's children."""
        return f"{self.directory}:{self.pid}"

    def forget(self) -> None:
        """In a forked child: drop the inherited lock fds (the locks stay the parent's), so a dying main's
        DataLoader workers do not keep it looking alive."""
        for fd in (self._lock_fd, self._member_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._lock_fd = self._member_fd = -1

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

    def global_rank(self, local: int) -> int:
        """The global rank of local rank ``local`` on this node (torchrun numbers a node's ranks
        consecutively), from its member file when it joined."""
        for m in members(self.directory):
            if m.local_rank == local and m.rank is not None:
                return m.rank
        if self.rank is not None and self.local_rank is not None:
            return self.rank - self.local_rank + local
        return local

    def _rank_report(self, local: int) -> tuple[int, dict[str, Totals]] | None:
        data = _read(os.path.join(self.directory, f"r-{local}.json"))
        if data is None or not isinstance(data.get("features"), dict):
            return None
        rank = data.get("rank")
        totals = {name: Totals(int(t.get("calls", 0)), int(t.get("worker_calls", 0)), int(t.get("workers", 0)))
                  for name, t in data["features"].items() if isinstance(t, dict)}
        return (rank if isinstance(rank, int) else self.global_rank(local)), totals

    def node_view(self, wait: float = NODE_WAIT, clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> NodeView:
        """Local rank 0: the node's ranks' totals (by global rank), waiting up to ``wait`` seconds for
        ranks that still run; none for a rank that ended without a report, at most STOP_WAIT once the
        job is being stopped."""
        view = NodeView(expected=self.local_world_size)
        pending = set(range(self.local_world_size))
        deadline = clock() + wait
        while True:
            for local in sorted(pending):
                got = self._rank_report(local)
                if got is not None:
                    view.ranks[got[0]] = got[1]
                    pending.discard(local)
            if not pending:
                return view
            states = {local: peer_state(self.directory, local_rank=local) for local in pending}
            done = all(s == GONE for s in states.values())
            if done or clock() >= wait_deadline(deadline):
                for local in sorted(pending):  # a last look: it may have reported, then ended
                    got = self._rank_report(local)
                    if got is not None:
                        view.ranks[got[0]] = got[1]
                    else:
                        view.silent[self.global_rank(local)] = silence_reason(states[local], wait)
                return view
            sleep(POLL)

    def close(self) -> None:
        """Leave the channel: remove this process's workers' reports; the last member to leave removes
        the channel (its reports were read by then: local rank 0 leaves after reading them)."""
        prefix = f"w-{self.pid}-"
        with contextlib.suppress(OSError):
            for name in os.listdir(self.directory):
                if name.startswith(prefix):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.directory, name))
        import fcntl

        if self._member_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._member_fd)  # from here local rank 0 knows we ended
            self._member_fd = -1
        fd, self._lock_fd = self._lock_fd, -1
        root = os.path.dirname(self.directory)
        if fd >= 0 and self.locks:
            if _flock(fd, fcntl.LOCK_EX) and _same_file(fd, os.path.join(self.directory, LOCK)):
                _retire(root, self.directory, fd)  # nobody else holds it: we are the last
            else:
                os.close(fd)
        else:  # no flock: a lone process, or local rank 0 (it read the others' reports), removes it
            if fd >= 0:
                os.close(fd)
            if self.local_world_size <= 1 or self.local_rank == 0:
                _remove(self.directory)
        if self.local_rank in (None, 0):
            with contextlib.suppress(OSError):
                sweep(root)


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
