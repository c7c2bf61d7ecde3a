"""The core's cgroup reader (and its one writer helper): this process's group under either cgroup
version, its CPU quota, memory limit and statistics; for plugins (loongkit-numa's guards, page cache
limit and sub-cgroups, loongkit-monitor's CPU allowance), imported by none of the core's boot modules.

Everything is read under a root (``LOONGKIT_SYSFS_ROOT``, "/" in production) so that tests and dry
runs work on fake trees. The process's own group comes from ``<root>/proc/self/cgroup``; inside a
container with a cgroup namespace that path is "/" and the mount root *is* the container's group,
without one the path names the container's group under the host's mount. When the named group is
not under the mount (a namespace we cannot see through) the mount root is used.

No function here raises on a missing, unreadable or garbled file: it returns None (or an empty
result), and the callers say why they have nothing to work with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CGROUP_MOUNT = "sys/fs/cgroup"
MAX_QUOTA_DEPTH = 64  # a group deeper than this is a loop or garbage, not a hierarchy


def _join(root: str, rel: str) -> str:
    return os.path.join(root, rel.lstrip("/"))


def read_text(path: str) -> str | None:
    """A small cgroup/sysfs file's text, or None when it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(1 << 16)
    except OSError:
        return None


def read_int(path: str) -> int | None:
    raw = read_text(path)
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        return None


def write_text(path: str, value: str) -> str | None:
    """Write ``value`` to a cgroup/sysfs file; None on success, else why it failed."""
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(value)
        return None
    except OSError as exc:
        return f"cannot write {value!r} to {path}: {exc.strerror or exc}"


def version(root: str) -> int | None:
    """2 (unified), 1 (v1 or hybrid) or None when there is no cgroup mount under ``root``."""
    if os.path.exists(_join(root, f"{CGROUP_MOUNT}/cgroup.controllers")):
        return 2
    if os.path.isdir(_join(root, CGROUP_MOUNT)):
        return 1
    return None


def own_path(root: str, controller: str | None) -> str:
    """This process's group path for ``controller`` (v1) or the unified hierarchy (None); "/" if unknown."""
    text = read_text(_join(root, "proc/self/cgroup")) or ""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if controller is None and hierarchy == "0" and controllers == "":
            return path.strip() or "/"
        if controller is not None and controller in controllers.split(","):
            return path.strip() or "/"
    return "/"


def v1_mount(root: str, controller: str) -> str | None:
    """The v1 mount directory of ``controller`` ("cpu" may be mounted as "cpu,cpuacct")."""
    base = _join(root, CGROUP_MOUNT)
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return None
    for name in names:
        if controller in name.split(",") and os.path.isdir(os.path.join(base, name)):
            return os.path.join(base, name)
    return None


@dataclass(frozen=True)
class Group:
    """The process's group in one hierarchy: its directory and the mount it lives under."""

    version: int
    mount: str
    path: str  # absolute directory of the group (the mount root when the own path is not visible)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def lineage(self) -> list[str]:
        """The group's directory and its ancestors up to the mount root, innermost first."""
        out: list[str] = []
        here = os.path.normpath(self.path)
        top = os.path.normpath(self.mount)
        for _ in range(MAX_QUOTA_DEPTH):
            out.append(here)
            if here == top or not here.startswith(top + os.sep):
                break
            here = os.path.dirname(here)
        return out


def own_group(root: str, controller: str) -> Group | None:
    """This process's group for ``controller`` ("cpu" or "memory") under either cgroup version."""
    ver = version(root)
    if ver == 2:
        mount = _join(root, CGROUP_MOUNT)
        rel = own_path(root, None)
    elif ver == 1:
        found = v1_mount(root, controller)
        if found is None:
            return None
        mount = found
        rel = own_path(root, controller)
    else:
        return None
    candidate = os.path.normpath(os.path.join(mount, rel.lstrip("/")))
    path = candidate if os.path.isdir(candidate) else mount
    return Group(ver, mount, path)


# -- CPU quota ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CpuQuota:
    cpus: float  # quota / period: how many CPUs' worth of time the group may use
    source: str  # the file that set it (the tightest along the lineage)


def _parse_cpu_max(text: str) -> float | None:
    """v2 ``cpu.max``: "<quota|max> [period]"; None for unlimited or garbage."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    try:
        quota = int(parts[0])
        period = int(parts[1]) if len(parts) > 1 else 100_000
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def cpu_quota(root: str) -> tuple[CpuQuota | None, list[str]]:
    """The tightest CPU quota over the process's group and its ancestors, and notes on garbage.

    v2 reads ``cpu.max``; v1 reads ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: unlimited).
    """
    notes: list[str] = []
    group = own_group(root, "cpu")
    if group is None:
        return None, notes
    best: CpuQuota | None = None
    for directory in group.lineage():
        cpus: float | None = None
        if group.version == 2:
            path = os.path.join(directory, "cpu.max")
            raw = read_text(path)
            if raw is None:
                continue
            cpus = _parse_cpu_max(raw)
            if cpus is None and raw.split()[:1] != ["max"]:
                notes.append(f"garbled {path}: {raw.strip()[:40]!r}")
        else:
            path = os.path.join(directory, "cpu.cfs_quota_us")
            quota = read_int(path)
            period = read_int(os.path.join(directory, "cpu.cfs_period_us"))
            if quota is None:
                if read_text(path) is not None:
                    notes.append(f"garbled {path}")
                continue
            if quota > 0:
                if period is None or period <= 0:
                    notes.append(f"garbled or missing cpu.cfs_period_us next to {path}")
                    continue
                cpus = quota / period
        if cpus is not None and (best is None or cpus < best.cpus):
            best = CpuQuota(cpus, path)
    return best, notes


# -- memory ---------------------------------------------------------------------------------------------
def memory_stat(group: Group) -> dict[str, int]:
    """``memory.stat`` as {key: value}; lines that are not "<key> <int>" are skipped."""
    out: dict[str, int] = {}
    for line in (read_text(group.file("memory.stat")) or "").splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                continue
    return out


def page_cache_bytes(stat: dict[str, int]) -> int | None:
    """Page cache in a ``memory.stat``: v2 "file", v1 "cache", else active_file + inactive_file."""
    for key in ("file", "cache"):
        if key in stat:
            return stat[key]
    if "active_file" in stat or "inactive_file" in stat:
        return stat.get("active_file", 0) + stat.get("inactive_file", 0)
    return None


UNLIMITED_V1 = 1 << 62  # v1 reports "no limit" as a page-rounded LONG_MAX


def memory_limit(group: Group) -> int | None:
    """The tightest memory limit over the group's lineage (v2 memory.max, v1 memory.limit_in_bytes)."""
    name = "memory.max" if group.version == 2 else "memory.limit_in_bytes"
    best: int | None = None
    for directory in group.lineage():
        raw = read_text(os.path.join(directory, name))
        if raw is None or raw.strip() == "max":
            continue
        try:
            value = int(raw.strip())
        except ValueError:
            continue
        if 0 < value < UNLIMITED_V1 and (best is None or value < best):
            best = value
    return best


def mem_total(root: str) -> int | None:
    """MemTotal of ``<root>/proc/meminfo`` in bytes."""
    for line in (read_text(_join(root, "proc/meminfo")) or "").splitlines():
        if line.startswith("MemTotal:"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def writable(path: str) -> bool:
    """The file exists and this process may write it (EROFS and EACCES both say no)."""
    return os.path.exists(path) and os.access(path, os.W_OK)

