"""The core's cgroup reader (and its one writer helper): this process's group under either cgroup
version, its CPU quota, memory limit and statistics, its cpuset (:mod:`loongkit_core.hardware`), and its
cpuset hierarchy as the mount table shows it (:func:`locate_cpuset`, for loongkit-numa's sub-cgroups,
which create and join groups under it); for the core's hardware facts and for plugins (loongkit-numa's
guards, page cache limit and sub-cgroups, loongkit-monitor's CPU allowance).

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

from loongkit_core.record import Record

CGROUP_MOUNT = "sys/fs/cgroup"
MOUNTINFO = "proc/self/mountinfo"
PROC_CGROUP = "proc/self/cgroup"
MAX_QUOTA_DEPTH = 64  # a group deeper than this is a loop or garbage, not a hierarchy


def under(root: str, rel: str) -> str:
    """``rel`` (absolute or not) under the filesystem root everything is read under."""
    return os.path.join(root, rel.lstrip("/"))


_join = under


def read_text(path: str, limit: int = 1 << 16) -> str | None:
    """A small cgroup/sysfs file's text (at most ``limit`` characters), or None when it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(limit)
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



def cpuset_files(root: str) -> tuple[int | None, list[str]]:
    """The cgroup version under ``root`` (None: no cgroup mount) and the files that may hold this
    process's effective cpuset, most specific first: its own group's, then the mount root's (the
    path from /proc/self/cgroup is relative to the cgroup namespace; inside a container the mount root
    is usually the container's own group). v1: the cpuset mount (``sys/fs/cgroup/cpuset`` where none
    is found), ``cpuset.effective_cpus`` then ``cpuset.cpus``; v2: ``cpuset.cpus.effective``."""
    ver = version(root)
    if ver is None:
        return None, []
    if ver == 2:
        mount, rel, names = _join(root, CGROUP_MOUNT), own_path(root, None), ("cpuset.cpus.effective",)
    else:
        mount = v1_mount(root, "cpuset") or _join(root, f"{CGROUP_MOUNT}/cpuset")
        rel, names = own_path(root, "cpuset"), ("cpuset.effective_cpus", "cpuset.cpus")
    group = os.path.normpath(os.path.join(mount, rel.lstrip("/")))
    return ver, [os.path.join(directory, name) for directory in (group, mount) for name in names]


# -- the mount table: this process's cpuset hierarchy -----------------------------------------------------
# Read under the same root: ``<root>/proc/self/mountinfo`` names the mounts, ``<root>/proc/self/cgroup``
# this process's group in each hierarchy, and the mount points are looked up under the root, so a fake
# tree written by a test drives the same code. The group directory is ``<mount point>/<cgroup path
# relative to the mount's root>``: mountinfo's fourth field is the hierarchy path mounted there (a
# container often mounts its own group as "/"). Plain records, not dataclasses: this module is imported
# in booting processes (through hardware), where building a dataclass is a boot cost.


class Mount(Record):
    """One mountinfo line: where, what is mounted there, its type and options."""

    __slots__ = ("fstype", "mount_options", "point", "root", "super_options")
    _fields = ("point", "root", "fstype", "mount_options", "super_options")

    def __init__(self, point: str, root: str, fstype: str, mount_options: frozenset[str],
                 super_options: frozenset[str]) -> None:
        self.point = point  # as mountinfo names it (absolute, relative to the root)
        self.root = root  # the hierarchy path mounted there
        self.fstype = fstype
        self.mount_options = mount_options
        self.super_options = super_options

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, n) for n in self._fields))

    @property
    def read_only(self) -> bool:
        return "ro" in self.mount_options or "ro" in self.super_options


