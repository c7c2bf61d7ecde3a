"""Loongkit's own log: where it goes (``LOONGKIT_LOGDIR``), how much (``LOONGKIT_LOGLEVEL``), on structlog.

Destination rules (from the product documentation):

* ``stdout`` / ``stderr`` (case-insensitive) -> that stream;
* a path to an existing or creatable directory -> one log file per process in it;
* unset or unusable -> the first usable of ``/var/log/loongkit``, ``/tmp/log/loongkit``, else stderr.

The default directories live in shared, often world-writable places, so a directory is only used
after checks that an attacker cannot win a race against: the path is walked component by component
with ``O_NOFOLLOW`` directory descriptors, directories we create are 0700, the final directory must
be ours, writable, and not world-writable without the sticky bit, and the log file is opened
relative to the verified directory descriptor with ``O_NOFOLLOW`` and checked with ``fstat``.

Records are written with one unbuffered ``os.write`` each: nothing is lost on a crash, a forked
child has no inherited buffer to flush twice, and a failing write (disk full) is dropped silently.

This module never calls ``structlog.configure()``: the user's program may use structlog itself, so
every logger here carries its own processors and writes to its own sink. structlog itself (it imports
asyncio) is imported at the first record at or above the configured level; until then a
record below it is dropped by a stdlib-only no-op, as structlog's own filtering logger would.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import sys
import threading
from collections.abc import Sequence

from loongkit_core.record import Record

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at boot (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    from typing import Any

    from loongkit_core.process import ProcessInfo

DEFAULT_DIRS: tuple[str, ...] = ("/var/log/loongkit", "/tmp/log/loongkit")

STREAMS = ("stdout", "stderr")

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_MODE = 0o640
# Failing to create a default directory for these reasons is the normal case for a non-root user
# (/var/log is root's): not worth a warning on every run.
_QUIET_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


class Destination(Record):
    __slots__ = ("kind", "path", "warnings")

    def __init__(self, kind: str, path: str | None, warnings: list[str] | None = None) -> None:
        self.kind = kind  # "stdout" | "stderr" | "file"
        self.path = path  # the log file's path when kind == "file"
        self.warnings: list[str] = [] if warnings is None else warnings

    @property
    def directory(self) -> str | None:
        return os.path.dirname(self.path) if self.path else None


class _Refused(Exception):
    """A directory or file that must not be used; the message says why."""

    def __init__(self, reason: str, quiet: bool = False) -> None:
        super().__init__(reason)
        self.quiet = quiet


# --------------------------------------------------------------------------------------------------
# Choosing and opening the destination


def log_file_name(process: ProcessInfo) -> str:
    """``loongkit-<host>-rank<RANK>-<pid>.log``, or without the rank part when it is unknown."""
    # A host name never legitimately holds a path separator; keep the name a single component.
    host = re.sub(r"[^A-Za-z0-9._-]", "_", process.host or "") or "unknown"
    rank = f"-rank{process.rank}" if process.rank is not None else ""
    return f"loongkit-{host}{rank}-{process.pid}.log"


def _trusted_owner(uid: int) -> bool:
    return uid in (0, os.geteuid())


def _open_dir(path: str) -> int:
    """Walk ``path`` from ``/`` without following untrusted symlinks; return an fd of the last directory.

    Missing components are created 0700. A symlink is never followed if it is the last component or
    one we created; an existing intermediate symlink is followed only when root or we own it (system
    links such as ``/var/run``; an attacker's link planted in ``/tmp`` is owned by the attacker).
    """
    parts = [p for p in os.path.abspath(path).split(os.sep) if p]
    fd = os.open(os.sep, _DIR_FLAGS)
    try:
        for index, name in enumerate(parts):
            last = index == len(parts) - 1
            created = False
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                    created = True
                except FileExistsError:
                    pass  # another rank created it at the same moment: check it like any other
                except OSError as exc:
                    where = os.sep + os.sep.join(parts[: index + 1])
                    raise _Refused(f"cannot create {where}: {exc.strerror}",
                                   quiet=exc.errno in _QUIET_ERRNOS) from None
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            where = os.sep + os.sep.join(parts[: index + 1])
            flags = _DIR_FLAGS | os.O_NOFOLLOW
            if stat.S_ISLNK(st.st_mode):
                if last or created or not _trusted_owner(st.st_uid):
                    raise _Refused(f"{where} is a symlink")
                flags = _DIR_FLAGS
            elif not stat.S_ISDIR(st.st_mode):
                raise _Refused(f"{where} is not a directory")
            try:
                child = os.open(name, flags, dir_fd=fd)
            except OSError as exc:
                # ELOOP: swapped for a symlink since the lstat; ENOTDIR: swapped for a file.
                raise _Refused(f"cannot open {where}: {exc.strerror}",
                               quiet=exc.errno in _QUIET_ERRNOS) from None
            os.close(fd)
            fd = child
            if created:
                # mkdir's mode went through the umask; make it exactly 0700.
                os.fchmod(fd, 0o700)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _check_dir(fd: int, path: str) -> None:
    """Refuse a directory we do not own, or one anyone can write to without the sticky bit."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise _Refused(f"{path} is owned by uid {st.st_uid}, not by us (uid {os.geteuid()})")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise _Refused(f"{path} is world-writable without the sticky bit")


def _probe_writable(fd: int, path: str) -> None:
    """Create and remove a file: the only check that is right for root and read-only mounts too."""
    name = f".loongkit-probe-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        probe = os.open(name, _FILE_FLAGS | os.O_EXCL, 0o600, dir_fd=fd)
    except OSError as exc:
        raise _Refused(f"{path} is not writable: {exc.strerror}") from None
    os.close(probe)
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=fd)


