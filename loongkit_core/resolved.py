"""One resolution per job: what a full boot decided, written once and reused by the job's other processes.

A full boot (core settings, the entry-point scan, declarations, hardware policies, requirements, each
enabled feature's ``detect`` and ``configure``) costs a few hundred milliseconds, and a job runs it in
every process: each torchrun rank, every spawn/forkserver DataLoader worker (each epoch unless
persistent), every helper under a container-wide ``PYTHONPATH``. The first process that boots in full
writes what it resolved here; the job's later processes read it and boot in milliseconds:

* a DataLoader worker (spawn/forkserver) uses its main process's resolution, named in
  ``_LOONGKIT_RESOLVED`` (set by the main for its children), when its LOONGKIT_* variables are the
  ones it was resolved under: a worker serves its main, whatever else differs in its environment;
* any other process (a torchrun rank, another worker, the same command run again) looks the node's
  resolutions up by a key of what resolution depends on, and finds the first one written.

A process that reuses a resolution arms the features recorded as armed, replays the boot's warnings
and faults in their order (its log and Summary say what a full boot would), and imports a plugin only
when one of that plugin's features activates; that feature's ``detect`` and ``configure`` run then, in
this process, before its ``activate`` (what they leave on the implementation object is there, and a
feature that turns out not to apply here says so).

Key: this format, the Python (version, executable, prefix, ``sys.path``), the LOONGKIT_* variables,
the role (main / subprocess / worker; ranks share), the user, the host and its boot, this process's
CPU affinity and cgroup. Valid while: every non-LOONGKIT variable a plugin read through
``env.environ`` while resolving has the value it had then (a whole-environment scan is not a read);
every ``sys.path`` directory (pip install and uninstall change a site-packages directory) and every
non-stdlib module file imported while resolving (an edited editable plugin) has its recorded mtime and
size. Not used under a fake ``LOONGKIT_SYSFS_ROOT`` (tests and dry runs rewrite files under a fixed
root), by a :class:`~loongkit_core.runtime.Runtime` built directly (the CLI, tests), or with
``LOONGKIT_RESOLVE_ONCE=0`` (every process resolves in full).

Files: ``<channel root>/resolved/<key>.bin`` (marshal, this Python's own format; in the per-user 0700
directory of :mod:`loongkit_core.activity`, on tmpfs where there is one, so a reboot clears it), the
newest :data:`KEEP` kept. Stdlib only.
"""

from __future__ import annotations

import marshal
import os
import sys
from collections.abc import Iterator, Mapping

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at boot (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    from typing import Any

    from loongkit_core.feature import FeatureRecord, PolicyDecision
    from loongkit_core.hardware import Hardware
    from loongkit_core.manager import Fault
    from loongkit_core.process import ProcessInfo
    from loongkit_core.runtime import Runtime

    Data = dict[str, Any]

FORMAT = 1
ENV = "_LOONGKIT_RESOLVED"  # a main process's resolution file, for its DataLoader workers
SWITCH = "LOONGKIT_RESOLVE_ONCE"  # 0: every process resolves in full
KEEP = 64  # resolution files kept per node (the newest)
VARIANTS = 8  # resolutions kept per key: processes whose plugins read different values of a variable
# Key parts a DataLoader worker must share with its main to use the main's resolution.
_INHERITED = ("format", "python", "env", "user", "host")


# --------------------------------------------------------------------------------------------------
# Key and validity


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether this process may reuse or write a resolution (see the module docstring)."""
    from loongkit_core._boot import bool_or_none

    if bool_or_none(environ.get(SWITCH))[0] is False:
        return False
    root = environ.get("LOONGKIT_SYSFS_ROOT", "").strip()
    return not root or os.path.realpath(root) == "/"


def _text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(1 << 16)
    except OSError:
        return ""


def material(environ: Mapping[str, str], process: ProcessInfo) -> dict[str, object]:
    """What a resolution depends on, besides the files and variables checked by :func:`_still_valid`."""
    try:
        cpus: tuple[int, ...] = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cpus = ()
    return {
        "format": FORMAT,
        "python": (sys.version, sys.executable, sys.prefix),
        "path": tuple(sys.path),
        "env": tuple(sorted((k, v) for k, v in environ.items() if k.startswith("LOONGKIT_"))),
        "role": process.role,
        "user": os.geteuid(),
        "host": (os.uname().nodename, _text("/proc/sys/kernel/random/boot_id").strip()),
        "cpus": cpus,
        "cgroup": _text("/proc/self/cgroup"),
    }


def _file_name(key: Mapping[str, object]) -> str:
    import zlib

    text = repr(sorted(key.items())).encode("utf-8", "backslashreplace")
    return f"{zlib.crc32(text):08x}{zlib.adler32(text):08x}.bin"


def _stat(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return -1, -1
    return st.st_mtime_ns, st.st_size


def _still_valid(data: Data, environ: Mapping[str, str], *, reads: bool = True) -> bool:
    if reads:
        for name, value in data["reads"].items():
            if environ.get(name) != value:
                return False
    return all(_stat(path) == (mtime, size) for path, mtime, size in data["stats"])


def _stdlib_dirs() -> tuple[str, ...]:
    return tuple({os.path.dirname(os.__file__) + os.sep, os.path.dirname(os.path.dirname(os.__file__)) + os.sep})


def _depends_on(modules: Iterator[str]) -> list[tuple[str, int, int]]:
    """(path, mtime_ns, size) of each sys.path entry and of each non-stdlib module file in ``modules``."""
    stdlib = _stdlib_dirs()
    paths: dict[str, None] = {p or os.getcwd(): None for p in sys.path}
    for name in modules:
        file = getattr(sys.modules.get(name), "__file__", None)
        if not isinstance(file, str):
            continue
        third_party = "site-packages" in file or "dist-packages" in file
        if third_party or not file.startswith(stdlib):
            paths[file] = None
    return [(path, *_stat(path)) for path in paths]


# --------------------------------------------------------------------------------------------------
# Where


def directory() -> str | None:
    """``<channel root>/resolved``, created 0700 and checked like a log directory; None if unusable."""
    from loongkit_core import activity, log

    root = activity.channel_root()
    if root is None:
        return None
    path = os.path.join(root, "resolved")
    try:
        log.ensure_private_dir(path)
    except OSError:
        return None
    return path


def _read(path: str) -> Data | None:
    """A resolution file of ours (no symlink, owned by us, writable by nobody else), or None: its
    ``variants``, resolutions under one key, newest first."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022 or st.st_size > 16 << 20:
            return None
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        data = marshal.loads(b"".join(chunks))
    except (OSError, ValueError, EOFError, TypeError):
        return None
    finally:
        os.close(fd)
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("variants"), list):
        return None
    return data


