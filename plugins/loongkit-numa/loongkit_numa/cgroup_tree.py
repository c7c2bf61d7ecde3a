"""Find this process's cpuset cgroup (v1 or v2) and write to cgroupfs with errors as values.

Everything is read under a filesystem root (``LOONGKIT_SUBCGROUPS_CGROUP_ROOT``, by default
``LOONGKIT_SYSFS_ROOT``, "/" in production): ``<root>/proc/self/mountinfo`` names the mounts,
``<root>/proc/self/cgroup`` this process's group in each hierarchy, and the mount points are
looked up under the same root, so a fake tree written by a test drives the same code.

The group directory is ``<mount point>/<cgroup path relative to the mount's root>``: mountinfo's
fourth field is the hierarchy path mounted there (a container often mounts its own group as "/").

Nothing here raises for a missing, unreadable or garbled file: the callers get ``None`` or an
:class:`OSError` back and turn it into a reason.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

MOUNTINFO = "proc/self/mountinfo"
PROC_CGROUP = "proc/self/cgroup"


def under(root: str, rel: str) -> str:
    return os.path.join(root, rel.lstrip("/"))


def read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(1 << 20)
    except OSError:
        return None


def write(path: str, value: str) -> OSError | None:
    """Write ``value`` in one ``write(2)`` (cgroupfs takes one value per write); the error, if any."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as exc:
        return exc
    try:
        os.write(fd, value.encode())
    except OSError as exc:
        return exc
    finally:
        os.close(fd)
    return None


def describe(exc: OSError | None, what: str) -> str:
    """``what`` and why it failed, with the errno name so EBUSY/EPERM are recognisable in the logs."""
    if exc is None:
        return what
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{what}: {name + ' ' if name else ''}({text})"


def mkdir(path: str) -> tuple[bool, OSError | None]:
    """(created, error): an existing directory is not an error, but it is not ours either."""
    try:
        os.mkdir(path)
        return True, None
    except FileExistsError:
        return False, None if os.path.isdir(path) else FileExistsError(errno.EEXIST, "exists, not a directory")
    except OSError as exc:
        return False, exc


def writable(path: str) -> bool:
    """``access(W_OK)``: False for EROFS, EACCES and a missing file alike."""
    return os.access(path, os.W_OK)


class CgroupOps:
    """The cgroupfs operations sub-cgroups performs; tests substitute a kernel emulator on a plain tree."""

    def read(self, path: str) -> str | None:
        return read(path)

    def write(self, path: str, value: str) -> OSError | None:
        return write(path, value)

    def mkdir(self, path: str) -> tuple[bool, OSError | None]:
        return mkdir(path)

    def rmdir(self, path: str) -> OSError | None:
        try:
            os.rmdir(path)
        except OSError as exc:
            return exc
        return None

    def writable(self, path: str) -> bool:
        return writable(path)

    def pids(self, path: str) -> list[int]:
        return pids(self.read(path) or "")


def pids(text: str) -> list[int]:
    """The pids listed in a ``cgroup.procs``/``tasks`` text (garbage skipped)."""
    out: list[int] = []
    for line in text.split():
        if line.isdigit():
            out.append(int(line))
    return out


@dataclass(frozen=True)
class Mount:
    point: str  # as mountinfo names it (absolute, relative to the root)
    root: str  # the hierarchy path mounted there
    fstype: str
    mount_options: frozenset[str]
    super_options: frozenset[str]

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


@dataclass(frozen=True)
class Hierarchy:
    """This process's cpuset group and how it was found."""

    version: int  # 1 or 2
    root: str  # the filesystem root everything is read under
    mount: Mount
    mount_dir: str  # the mount point under ``root``
    own_path: str  # the group path from /proc/self/cgroup
    own_dir: str  # that group's directory under the mount

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


def locate(root: str) -> Hierarchy | str:
    """This process's cpuset hierarchy: a v1 cpuset mount first (hybrid hosts), else cgroup v2.

    Returns the reason as a string when there is none to work with.
    """
    info_text = read(under(root, MOUNTINFO))
    if info_text is None:
        return f"cannot read {under(root, MOUNTINFO)}"
    own_text = read(under(root, PROC_CGROUP))
    if own_text is None:
        return f"cannot read {under(root, PROC_CGROUP)}"
    mounts = parse_mountinfo(info_text)
    own = parse_proc_cgroup(own_text)
    v1 = [m for m in mounts if m.fstype == "cgroup" and "cpuset" in m.super_options]
    v2 = [m for m in mounts if m.fstype == "cgroup2"]
    if v1:
        if "cpuset" not in own:
            return f"a cgroup v1 cpuset mount exists but {under(root, PROC_CGROUP)} has no cpuset line"
        for mount in v1:
            directory = _group_dir(root, mount, own["cpuset"])
            if directory is not None:
                return Hierarchy(1, root, mount, under(root, mount.point), own["cpuset"], directory)
        points = ", ".join(under(root, m.point) for m in v1)
        return f"this process's cpuset group {own['cpuset']} is not visible under the cpuset mount(s) {points}"
    if not v2:
        return "no cgroup v1 cpuset mount and no cgroup v2 mount in " + under(root, MOUNTINFO)
    if "" not in own:
        return f"{under(root, PROC_CGROUP)} has no cgroup v2 line (0::/path)"
    for mount in v2:
        directory = _group_dir(root, mount, own[""])
        if directory is not None:
            return Hierarchy(2, root, mount, under(root, mount.point), own[""], directory)
    points = ", ".join(under(root, m.point) for m in v2)
    return f"this process's cgroup {own['']} is not visible under the cgroup v2 mount(s) {points}"
