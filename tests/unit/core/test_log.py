"""loongkit_core.log: LOONGKIT_LOGDIR resolution, directory/file safety, levels, fork, failure modes."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from loongkit_core import log
from loongkit_core.process import ProcessInfo

IS_ROOT = os.geteuid() == 0
OTHER_UID = 12345


def proc(rank: int | None = 0, pid: int | None = None, host: str = "node-1") -> ProcessInfo:
    return ProcessInfo(role="main", pid=os.getpid() if pid is None else pid, host=host, rank=rank,
                       local_rank=rank, world_size=None if rank is None else 8,
                       local_world_size=None if rank is None else 8)


@pytest.fixture(autouse=True)
def _clean_logging() -> Iterator[None]:
    log.shutdown()
    yield
    log.shutdown()


@pytest.fixture
def umask0() -> Iterator[None]:
    # The most permissive umask: modes must come out right without its help.
    old = os.umask(0)
    yield
    os.umask(old)


def read(path: str | None) -> str:
    assert path is not None
    return Path(path).read_text()


def name_for(process: ProcessInfo) -> str:
    return f"loongkit-{process.host}-rank{process.rank}-{process.pid}.log"


# --- choosing the destination ------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "kind"), [("stdout", "stdout"), ("STDOUT", "stdout"),
                                             ("stderr", "stderr"), (" StdErr ", "stderr")])
def test_stream_keywords_case_insensitive(tmp_path: Path, value: str, kind: str) -> None:
    dest = log.resolve_destination(value, proc(), candidates=[str(tmp_path / "c")])
    assert (dest.kind, dest.path, dest.warnings) == (kind, None, [])
    assert not (tmp_path / "c").exists()  # a stream needs no directory


def test_existing_directory(tmp_path: Path) -> None:
    process = proc(rank=3)
    dest = log.resolve_destination(str(tmp_path), process, candidates=[])
    assert dest.kind == "file"
    assert dest.path == str(tmp_path / name_for(process))
    assert dest.directory == str(tmp_path)
    assert dest.warnings == []
    assert os.listdir(tmp_path) == []  # the usability probe leaves nothing behind, no log file yet


def test_relative_directory_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    dest = log.resolve_destination("logs", proc(), candidates=[])
    assert dest.directory == str(tmp_path / "logs")


def test_creatable_nested_directory_gets_0700(tmp_path: Path, umask0: None) -> None:
    target = tmp_path / "a" / "b" / "c"
    dest = log.resolve_destination(str(target), proc(), candidates=[])
    assert dest.kind == "file" and dest.directory == str(target)
    for created in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert stat.S_IMODE(os.lstat(created).st_mode) == 0o700, created


@pytest.mark.parametrize("unset", [None, "", "   "])
def test_unset_uses_first_candidate(tmp_path: Path, unset: str | None) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    dest = log.resolve_destination(unset, proc(), candidates=[str(first), str(second)])
    assert dest.directory == str(first)
    assert dest.warnings == []
    assert not second.exists()


def test_default_candidates_are_the_documented_ones() -> None:
    assert log.DEFAULT_DIRS == ("/var/log/loongkit", "/tmp/log/loongkit")


def test_unusable_first_candidate_falls_to_second(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    second = tmp_path / "second"
    dest = log.resolve_destination(None, proc(), candidates=[str(blocker / "loongkit"), str(second)])
    assert dest.directory == str(second)
    assert len(dest.warnings) == 1 and "not a directory" in dest.warnings[0]


def test_all_unusable_falls_back_to_stderr(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    dest = log.resolve_destination(str(blocker), proc(), candidates=[str(blocker / "a"), str(blocker)])
    assert (dest.kind, dest.path) == ("stderr", None)
    assert "LOONGKIT_LOGDIR" in dest.warnings[0]
    assert "logging to stderr" in dest.warnings[-1]


def test_logdir_regular_file_falls_back_with_warning(tmp_path: Path) -> None:
    regular = tmp_path / "file.txt"
    regular.write_text("keep me")
    fallback = tmp_path / "fallback"
    dest = log.resolve_destination(str(regular), proc(), candidates=[str(fallback)])
    assert dest.directory == str(fallback)
    assert len(dest.warnings) == 1
    assert "LOONGKIT_LOGDIR" in dest.warnings[0] and "not a directory" in dest.warnings[0]
    assert regular.read_text() == "keep me"


def test_dev_full_as_logdir_is_refused(tmp_path: Path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    dest = log.resolve_destination("/dev/full", proc(), candidates=[str(tmp_path)])
    assert dest.directory == str(tmp_path)
    assert "not a directory" in dest.warnings[0]


# --- directory safety ---------------------------------------------------------------------------------


@pytest.fixture
def shared_tmp(tmp_path: Path) -> Path:
    """A /tmp-like directory: world-writable with the sticky bit."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    return shared