def load(environ: Mapping[str, str], process: ProcessInfo, key: Mapping[str, object]) -> Data | None:
    """The resolution this process may reuse (its main's for a DataLoader worker, else the node's by
    ``key``), or None: then it boots in full."""
    if process.role == "worker":
        handed, _, pid = environ.get(ENV, "").rpartition(":")
        found = _read(handed) if os.path.isabs(handed) else None
        for data in (found or {}).get("variants", ()):
            if str(data["pid"]) == pid and all(data["key"].get(part) == key.get(part) for part in _INHERITED) \
                    and _still_valid(data, environ, reads=False):
                data["path"] = handed
                return data
    where = directory()
    if where is None:
        return None
    path = os.path.join(where, _file_name(key))
    for data in (_read(path) or {}).get("variants", ()):
        if data["key"] == dict(key) and _still_valid(data, environ):
            data["path"] = path
            return data
    return None


def handoff(data: Data) -> str:
    """``_LOONGKIT_RESOLVED`` for this process's DataLoader workers: the file, and which of its variants."""
    return f"{data['path']}:{data['pid']}"


def store(runtime: Runtime, key: Mapping[str, object], reads: Mapping[str, str | None],
          modules: Iterator[str]) -> Data | None:
    """Write what ``runtime`` (booted in full) resolved, as the newest variant of its key's file (the
    others kept unless stale or read the same values); it, or None when it cannot be kept (a value
    marshal cannot write, no usable directory)."""
    where = directory()
    if where is None:
        return None
    path = os.path.join(where, _file_name(key))
    data = capture(runtime, key, reads, _depends_on(modules))
    others = [v for v in (_read(path) or {}).get("variants", ())
              if v.get("reads") != data["reads"] and v.get("key") == data["key"] and _still_valid(v, {}, reads=False)]
    try:
        payload = marshal.dumps({"format": FORMAT, "variants": [data, *others][:VARIANTS]})
    except (ValueError, TypeError):  # e.g. a policy's option default of a plugin's own type
        return None
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return None
    _prune(where)
    data["path"] = path
    return data


def _prune(where: str) -> None:
    try:
        entries = [(os.stat(os.path.join(where, n)).st_mtime_ns, n) for n in os.listdir(where) if n.endswith(".bin")]
    except OSError:
        return
    for _, name in sorted(entries, reverse=True)[KEEP:]:
        try:
            os.unlink(os.path.join(where, name))
        except OSError:
            pass


# --------------------------------------------------------------------------------------------------
# What is kept, and getting it back


