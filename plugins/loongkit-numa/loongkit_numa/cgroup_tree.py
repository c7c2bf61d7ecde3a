"""Create and join cpuset sub-groups: cgroupfs writes with errors as values, and the operations
sub-cgroups performs (:class:`CgroupOps`, which tests replace with a kernel emulator on a plain tree).

Finding this process's cpuset group is the core's cgroup reader's job (:mod:`loongkit_core.cgroupfs`:
:func:`~loongkit_core.cgroupfs.locate_cpuset`, the mount table and ``/proc/self/cgroup`` under a root,
``LOONGKIT_SUBCGROUPS_CGROUP_ROOT``, by default ``LOONGKIT_SYSFS_ROOT``, "/" in production); its names are
re-exported here for sub-cgroups.

Nothing here raises for a missing, unreadable or garbled file: the callers get ``None`` or an
:class:`OSError` back and turn it into a reason.
"""

from __future__ import annotations

import errno
import os

from loongkit_core.cgroupfs import (
    MOUNTINFO,
    PROC_CGROUP,
    Hierarchy,
    Mount,
    parse_mountinfo,
    parse_proc_cgroup,
    read_text,
    under,
)
from loongkit_core.cgroupfs import locate_cpuset as locate

__all__ = ["MOUNTINFO", "PROC_CGROUP", "CgroupOps", "Hierarchy", "Mount", "describe", "locate", "mkdir",
           "parse_mountinfo", "parse_proc_cgroup", "pids", "read", "under", "writable", "write"]


def read(path: str) -> str | None:
    """A cgroupfs file's text (up to 1 MiB: a ``cgroup.procs`` may be long), or None."""
    return read_text(path, 1 << 20)


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
