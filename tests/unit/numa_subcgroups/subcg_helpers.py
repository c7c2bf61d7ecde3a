"""Fake cgroup v2 trees written by code, and a small emulator of the kernel rules sub-cgroups meets.

A plain directory does not behave like cgroupfs: ``mkdir`` creates no control files, any pid can be
written anywhere. :class:`FakeV2Ops` (the feature's ``CgroupOps`` for such a tree) applies the rules
that matter here: control files appear with a group; ``cgroup.procs`` moves a pid out of every other
group; a non-root group with controllers in ``subtree_control`` refuses processes (EBUSY), and
``+cpuset`` is refused while the group holds processes (EBUSY) or lacks the controller (ENOENT);
a child's ``cpuset.cpus`` must lie within its parent's; ``rmdir`` is refused while the group holds
processes or children (EBUSY). ``deny`` lists paths whose writes fail with EACCES (no delegation).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from loongkit_numa.cgroup_tree import CgroupOps

from loongkit_core.hardware import format_cpulist, parse_cpulist


def write_v2_tree(root: str | Path, *, group: str = "/job", cpus: str = "0-1", mems: str = "0",
                  controllers: str = "cpuset cpu io memory pids", procs: tuple[int, ...] = (),
                  mount_options: str = "rw,nosuid,nodev,noexec,relatime", super_options: str = "rw,nsdelegate",
                  ) -> Path:
    """A cgroup v2 mount at <root>/sys/fs/cgroup with this process in ``group``; returns the group dir.

    ``controllers`` is what the group may use (its parent enabled them for it); ``procs`` its processes.
    """
    base = Path(root)
    (base / "proc/self").mkdir(parents=True, exist_ok=True)
    (base / "proc/self/mountinfo").write_text(
        "22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/root rw\n"
        f"30 22 0:26 / /sys/fs/cgroup {mount_options} shared:4 - cgroup2 cgroup2 {super_options}\n")
    (base / "proc/self/cgroup").write_text(f"0::{group}\n")
    mount = base / "sys/fs/cgroup"
    mount.mkdir(parents=True, exist_ok=True)
    (mount / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (mount / "cgroup.subtree_control").write_text("cpuset cpu io memory pids\n")
    (mount / "cgroup.procs").write_text("1\n")
    (mount / "cpuset.cpus.effective").write_text(cpus + "\n")
    (mount / "cpuset.mems.effective").write_text(mems + "\n")
    here = mount
    for part in [p for p in group.split("/") if p]:
        here = here / part
        here.mkdir(exist_ok=True)
        _control_files(here, controllers.split())
    (here / "cgroup.procs").write_text("".join(f"{p}\n" for p in procs))
    return here


def _control_files(directory: Path, controllers: list[str]) -> None:
    (directory / "cgroup.controllers").write_text(" ".join(controllers) + "\n")
    (directory / "cgroup.subtree_control").write_text("\n")
    (directory / "cgroup.type").write_text("domain\n")
    if not (directory / "cgroup.procs").exists():
        (directory / "cgroup.procs").write_text("")
    if "cpuset" in controllers:
        parent = directory.parent
        for name in ("cpus", "mems"):
            (directory / f"cpuset.{name}").write_text("\n")
            (directory / f"cpuset.{name}.effective").write_text((parent / f"cpuset.{name}.effective").read_text())


class FakeV2Ops(CgroupOps):
    def __init__(self, mount: str | Path, deny: tuple[str, ...] = (), refuse_pids: tuple[int, ...] = ()) -> None:
        self.mount = Path(mount)
        self.deny = {os.path.normpath(str(p)) for p in deny}
        self.refuse_pids = set(refuse_pids)  # pids that cannot be moved (another user's, EPERM)
        self.writes: list[tuple[str, str]] = []

    def _procs(self, d: Path) -> list[int]:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()] if (d / "cgroup.procs").exists() else []

    def writable(self, path: str) -> bool:
        return os.path.normpath(path) not in self.deny and os.path.exists(path)

    def mkdir(self, path: str) -> tuple[bool, OSError | None]:
        d = Path(path)
        if os.path.normpath(str(d.parent)) in self.deny:
            return False, PermissionError(errno.EACCES, "Permission denied")
        if d.is_dir():
            return False, None
        d.mkdir()
        _control_files(d, (d.parent / "cgroup.subtree_control").read_text().split())
        return True, None

    def rmdir(self, path: str) -> OSError | None:
        d = Path(path)
        if not d.is_dir():
            return FileNotFoundError(errno.ENOENT, "No such file or directory")
        if self._procs(d) or any(c.is_dir() for c in d.iterdir()):
            return OSError(errno.EBUSY, "Device or resource busy")
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
        return None

    def write(self, path: str, value: str) -> OSError | None:
        self.writes.append((path, value))
        if os.path.normpath(path) in self.deny:
            return PermissionError(errno.EACCES, "Permission denied")
        p = Path(path)
        d = p.parent
        if not p.exists():
            return FileNotFoundError(errno.ENOENT, "No such file or directory")
        if p.name == "cgroup.procs":
            pid = int(value)
            if pid in self.refuse_pids:
                return PermissionError(errno.EPERM, "Operation not permitted")
            root = d == self.mount
            if not root and (d / "cgroup.subtree_control").read_text().split():
                return OSError(errno.EBUSY, "Device or resource busy")
            for other in self.mount.rglob("cgroup.procs"):
                left = [x for x in self._procs(other.parent) if x != pid]
                other.write_text("".join(f"{x}\n" for x in left))
            p.write_text("".join(f"{x}\n" for x in [*self._procs(d), pid]))
            return None
        if p.name == "cgroup.subtree_control":
            enabled = p.read_text().split()
            available = (d / "cgroup.controllers").read_text().split()
            for token in value.split():
                name = token[1:]
                if name not in available:
                    return FileNotFoundError(errno.ENOENT, "No such file or directory")
                if token[0] == "+" and name not in enabled:
                    if d != self.mount and self._procs(d):
                        return OSError(errno.EBUSY, "Device or resource busy")
                    enabled.append(name)
                elif token[0] == "-" and name in enabled:
                    enabled.remove(name)
            p.write_text(" ".join(enabled) + "\n")
            for child in (c for c in d.iterdir() if c.is_dir()):
                (child / "cgroup.controllers").write_text(" ".join(enabled) + "\n")
            return None
        if p.name in ("cpuset.cpus", "cpuset.mems"):
            try:
                wanted = parse_cpulist(value)
            except ValueError:
                return OSError(errno.EINVAL, "Invalid argument")
            parent_eff = parse_cpulist((d.parent / f"{p.name}.effective").read_text().strip())
            if not wanted <= parent_eff:
                return OSError(errno.EINVAL, "Invalid argument")
            p.write_text(format_cpulist(wanted) + "\n")
            (d / f"{p.name}.effective").write_text(format_cpulist(wanted) + "\n")
            return None
        p.write_text(value)
        return None

    def procs(self, group: str | Path) -> list[int]:
        return self._procs(Path(group))


class RecordingLogger:
    """Stands in for the core's logger: keeps (level, message) pairs."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def debug(self, msg: str, *a: object, **kw: object) -> None:
        self.lines.append(("debug", msg))

    def info(self, msg: str, *a: object, **kw: object) -> None:
        self.lines.append(("info", msg))

    def warning(self, msg: str, *a: object, **kw: object) -> None:
        self.lines.append(("warning", msg))

    def error(self, msg: str, *a: object, **kw: object) -> None:
        self.lines.append(("error", msg))