class RecordingEnviron(Mapping[str, str]):
    """``env.environ`` while resolving: notes each non-LOONGKIT variable read by name (LOONGKIT_* ones
    are in the key); iterating (``load_settings`` scans for its prefix) is not a read."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ
        self.reads: dict[str, str | None] = {}

    def _note(self, name: object) -> None:
        if isinstance(name, str) and not name.startswith("LOONGKIT_"):
            self.reads[name] = self._environ.get(name)

    def __getitem__(self, name: str) -> str:
        self._note(name)
        return self._environ[name]

    def get(self, name: str, default: Any = None) -> Any:
        self._note(name)
        return self._environ.get(name, default)

    def __contains__(self, name: object) -> bool:
        self._note(name)
        return name in self._environ

    def __iter__(self) -> Iterator[str]:
        return iter(self._environ)

    def __len__(self) -> int:
        return len(self._environ)

    def keys(self) -> Any:
        return self._environ.keys()

    def items(self) -> Any:
        return self._environ.items()

    def values(self) -> Any:
        return self._environ.values()


def capture(runtime: Runtime, key: Mapping[str, object], reads: Mapping[str, str | None],
            stats: list[tuple[str, int, int]]) -> Data:
    """The resolution of a runtime booted in full (before anything is armed), as marshal-able data."""
    manager = runtime.manager
    records = []
    for record in runtime.records.values():
        f = record.feature
        records.append((
            {"name": f.name, "env": f.env, "level": f.level, "category": f.category.value,
             "description": f.description, "requires": f.requires, "targets": f.targets, "options": f.options,
             "depends_on": f.depends_on, "disables": f.disables, "implemented": f.implemented, "plugin": f.plugin,
             "plugin_version": f.plugin_version},
            {"state": record.state.value, "reason": record.reason, "explicit": record.explicit,
             "enabled": record.enabled, "config": record.to_json()["config"], "policy": record.policy},
        ))
    hardware = getattr(runtime.env, "_hardware", None)  # only when a policy or detect looked
    return {
        "format": FORMAT,
        "key": dict(key),
        "reads": dict(reads),
        "stats": stats,
        "pid": os.getpid(),
        "settings": runtime.settings.model_dump(),
        "events": list(runtime.boot_events),
        "entry_points": dict(manager.entry_points),
        "disabled": dict(manager.disabled),
        "disabled_unmatched": list(manager.disabled_unmatched),
        "installed": list(manager.installed),
        "records": records,
        "policies": {name: (p.reason, p.enabled_by_default, dict(p.option_defaults))
                     for name, p in runtime.policies.items()},
        "hardware": _encode(hardware) if hardware is not None else None,
    }


class SettingsSnapshot:
    """The core settings a full boot validated (``CoreSettings``' fields), without pydantic."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = dict(values)
        for name, value in self._values.items():
            setattr(self, name, value)

    def model_dump(self) -> dict[str, Any]:
        return dict(self._values)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"core setting {name!r} is not in the reused resolution")


def records(data: Data) -> dict[str, FeatureRecord]:
    from loongkit_core.feature import Category, Feature, FeatureRecord, State

    out: dict[str, FeatureRecord] = {}
    for fields, state in data["records"]:
        feature = Feature(**{**fields, "category": Category(fields["category"])})
        record = FeatureRecord(feature, state=State(state["state"]), reason=state["reason"],
                               explicit=state["explicit"], enabled=state["enabled"], config=state["config"],
                               policy=state["policy"])
        out[feature.name] = record
    return out


def policies(data: Data) -> dict[str, PolicyDecision]:
    from loongkit_core.feature import PolicyDecision

    return {name: PolicyDecision(reason, enabled, dict(defaults))
            for name, (reason, enabled, defaults) in data["policies"].items()}


def fault(values: tuple[str, str, str, str, str | None]) -> Fault:
    from loongkit_core.manager import Fault

    return Fault(*values)


def hardware_loader(data: Data) -> Any:
    """A loader for ``Environment`` returning the resolution's hardware facts, or None when the full
    boot never read them (then this process reads them itself, if a feature looks)."""
    encoded = data.get("hardware")
    if encoded is None:
        return None

    def load() -> Hardware:
        return _decode(encoded)

    return load


def _encode(value: Any) -> Any:
    """Hardware's frozen dataclasses as marshal-able data (frozensets and tuples stay)."""
    fields = getattr(type(value), "__dataclass_fields__", None)
    if fields is not None:
        return {"\0class": type(value).__name__, **{name: _encode(getattr(value, name)) for name in fields}}
    if isinstance(value, tuple):
        return tuple(_encode(v) for v in value)
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "\0class" in value:
        from loongkit_core import hardware

        cls = getattr(hardware, value["\0class"])
        return cls(**{k: _decode(v) for k, v in value.items() if k != "\0class"})
    if isinstance(value, tuple):
        return tuple(_decode(v) for v in value)
    return value