def _unescape(field_text: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \040, \011, \012, \134.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field_text = field_text.replace(code, char)
    return field_text


def parse_mountinfo(text: str) -> list[Mount]:
    """Parse ``/proc/<pid>/mountinfo``; lines that do not have the documented shape are skipped."""
    mounts: list[Mount] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        tail = right.split()
        if len(fields) < 6 or len(tail) < 2:
            continue
        mounts.append(Mount(
            point=_unescape(fields[4]),
            root=_unescape(fields[3]),
            fstype=tail[0],
            mount_options=frozenset(fields[5].split(",")),
            super_options=frozenset(tail[2].split(",")) if len(tail) > 2 else frozenset(),
        ))
    return mounts


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as {controller: path}; the v2 line ("0::/x") is under the key ""."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            out[""] = path.strip() or "/"
            continue
        for name in controllers.split(","):
            if name:
                out[name] = path.strip() or "/"
    return out


class Hierarchy(Record):
    """This process's cpuset group and how it was found."""

    __slots__ = ("mount", "mount_dir", "own_dir", "own_path", "root", "version")
    _fields = ("version", "root", "mount", "mount_dir", "own_path", "own_dir")

    def __init__(self, version: int, root: str, mount: Mount, mount_dir: str, own_path: str, own_dir: str) -> None:
        self.version = version  # 1 or 2
        self.root = root  # the filesystem root everything is read under
        self.mount = mount
        self.mount_dir = mount_dir  # the mount point under ``root``
        self.own_path = own_path  # the group path from /proc/self/cgroup
        self.own_dir = own_dir  # that group's directory under the mount

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, n) for n in self._fields))

    @property
    def label(self) -> str:
        return "v1 cpuset" if self.version == 1 else "v2"

    def cpus_file(self, directory: str, effective: bool = False) -> str:
        if self.version == 1:
            return os.path.join(directory, "cpuset.effective_cpus" if effective else "cpuset.cpus")
        return os.path.join(directory, "cpuset.cpus.effective" if effective else "cpuset.cpus")

    def mems_file(self, directory: str, effective: bool = False) -> str:
        if self.version == 1:
            return os.path.join(directory, "cpuset.effective_mems" if effective else "cpuset.mems")
        return os.path.join(directory, "cpuset.mems.effective" if effective else "cpuset.mems")


def _group_dir(root: str, mount: Mount, own_path: str) -> str | None:
    """The directory of ``own_path`` under ``mount``, or None when the mount does not show it."""
    mount_root = os.path.normpath(mount.root or "/")
    path = os.path.normpath(own_path or "/")
    if mount_root != "/":
        if path == mount_root:
            path = "/"
        elif path.startswith(mount_root + "/"):
            path = path[len(mount_root):]
        # else: a cgroup namespace makes the path relative to the namespace root, which is then
        # what is mounted; take the path as it is and check that it exists.
    directory = os.path.normpath(os.path.join(under(root, mount.point), path.lstrip("/")))
    return directory if os.path.isdir(directory) else None


def _first_visible(version: int, root: str, mounts: list[Mount], own_path: str) -> Hierarchy | None:
    """The hierarchy of the first of ``mounts`` that shows this process's group ``own_path``."""
    for mount in mounts:
        directory = _group_dir(root, mount, own_path)
        if directory is not None:
            return Hierarchy(version, root, mount, under(root, mount.point), own_path, directory)
    return None


def locate_cpuset(root: str) -> Hierarchy | str:
    """This process's cpuset hierarchy: a v1 cpuset mount first (hybrid hosts), else cgroup v2.

    Returns the reason as a string when there is none to work with.
    """
    info_text = read_text(under(root, MOUNTINFO), 1 << 20)
    if info_text is None:
        return f"cannot read {under(root, MOUNTINFO)}"
    own_text = read_text(under(root, PROC_CGROUP), 1 << 20)
    if own_text is None:
        return f"cannot read {under(root, PROC_CGROUP)}"
    mounts = parse_mountinfo(info_text)
    own = parse_proc_cgroup(own_text)
    v1 = [m for m in mounts if m.fstype == "cgroup" and "cpuset" in m.super_options]
    v2 = [m for m in mounts if m.fstype == "cgroup2"]
    if v1:
        if "cpuset" not in own:
            return f"a cgroup v1 cpuset mount exists but {under(root, PROC_CGROUP)} has no cpuset line"
        found = _first_visible(1, root, v1, own["cpuset"])
        if found is not None:
            return found
        points = ", ".join(under(root, m.point) for m in v1)
        return f"this process's cpuset group {own['cpuset']} is not visible under the cpuset mount(s) {points}"
    if not v2:
        return "no cgroup v1 cpuset mount and no cgroup v2 mount in " + under(root, MOUNTINFO)
    if "" not in own:
        return f"{under(root, PROC_CGROUP)} has no cgroup v2 line (0::/path)"
    found = _first_visible(2, root, v2, own[""])
    if found is not None:
        return found
    points = ", ".join(under(root, m.point) for m in v2)
    return f"this process's cgroup {own['']} is not visible under the cgroup v2 mount(s) {points}"

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