def test_symlinked_directory_refused(tmp_path: Path, shared_tmp: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    planted = shared_tmp / "loongkit"
    planted.symlink_to(victim)  # an attacker pre-creates the well-known name
    fallback = tmp_path / "fallback"
    dest = log.resolve_destination(None, proc(), candidates=[str(planted), str(fallback)])
    assert dest.directory == str(fallback)
    assert "symlink" in dest.warnings[0]
    # configure() with the symlink as LOGDIR never writes through it either.
    log.configure("debug", str(planted), proc(), candidates=[str(fallback)])
    log.get_logger().warning("hello")
    assert os.listdir(victim) == []
    assert log.log_path() is not None and log.log_path().startswith(str(fallback))


@pytest.mark.skipif(not IS_ROOT, reason="needs root to plant a symlink owned by another uid")
def test_foreign_symlink_in_a_parent_component_refused(tmp_path: Path, shared_tmp: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    planted = shared_tmp / "log"
    planted.symlink_to(victim)
    os.lchown(planted, OTHER_UID, OTHER_UID)  # what a non-root attacker's link looks like
    dest = log.resolve_destination(str(planted / "loongkit"), proc(), candidates=[])
    assert dest.kind == "stderr"
    assert "symlink" in dest.warnings[0]
    assert os.listdir(victim) == []  # nothing was created through the link


def test_own_symlink_in_a_parent_component_is_followed(tmp_path: Path) -> None:
    # System links such as /var/run -> /run are owned by root (or by us): those are trusted.
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    dest = log.resolve_destination(str(tmp_path / "link" / "loongkit"), proc(), candidates=[])
    assert dest.kind == "file"
    assert (real / "loongkit").is_dir()


def test_directory_owned_by_another_user_refused(tmp_path: Path) -> None:
    if IS_ROOT:
        foreign = tmp_path / "foreign"
        foreign.mkdir()
        os.chown(foreign, OTHER_UID, OTHER_UID)
    else:
        foreign = Path("/")  # owned by root, which we are not
    fallback = tmp_path / "fallback"
    dest = log.resolve_destination(str(foreign), proc(), candidates=[str(fallback)])
    assert dest.directory == str(fallback)
    assert "owned by uid" in dest.warnings[0]


def test_world_writable_directory_refused_unless_sticky(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    fallback = tmp_path / "fallback"
    dest = log.resolve_destination(str(open_dir), proc(), candidates=[str(fallback)])
    assert dest.directory == str(fallback)
    assert "world-writable" in dest.warnings[0]

    open_dir.chmod(0o1777)
    dest = log.resolve_destination(str(open_dir), proc(), candidates=[str(fallback)])
    assert dest.directory == str(open_dir) and dest.warnings == []


def _can_create_in(directory: Path) -> bool:
    try:
        (directory / "ground-truth").touch()
    except PermissionError:
        return False
    (directory / "ground-truth").unlink()
    return True


def test_read_only_directory(tmp_path: Path) -> None:
    # The check is a real probe file, not the permission bits: root with CAP_DAC_OVERRIDE really can
    # write to a 0500 directory (so it is used), anyone else really cannot (so it is refused).
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    fallback = tmp_path / "fallback"
    try:
        writable = _can_create_in(read_only)
        dest = log.resolve_destination(str(read_only), proc(), candidates=[str(fallback)])
    finally:
        read_only.chmod(0o700)
    if writable:
        assert IS_ROOT
        assert dest.directory == str(read_only)
    else:
        assert dest.directory == str(fallback)
        assert "not writable" in dest.warnings[0]
    assert os.listdir(read_only) == []


def test_unwritable_directory_refused_even_for_root(tmp_path: Path) -> None:
    # /proc is root's, not world-writable, and no one can create a file in it.
    if not os.path.isdir("/proc/self"):
        pytest.skip("no procfs")
    fallback = tmp_path / "fallback"
    dest = log.resolve_destination("/proc", proc(), candidates=[str(fallback)])
    assert dest.directory == str(fallback)
    assert "not writable" in dest.warnings[0] or "owned by uid" in dest.warnings[0]


# --- files ----------------------------------------------------------------------------------------------


def test_file_name_has_host_rank_pid(tmp_path: Path) -> None:
    dest = log.resolve_destination(str(tmp_path), proc(rank=5, pid=4242, host="gpu-7"), candidates=[])
    assert os.path.basename(dest.path or "") == "loongkit-gpu-7-rank5-4242.log"
    dest = log.resolve_destination(str(tmp_path), proc(rank=None, pid=4242, host="gpu-7"), candidates=[])
    assert os.path.basename(dest.path or "") == "loongkit-gpu-7-4242.log"
    # A host name can never smuggle a path separator into the file name.
    dest = log.resolve_destination(str(tmp_path), proc(rank=0, pid=1, host="../evil"), candidates=[])
    assert os.path.dirname(dest.path or "") == str(tmp_path)


def test_configure_writes_file_without_world_bits(tmp_path: Path, umask0: None) -> None:
    process = proc(rank=2)
    dest = log.configure("info", str(tmp_path), process, candidates=[])
    assert dest.kind == "file" and log.log_path() == dest.path == str(tmp_path / name_for(process))
    log.get_logger("loongkit.test").info("hello world", answer=42)
    mode = os.stat(dest.path).st_mode
    assert stat.S_ISREG(mode)
    assert stat.S_IMODE(mode) & 0o007 == 0
    assert stat.S_IMODE(mode) == 0o640
    line = read(dest.path).strip()
    assert line.startswith("timestamp=")
    assert "level=info" in line and "logger=loongkit.test" in line
    assert f"pid={os.getpid()}" in line and "role=main" in line and "rank=2" in line
    assert 'event="hello world"' in line and "answer=42" in line
    assert "\x1b[" not in line  # no colours


def test_existing_world_writable_log_file_is_tightened(tmp_path: Path, umask0: None) -> None:
    process = proc()
    stale = tmp_path / name_for(process)
    stale.write_text("old\n")
    stale.chmod(0o666)
    log.configure("info", str(tmp_path), process, candidates=[])
    log.get_logger().info("new")  # the file is opened (and tightened) at its first record
    assert stat.S_IMODE(os.stat(stale).st_mode) & 0o022 == 0
    assert read(str(stale)).startswith("old\n")  # appended, not truncated


def test_log_file_is_created_only_when_something_is_written(tmp_path: Path) -> None:
    process = proc()
    dest = log.configure("warning", str(tmp_path), process, candidates=[])
    assert dest.kind == "file" and dest.path is not None
    log.get_logger().info("below the level")  # dropped: nothing to write
    assert not os.path.exists(dest.path)
    log.get_logger().warning("now")
    assert "now" in read(dest.path)


def test_symlink_at_log_file_name_refused(tmp_path: Path) -> None:
    process = proc()
    target = tmp_path / "target"
    target.write_text("precious\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / name_for(process)).symlink_to(target)
    dest = log.configure("info", str(logs), process, candidates=[])
    assert dest.kind == "stderr" and log.log_path() is None
    assert any("cannot log to a file" in w for w in dest.warnings)
    log.get_logger().error("boom")
    assert target.read_text() == "precious\n"


@pytest.mark.skipif(not IS_ROOT, reason="needs root to plant a file owned by another uid")
def test_log_file_owned_by_another_user_refused(tmp_path: Path) -> None:
    process = proc()
    planted = tmp_path / name_for(process)
    planted.write_text("")
    planted.chmod(0o666)  # openable by us whatever our capabilities: fstat's owner check must refuse it
    os.chown(planted, OTHER_UID, OTHER_UID)
    dest = log.configure("info", str(tmp_path), process, candidates=[])
    assert dest.kind == "stderr"
    assert any("owned by uid" in w for w in dest.warnings)


def test_hard_linked_log_file_refused(tmp_path: Path) -> None:
    process = proc()
    target = tmp_path / "target"
    target.write_text("precious\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    os.link(target, logs / name_for(process))
    dest = log.configure("info", str(logs), process, candidates=[])
    assert dest.kind == "stderr"
    assert target.read_text() == "precious\n"


# --- levels, streams, blocks ----------------------------------------------------------------------


def test_level_filtering(tmp_path: Path) -> None:
    log.configure("warning", str(tmp_path / "w"), proc(), candidates=[])
    logger = log.get_logger()
    logger.debug("debug-record")
    logger.info("info-record")
    logger.warning("warning-record")
    text = read(log.log_path())
    assert "debug-record" not in text and "info-record" not in text and "warning-record" in text

    log.configure("debug", str(tmp_path / "d"), proc(), candidates=[])
    logger.debug("debug-record")
    assert "debug-record" in read(log.log_path())


def test_filtered_methods_are_no_ops() -> None:
    log.configure("error", "stderr", proc())
    # make_filtering_bound_logger turns methods below the level into a bare `return None`.
    assert log.get_logger().debug.__name__ == "_nop"


def test_stdout_destination(capsys: pytest.CaptureFixture[str]) -> None:
    dest = log.configure("info", "stdout", proc())
    assert dest.kind == "stdout" and log.log_path() is None
    log.get_logger().info("to stdout")
    out, err = capsys.readouterr()
    assert "to stdout" in out and "level=info" in out and err == ""


def test_stderr_destination(capsys: pytest.CaptureFixture[str]) -> None:
    log.configure("info", "STDERR", proc())
    log.get_logger().info("to stderr")
    out, err = capsys.readouterr()
    assert "to stderr" in err and out == ""


def test_destination_warnings_are_logged(tmp_path: Path) -> None:
    regular = tmp_path / "file.txt"
    regular.write_text("")
    fallback = tmp_path / "fallback"
    log.configure("warning", str(regular), proc(), candidates=[str(fallback)])
    text = read(log.log_path())
    assert "level=warning" in text and "LOONGKIT_LOGDIR" in text and "logger=loongkit.log" in text


def test_destination_warnings_respect_level(tmp_path: Path) -> None:
    regular = tmp_path / "file.txt"
    regular.write_text("")
    log.configure("error", str(regular), proc(), candidates=[str(tmp_path / "fallback")])
    assert not os.path.exists(log.log_path())  # nothing at the level: not even an empty file


def test_write_block_verbatim(tmp_path: Path) -> None:
    block = (
        "============ Loongkit Feature Summary ============\n"
        "Enabled Features                 Configurations\n"
        "data_container                 * None\n"
        "numa_affinity                    {'allow_index': False}\n"
        "=================================================="
    )
    log.configure("critical", str(tmp_path), proc(), candidates=[])  # the level does not matter
    log.write_block(block)
    assert read(log.log_path()) == block + "\n"


def test_write_block_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    log.configure("critical", "stdout", proc())
    log.write_block("a\n  b\n")
    assert capsys.readouterr().out == "a\n  b\n"


# --- lifecycle ------------------------------------------------------------------------------------------


def test_nothing_printed_before_configure(capfd: pytest.CaptureFixture[str]) -> None:
    logger = log.get_logger("early", component="x")
    logger.critical("too early")
    logger.exception("too early")
    logger.bind(a=1).error("too early")
    log.write_block("too early")
    assert log.log_path() is None
    assert capfd.readouterr() == ("", "")


def test_logger_created_early_works_after_configure(tmp_path: Path) -> None:
    logger = log.get_logger("early").bind(step=1)
    logger.warning("dropped")
    log.configure("info", str(tmp_path), proc(), candidates=[])
    logger.warning("kept")
    text = read(log.log_path())
    assert "dropped" not in text and "event=kept" in text and "step=1" in text and "logger=early" in text


def test_nothing_printed_after_shutdown(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    log.configure("info", "stdout", proc())
    log.shutdown()
    log.get_logger().error("after shutdown")
    log.write_block("after shutdown")
    assert capfd.readouterr() == ("", "")


def _fds_pointing_at(path: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{entry}") == path:
                found.append(int(entry))
        except OSError:
            pass
    return found


needs_procfs = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")


@needs_procfs
def test_reconfigure_closes_old_file(tmp_path: Path) -> None:
    log.configure("info", str(tmp_path / "one"), proc(), candidates=[])
    log.get_logger().info("first")
    first = log.log_path()
    assert first is not None and _fds_pointing_at(first)
    log.configure("info", str(tmp_path / "two"), proc(), candidates=[])
    assert _fds_pointing_at(first) == []
    log.get_logger().info("second")
    assert "second" in read(log.log_path()) and "second" not in read(first)
    log.shutdown()
    assert log.log_path() is None


@needs_procfs
def test_disk_full_degrades_silently(tmp_path: Path) -> None:
    log.configure("info", str(tmp_path), proc(), candidates=[])
    log.get_logger().info("opens the file")
    path = log.log_path()
    assert path is not None
    (fd,) = _fds_pointing_at(path)
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        os.dup2(full, fd)  # every later write fails with ENOSPC
    finally:
        os.close(full)
    log.get_logger().error("lost")
    log.write_block("lost too")


def test_unrenderable_value_does_not_raise(tmp_path: Path) -> None:
    class Bad:
        def __str__(self) -> str:
            raise RuntimeError("no")

        __repr__ = __str__

    log.configure("info", str(tmp_path), proc(), candidates=[])
    log.get_logger().info("bad", value=Bad())


def test_exception_records_include_traceback(tmp_path: Path) -> None:
    log.configure("info", str(tmp_path), proc(), candidates=[])
    try:
        raise ValueError("kaboom")
    except ValueError:
        log.get_logger().exception("failed")
    text = read(log.log_path())
    assert "level=error" in text and "kaboom" in text
    assert len(text.splitlines()) == 1  # the traceback is escaped onto the record's line


def test_users_structlog_configuration_is_untouched(tmp_path: Path) -> None:
    before = structlog.get_config()
    log.configure("debug", str(tmp_path), proc(), candidates=[])
    assert structlog.get_config() == before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("parent_logged_first", [True, False])
def test_forked_child_appends_to_parents_file(tmp_path: Path, parent_logged_first: bool) -> None:
    parent = proc(rank=1)
    log.configure("info", str(tmp_path), parent, candidates=[])
    parent_path = log.log_path()
    if parent_logged_first:
        log.get_logger().info("parent before fork")

    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only, never return into pytest
        code = 1
        try:
            child = proc(rank=1, pid=os.getpid())
            child.role = "worker"
            log.after_fork(child)
            log.get_logger().info("child says hi")
            code = 0 if log.log_path() == parent_path else 2
        finally:
            os._exit(code)

    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    log.get_logger().info("parent after fork")

    assert not (tmp_path / name_for(proc(rank=1, pid=pid))).exists()  # no file of its own
    lines = read(parent_path).splitlines()
    child_lines = [line for line in lines if "child says hi" in line]
    assert len(child_lines) == 1 and f"pid={pid}" in child_lines[0] and "role=worker" in child_lines[0]
    assert sum("parent before fork" in line for line in lines) == int(parent_logged_first)  # never twice
    assert any("parent after fork" in line and f"pid={os.getpid()}" in line for line in lines)


def test_nul_byte_in_logdir_falls_back(tmp_path: Path) -> None:
    dest = log.resolve_destination("bad\0dir", proc(), candidates=[str(tmp_path)])
    assert dest.directory == str(tmp_path)
    assert "LOONGKIT_LOGDIR" in dest.warnings[0]


def test_logger_proxy_copies_and_binds(tmp_path: Path) -> None:
    import copy

    logger = copy.copy(log.get_logger("x", a=1))
    log.configure("info", str(tmp_path), proc(), candidates=[])
    logger.bind(b=2).try_unbind("a").info("bound")
    line = read(log.log_path())
    assert "logger=x" in line and "b=2" in line and "a=1" not in line