def make_ctx(root: str, environ: dict[str, str] | None = None, *, role: str = "main", local_rank: int | None = 0,
             local_world_size: int | None = 1) -> tuple[object, object, RecordingLogger]:
    """A Subcgroups impl and its ActivationContext on the fake ``root``, without the runtime."""
    import socket

    from loongkit_numa.plugin import plugin
    from loongkit_numa.subcgroups import Subcgroups

    from loongkit_core.context import ActivationContext, Environment
    from loongkit_core.feature import FeatureRecord
    from loongkit_core.hardware import detect
    from loongkit_core.process import ProcessInfo
    from loongkit_core.settings import CoreSettings, load_settings

    env_vars = {"LOONGKIT_SYSFS_ROOT": root, **(environ or {})}
    settings, _ = load_settings(CoreSettings, environ=env_vars)
    process = ProcessInfo(role=role, pid=os.getpid(), host=socket.gethostname(), rank=local_rank,
                          local_rank=local_rank, world_size=local_world_size, local_world_size=local_world_size)
    env = Environment(settings, process, environ=env_vars, hardware_loader=lambda: detect(root))
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == "subcgroups")
    impl = Subcgroups(feature)
    config, _ = impl.configure(env, None)
    logger = RecordingLogger()
    ctx = ActivationContext(FeatureRecord(feature=feature, config=config), env, logger,
                            on_import=lambda module, cb: None)
    return impl, ctx, logger