def _usable_dir(path: str, probe: bool = True) -> int:
    """An fd of ``path`` after every check passed (the caller closes it); raises _Refused."""
    try:
        fd = _open_dir(path)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise _Refused(f"{path} cannot be used: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        _check_dir(fd, path)
        if probe:
            _probe_writable(fd, path)
    except OSError as exc:
        os.close(fd)
        raise _Refused(f"{path} cannot be used: {exc.strerror or exc}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure_private_dir(path: str) -> None:
    """Create ``path`` (0700) where missing and check it as a log directory is checked (no symlinks,
    ours, not world-writable); raises PermissionError with the reason when it must not be used."""
    try:
        os.close(_usable_dir(path, probe=False))
    except _Refused as exc:
        raise PermissionError(str(exc)) from None


def _open_log_file(directory: str, name: str) -> int:
    """Open ``directory/name`` for appending through a verified directory fd; raises _Refused."""
    dir_fd = _usable_dir(directory, probe=False)
    path = os.path.join(directory, name)
    try:
        try:
            fd = os.open(name, _FILE_FLAGS, _FILE_MODE, dir_fd=dir_fd)
        except OSError as exc:
            raise _Refused(f"cannot open {path}: {exc.strerror}") from None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused(f"{path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise _Refused(f"{path} is owned by uid {st.st_uid}, not by us")
        if st.st_nlink != 1:
            # A hard link planted in a sticky shared directory would make us append to its target.
            raise _Refused(f"{path} has {st.st_nlink} hard links")
        if st.st_mode & (stat.S_IWOTH | stat.S_IWGRP):
            # A file left by an earlier process with the same pid: never leave it writable by others.
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~(stat.S_IWOTH | stat.S_IWGRP))
    except BaseException:
        os.close(fd)
        raise
    return fd


def resolve_destination(
    logdir: str | None, process: ProcessInfo, candidates: Sequence[str] = DEFAULT_DIRS
) -> Destination:
    """Choose where this process logs. May create the directory; opens no log file."""
    warnings: list[str] = []
    if logdir is not None and logdir.strip():
        word = logdir.strip().lower()
        if word in STREAMS:
            return Destination(word, None, warnings)
        directory = os.path.abspath(logdir)
        try:
            os.close(_usable_dir(directory))
            return Destination("file", os.path.join(directory, log_file_name(process)), warnings)
        except _Refused as exc:
            warnings.append(f"LOONGKIT_LOGDIR={logdir!r} is not usable ({exc}); "
                            "falling back to the default log directories")
    for candidate in candidates:
        directory = os.path.abspath(candidate)
        try:
            os.close(_usable_dir(directory))
            return Destination("file", os.path.join(directory, log_file_name(process)), warnings)
        except _Refused as exc:
            if not exc.quiet:
                warnings.append(f"log directory {candidate} refused: {exc}")
    tried = ", ".join(candidates) or "none"
    warnings.append(f"no usable log directory (tried {tried}); logging to stderr")
    return Destination("stderr", None, warnings)


# --------------------------------------------------------------------------------------------------
# Output


class _Output:
    """Where rendered records go: a stream looked up at write time, or a raw file descriptor."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kind: str | None = None  # None: not configured, drop everything
        self.fd: int | None = None
        self.path: str | None = None

    def write(self, text: str) -> None:
        # Never raise into the user's program: a full disk or a closed pipe only loses log lines.
        try:
            with self.lock:
                if self.kind == "file" and self.fd is None and self.path is not None:
                    text = self._open_pending() + text
                if self.kind == "file":
                    if self.fd is not None:
                        data = text.encode("utf-8", "backslashreplace")
                        while data:
                            data = data[os.write(self.fd, data):]
                elif self.kind in STREAMS:
                    stream = getattr(sys, self.kind)
                    if stream is not None:
                        stream.write(text)
                        stream.flush()
        except Exception:
            pass

    def _open_pending(self) -> str:
        """Open the log file at the first record, so a process that logs nothing (most DataLoader
        workers) leaves no empty file. On failure switch to stderr; returns a line saying so."""
        assert self.path is not None
        try:
            self.fd = _open_log_file(os.path.dirname(self.path), os.path.basename(self.path))
            return ""
        except (_Refused, OSError) as exc:
            self.kind, self.path = "stderr", None
            return f"loongkit: cannot log to a file ({exc}); logging to stderr\n"

    def close(self) -> None:
        with self.lock:
            if self.fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self.fd)
            self.kind = None
            self.fd = None
            self.path = None


class _Sink:
    """The structlog 'wrapped logger': every level method writes one line to the output."""

    def msg(self, message: str) -> None:
        _output.write(message + "\n")

    debug = info = warning = warn = error = exception = critical = fatal = log = msg


class _State:
    def __init__(self) -> None:
        self.generation = 0  # bumped on every (re)configuration; proxies rebuild when it changes
        self.wrapper: type[Any] = _NullBoundLogger
        self.processors: list[Any] = []
        self.process: ProcessInfo | None = None
        self.min_level = _LEVELS["warning"]
        self.structlog_class: type[Any] | None = None  # the real bound logger, built at the first record


class _NullBoundLogger:
    """Before configure() and after shutdown(): every method drops its record at once."""

    def __init__(self, logger: Any, processors: Any, context: Any) -> None:
        pass

    def _nop(self, *args: Any, **kw: Any) -> None:
        return None

    async def _anop(self, *args: Any, **kw: Any) -> None:
        return None

    debug = info = warning = warn = error = exception = critical = fatal = msg = log = _nop
    adebug = ainfo = awarning = awarn = aerror = aexception = acritical = afatal = amsg = alog = _anop


# The level of each of structlog's filtering logger's methods.
_METHOD_LEVELS = {"debug": 10, "info": 20, "msg": 20, "warning": 30, "warn": 30, "error": 40, "exception": 40,
                  "critical": 50, "fatal": 50}
_lazy_classes: dict[int, type[Any]] = {}


def _nop(self: Any, *args: Any, **kw: Any) -> None:
    return None


def _lazy_class(min_level: int) -> type[Any]:
    """A bound logger that drops records below ``min_level`` with a bare ``return None`` (like
    structlog's filtering logger) and hands the others to the structlog logger it builds then."""
    found = _lazy_classes.get(min_level)
    if found is not None:
        return found

    def forward(name: str) -> Any:
        def method(self: Any, event: Any = None, *args: Any, **kw: Any) -> Any:
            return getattr(self._real(), name)(event, *args, **kw)

        method.__name__ = name
        return method

    def log(self: Any, level: int, event: Any = None, *args: Any, **kw: Any) -> Any:
        if level < min_level:
            return None
        return self._real().log(level, event, *args, **kw)

    def _real(self: Any) -> Any:
        if self._structlog is None:
            self._structlog = _structlog_logger(self._logger, self._context)
        return self._structlog

    def __getattr__(self: Any, name: str) -> Any:  # async variants and the rest of structlog's API
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._real(), name)

    def __init__(self: Any, logger: Any, processors: Any, context: Any) -> None:
        self._logger, self._context, self._structlog = logger, context, None

    namespace: dict[str, Any] = {
        "__slots__": ("_logger", "_context", "_structlog"), "__init__": __init__, "_real": _real, "log": log,
        "__getattr__": __getattr__,
        "is_enabled_for": lambda self, level: level >= min_level,
        "get_effective_level": lambda self: min_level,
    }
    for name, level in _METHOD_LEVELS.items():
        namespace[name] = forward(name) if level >= min_level else _nop
    cls = _lazy_classes[min_level] = type(f"_LazyBoundLogger{min_level}", (), namespace)
    return cls


def _structlog_logger(logger: Any, context: dict[str, Any]) -> Any:
    """The real structlog bound logger for the current configuration (imports structlog once)."""
    if _state.structlog_class is None:
        _state.structlog_class = _safe_class(_state.min_level)
        _state.processors = _processors()
    return _state.structlog_class(logger, _state.processors, context)


def _safe_class(min_level: int) -> type[Any]:
    import structlog

    base = structlog.make_filtering_bound_logger(min_level)

    class _SafeBoundLogger(base):  # type: ignore[valid-type,misc]
        # A processor failing (an unprintable value) must not raise into the user's program.
        def _proxy_to_logger(self, method_name: str, event: str | None = None, **event_kw: Any) -> Any:
            try:
                return super()._proxy_to_logger(method_name, event, **event_kw)
            except Exception:
                return None

    return _SafeBoundLogger


_output = _Output()
_sink = _Sink()
_state = _State()


def _after_fork_in_child() -> None:
    # Another thread may have held the lock at fork time; the child's copy would stay locked forever.
    _output.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _add_process(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    # Read at log time: a forked child (role changed by mark_forked_child) reports its own pid/role.
    process = _state.process
    event_dict.setdefault("pid", os.getpid())
    if process is not None:
        event_dict.setdefault("role", process.role)
        if process.rank is not None:
            event_dict.setdefault("rank", process.rank)
    return event_dict


_KEY_ORDER = ["timestamp", "level", "logger", "pid", "role", "rank", "event"]


def _make_renderer() -> Any:
    import structlog

    logfmt = structlog.processors.LogfmtRenderer(key_order=_KEY_ORDER, drop_missing=True,
                                                 bool_as_flag=False)

    def render(logger: Any, method: str, event_dict: dict[str, Any]) -> str:
        try:
            return str(logfmt(logger, method, event_dict))
        except Exception:
            # e.g. a key with a space in it: still log something readable.
            return " ".join(f"{k}={v!r}" for k, v in event_dict.items())

    return render


def _processors() -> list[Any]:
    import structlog

    return [
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.add_log_level,
        _add_process,
        structlog.processors.format_exc_info,
        _make_renderer(),
    ]


class _LoggerProxy:
    """What get_logger() returns: resolves to the current configuration at each use.

    Loggers are typically created at import time, before configure(); they drop everything until
    then, and follow a reconfiguration without being fetched again.
    """

    __slots__ = ("_bound", "_context", "_generation")

    def __init__(self, context: dict[str, Any]) -> None:
        self._context = context
        self._generation = -1
        self._bound: Any = None

    def _current(self) -> Any:
        if self._generation != _state.generation:
            self._bound = _state.wrapper(_sink, _state.processors, dict(self._context))
            self._generation = _state.generation
        return self._bound

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            # copy/pickle probe dunders on a half-built instance: never recurse into _current().
            raise AttributeError(name)
        return getattr(self._current(), name)

    def bind(self, **values: Any) -> _LoggerProxy:
        return _LoggerProxy({**self._context, **values})

    def new(self, **values: Any) -> _LoggerProxy:
        return _LoggerProxy({"logger": self._context.get("logger", "loongkit"), **values})

    def unbind(self, *keys: str) -> _LoggerProxy:
        missing = [k for k in keys if k not in self._context]
        if missing:
            raise KeyError(missing[0])
        return self.try_unbind(*keys)

    def try_unbind(self, *keys: str) -> _LoggerProxy:
        return _LoggerProxy({k: v for k, v in self._context.items() if k not in keys})

    def __repr__(self) -> str:
        return f"<loongkit logger {self._context!r}>"


# --------------------------------------------------------------------------------------------------
# Public API


def get_logger(name: str = "loongkit", **bind: Any) -> Any:
    """A structlog bound logger with ``logger=name``; drops everything until configure()."""
    return _LoggerProxy({"logger": name, **bind})


def _activate(destination: Destination, process: ProcessInfo) -> Destination:
    """Point the output at the destination. A new log file is created at its first record (no empty
    files); an existing one, or anything else at its name, is opened and checked now."""
    fd: int | None = None
    if destination.kind == "file" and destination.path and os.path.lexists(destination.path):
        try:
            fd = _open_log_file(os.path.dirname(destination.path), os.path.basename(destination.path))
        except (_Refused, OSError) as exc:
            destination = Destination("stderr", None,
                                      [*destination.warnings, f"cannot log to a file ({exc}); "
                                                              "logging to stderr"])
    with _output.lock:
        old = _output.fd
        _output.kind = destination.kind
        _output.fd = fd
        _output.path = destination.path if destination.kind == "file" else None
    if old is not None and old != fd:
        with contextlib.suppress(OSError):
            os.close(old)
    _state.process = process
    return destination


def configure(
    level: str, logdir: str | None, process: ProcessInfo, candidates: Sequence[str] = DEFAULT_DIRS
) -> Destination:
    """Set up loongkit's logging; a second call reconfigures (the old file is closed)."""
    destination = resolve_destination(logdir, process, candidates)
    destination = _activate(destination, process)
    _state.min_level = _LEVELS.get(level.strip().lower(), _LEVELS["warning"])
    _state.wrapper = _lazy_class(_state.min_level)
    _state.structlog_class = None  # built for this level at the first record that passes it
    _state.processors = []
    _state.generation += 1
    logger = get_logger("loongkit.log")
    for warning in destination.warnings:
        logger.warning(warning)
    return destination


def write_block(text: str) -> None:
    """Write ``text`` (the Feature Summary) to the log destination verbatim, whatever the level."""
    if _output.kind is None:
        return
    _output.write(text if text.endswith("\n") else text + "\n")


def after_fork(process: ProcessInfo) -> None:
    """In a forked child (a DataLoader worker): go on appending to the parent's log, the file the job's
    Summary names, with this process's pid and role on every record.

    The file is opened with O_APPEND and every record is one ``os.write`` of whole lines, so the
    parent's and its workers' records never overwrite each other; records are written unbuffered, so
    no inherited buffer is written twice. A parent that had logged nothing yet has no descriptor: the
    child opens the same file at its first record. (Spawned workers are new interpreters and log to
    their own file, named by their pid, in the same directory.)
    """
    _after_fork_in_child()
    if _output.kind is not None:
        _state.process = process


def log_path() -> str | None:
    """The current log file, when logging to a file."""
    return _output.path if _output.kind == "file" else None


def destination_kind() -> str | None:
    """Where records go now: "file", "stdout" or "stderr"; None before configure() and after shutdown()
    (e.g. a plugin that prints a line itself unless :func:`write_block` already put it on stdout)."""
    return _output.kind


def shutdown() -> None:
    """Close the log file; later records are dropped (as before configure())."""
    _output.close()
    _state.wrapper = _NullBoundLogger
    _state.structlog_class = None
    _state.processors = []
    _state.process = None
    _state.generation += 1
