"""What a process uses, read cheaply from the kernel: CPU time, resident and private memory, faults.

No psutil: ``getrusage`` (CPU time of every thread, page faults), ``/proc/self/statm`` (resident
pages) and ``schedstat`` (time spent runnable, waiting for a CPU) cost a few microseconds;
``/proc/self/smaps_rollup`` (private memory, what copy-on-write in forked DataLoader workers makes
grow while RSS stays flat) costs milliseconds and is read by the workers' sampler thread only, off
the training thread.

The CPUs a job may use: the affinity mask, capped by the cgroup CPU quota (read by the core's cgroup
reader, ``loongkit_core.cgroupfs``, as loongkit-numa's guards read it).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass

from loongkit_core.resident import STATM, resident_bytes


@dataclass(frozen=True)
class Usage:
    """One sample of one process."""

    t: float  # time.time() (comparable between the processes of a node)
    cpu_s: float  # user + system seconds of all its threads since it started
    rss: int  # resident bytes
    minflt: int  # minor page faults since it started
    majflt: int  # major page faults (read from disk) since it started
    private: int | None = None  # Private_Clean + Private_Dirty bytes (smaps_rollup), None if not read
    run_delay_s: float | None = None  # its main thread's time runnable but waiting for a CPU (schedstat)
    # Main process only (not in the workers' reports): CPU seconds the job's CPUs were busy, whoever ran
    # (/proc/stat), and the interpreter's allocated blocks (Python objects kept vs native memory).
    cpus_busy_s: float | None = None
    py_blocks: int | None = None

    def to_json(self) -> list[float | int | None]:
        """A compact row (the field order): workers rewrite their history every second."""
        return [self.t, self.cpu_s, self.rss, self.minflt, self.majflt, self.private, self.run_delay_s]

    @classmethod
    def from_json(cls, data: object) -> Usage | None:
        if not isinstance(data, list) or len(data) != 7:
            return None
        try:
            t, cpu, rss, minflt, majflt, private, delay = data
            return cls(float(t), float(cpu), int(rss), int(minflt), int(majflt),
                       None if private is None else int(private), None if delay is None else float(delay))
        except (TypeError, ValueError):
            return None


def rss_bytes(path: str = STATM) -> int:
    """Resident bytes (0 when unreadable: a sample's field is a count)."""
    return resident_bytes(path) or 0


def private_bytes(path: str = "/proc/self/smaps_rollup") -> int | None:
    """Private_Clean + Private_Dirty in bytes, or None when the kernel has no smaps_rollup."""
    try:
        with open(path, "rb") as fh:
            text = fh.read(1 << 14)
    except OSError:
        return None
    total = 0
    found = False
    for line in text.splitlines():
        if line.startswith((b"Private_Clean:", b"Private_Dirty:")):
            parts = line.split()
            try:
                total += int(parts[1]) * 1024  # the kernel writes kB
                found = True
            except (IndexError, ValueError):
                return None
    return total if found else None


def run_delay(path: str = "/proc/thread-self/schedstat") -> float | None:
    """Seconds the calling thread was runnable but waited for a CPU (schedstat's second field): what
    a process loses to other processes, or to its own extra threads, on the CPUs it may use."""
    try:
        with open(path, "rb") as fh:
            return int(fh.read(128).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def sample(private: bool = False, thread: bool = True, cpus: frozenset[int] | None = None) -> Usage:
    """This process, now; ``thread``: the calling thread's wait for a CPU (the worker's sampler thread
    passes False and reads the process's main thread instead); ``cpus``: also how busy those CPUs
    were (every process's time on them) and the interpreter's allocated blocks (the main process)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return Usage(time.time(), ru.ru_utime + ru.ru_stime, rss_bytes(), ru.ru_minflt, ru.ru_majflt,
                 private_bytes() if private else None,
                 run_delay() if thread else run_delay("/proc/self/schedstat"),
                 cpus_busy(cpus) if cpus is not None else None,
                 sys.getallocatedblocks() if cpus is not None else None)


def cpus_busy(cpus: frozenset[int], path: str = "/proc/stat") -> float | None:
    """Seconds ``cpus`` spent busy since boot (user, nice, system, irq, softirq, steal; not idle or
    iowait), summed: with the job's own CPU time, what other processes took of the job's CPUs."""
    try:
        with open(path, "rb") as fh:
            text = fh.read(1 << 20)
    except OSError:
        return None
    tick = _clock_tick()
    total = 0
    found = 0
    for line in text.splitlines():
        if not line.startswith(b"cpu") or line[3:4] == b" ":
            continue
        parts = line.split()
        try:
            cpu = int(parts[0][3:])
            if cpu not in cpus:
                continue
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in parts[1:9])
        except (ValueError, IndexError):
            return None
        total += user + nice + system + irq + softirq + steal
        found += 1
    return total / tick if found else None


def _clock_tick() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK")) or 100
    except (ValueError, OSError, AttributeError):
        return 100


@dataclass(frozen=True)
class ProcessCpu:
    pid: int
    ppid: int
    name: str
    cpu_s: float  # user + system seconds since it started
    last_cpu: int  # the CPU it last ran on


def processes(proc: str = "/proc") -> dict[int, ProcessCpu]:
    """Every visible process's CPU time (one read of /proc/<pid>/stat each; a few ms for hundreds)."""
    tick = _clock_tick()
    out: dict[int, ProcessCpu] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat", "rb") as fh:
                raw = fh.read(1024)
        except OSError:
            continue
        head, _, rest = raw.rpartition(b")")
        fields = rest.split()
        try:
            comm = head.partition(b"(")[2].decode(errors="replace")
            out[int(name)] = ProcessCpu(int(name), int(fields[1]), comm,
                                        (int(fields[11]) + int(fields[12])) / tick, int(fields[36]))
        except (IndexError, ValueError):
            continue
    return out


def others_busy(before: dict[int, ProcessCpu], after: dict[int, ProcessCpu], job: frozenset[int],
                cpus: frozenset[int], seconds: float) -> list[tuple[str, int, float]]:
    """Processes outside ``job`` (pids) that kept CPUs busy between two :func:`processes` scans and
    last ran on one of ``cpus``: (name, pid, CPUs busy), busiest first."""
    found: list[tuple[str, int, float]] = []
    if seconds <= 0:
        return found
    for pid, now in after.items():
        if pid in job or now.last_cpu not in cpus:
            continue
        then = before.get(pid)
        used = now.cpu_s - then.cpu_s if then is not None else now.cpu_s  # a new one: all of it is inside
        if used / seconds >= 0.05:
            found.append((now.name, pid, used / seconds))
    return sorted(found, key=lambda item: -item[2])


def descendants(root: int, table: dict[int, ProcessCpu]) -> frozenset[int]:
    """``root`` and every process below it in ``table``."""
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    seen = {root}
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return frozenset(seen)


def affinity() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class CpuAllowance:
    cpus: float  # CPUs this rank's processes may keep busy
    mask: int  # CPUs in their affinity masks
    quota: float | None  # the cgroup quota of the node's job in CPUs (None: unlimited or unread)
    ranks: int  # local ranks sharing the quota
    note: str = ""

    def describe(self) -> str:
        if self.quota is not None and self.cpus < self.mask:
            shared = f", shared by {self.ranks} local ranks" if self.ranks > 1 else ""
            return f"cgroup quota {self.quota:g} CPUs{shared}"
        return f"{self.mask} CPUs in the affinity mask"


def cgroup_quota(root: str = "/") -> tuple[float | None, str]:
    """The tightest cgroup CPU quota (CPUs) along this process's groups, and a note when unread."""
    from loongkit_core import cgroupfs

    try:
        quota, _notes = cgroupfs.cpu_quota(root)
    except Exception as exc:  # a reader bug must not cost the report
        return None, f"cgroup CPU quota not read: {exc}"
    return (None if quota is None else float(quota.cpus)), ""


def allowance(cpus: frozenset[int], local_ranks: int = 1, root: str = "/") -> CpuAllowance:
    """What ``cpus`` (the union of a rank's and its workers' affinity masks) allow under the quota."""
    mask = len(cpus) or os.cpu_count() or 1
    quota, note = cgroup_quota(root)
    ranks = max(1, local_ranks)
    allowed = float(mask)
    if quota is not None:
        allowed = min(allowed, quota / ranks)
    return CpuAllowance(allowed, mask, quota, ranks, note)
