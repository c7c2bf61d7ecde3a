"""Page cache limit: size parsing, options, mechanism detection on fake trees, and the reclaimer's logic."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from loongkit_numa import pagecache
from loongkit_numa.fake_cgroups import write_cgroup_tree
from loongkit_numa.pagecache import PageCacheOptions, Reclaimer, find_mechanism, parse_size

from loongkit_core import cgroupfs
from loongkit_core.settings import load_settings

G = 1 << 30
M = 1 << 20


@pytest.mark.parametrize(("text", "bytes_", "percent"), [
    ("10737418240", 10737418240, None),
    ("8G", 8 * G, None),
    ("8g", 8 * G, None),
    ("512M", 512 * M, None),
    ("512m", 512 * M, None),
    ("1024K", 1024 * 1024, None),
    ("1024k", 1024 * 1024, None),
    (" 2T ", 2 << 40, None),
    ("50%", None, 50.0),
    ("12.5%", None, 12.5),
    ("100%", None, 100.0),
])
def test_parse_size(text: str, bytes_: int | None, percent: float | None) -> None:
    spec = parse_size(text)
    assert (spec.bytes, spec.percent) == (bytes_, percent)


@pytest.mark.parametrize("text", ["", "8GB", "8 G", "-1", "0", "0M", "1.5G", "150%", "0%", "-5%", "lots", "G", "8Q"])
def test_bad_sizes_raise(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_percent_resolves_against_available_memory() -> None:
    assert parse_size("50%").resolve(8 * G) == 4 * G
    assert parse_size("50%").resolve(None) is None
    assert parse_size("1G").resolve(None) == G


@pytest.mark.parametrize(("env", "size", "sync", "warns"), [
    ({}, "50%", False, 0),
    ({"LOONGKIT_PAGE_CACHE_LIMIT_SIZE": "8g", "LOONGKIT_PAGE_CACHE_LIMIT_SYNC": "on"}, "8G", True, 0),
    ({"LOONGKIT_PAGE_CACHE_LIMIT_SIZE": "8GB"}, "50%", False, 1),
    ({"LOONGKIT_PAGE_CACHE_LIMIT_SIZE": "200%"}, "50%", False, 1),
    ({"LOONGKIT_PAGE_CACHE_LIMIT_SYNC": "sometimes"}, "50%", False, 1),
    ({"LOONGKIT_PAGE_CACHE_LIMIT_SIZE": "x", "LOONGKIT_PAGE_CACHE_LIMIT_SYNC": "2"}, "50%", False, 2),
])
def test_options_default_and_warning(env: dict, size: str, sync: bool, warns: int) -> None:
    options, warnings = load_settings(PageCacheOptions, environ=env)
    assert (options.size, options.sync) == (size, sync)
    assert len(warnings) == warns
    for warning in warnings:
        assert "is invalid" in warning and "using the default" in warning


# -- mechanisms ---------------------------------------------------------------------------------------
ALINUX = {"enable": "0", "size": "0", "sync": "0"}


@pytest.mark.parametrize("version", [1, 2])
def test_alibaba_cloud_linux_files_win(tmp_path: Path, version: int) -> None:
    write_cgroup_tree(tmp_path, version=version, group="/pod", pagecache_limit=ALINUX, global_switch="0",
                      memory_reclaim=version == 2)
    mechanism, reason = find_mechanism(str(tmp_path))
    assert mechanism is not None, reason
    assert mechanism.kind == "pagecache_limit" and mechanism.group.path.endswith("pod")
    assert mechanism.switch == str(tmp_path / "sys/kernel/mm/pagecache_limit/enabled")


def test_v2_memory_reclaim(tmp_path: Path) -> None:
    write_cgroup_tree(tmp_path, version=2, memory_reclaim=True)
    mechanism, _ = find_mechanism(str(tmp_path))
    assert mechanism is not None and mechanism.kind == "memory.reclaim"


@pytest.mark.parametrize(("tree", "reason"), [
    (dict(version=1), "cgroup v1 memory controller"),
    (dict(version=2), "neither memory.pagecache_limit.* (Alibaba Cloud Linux) nor memory.reclaim"),
    (dict(version=2, memory_reclaim=True, memory_stat=None), "cannot read"),
])
def test_not_applicable_reasons(tmp_path: Path, tree: dict, reason: str) -> None:
    write_cgroup_tree(tmp_path, **tree)
    mechanism, why = find_mechanism(str(tmp_path))
    assert mechanism is None and reason in why


def test_no_cgroup_at_all(tmp_path: Path) -> None:
    mechanism, why = find_mechanism(str(tmp_path))
    assert mechanism is None and why.startswith("no memory cgroup under")


def test_read_only_files_are_not_applicable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Root ignores permission bits, so a read-only cgroupfs (EROFS from access(2)) is simulated.
    write_cgroup_tree(tmp_path, version=2, memory_reclaim=True)
    monkeypatch.setattr(cgroupfs.os, "access", lambda path, mode: False)
    mechanism, why = find_mechanism(str(tmp_path))
    assert mechanism is None and "read-only cgroupfs or no permission" in why
    write_cgroup_tree(tmp_path / "ali", version=1, pagecache_limit=ALINUX)
    mechanism, why = find_mechanism(str(tmp_path / "ali"))
    assert mechanism is None and "memory.pagecache_limit" in why


def test_global_switch_off_and_read_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_cgroup_tree(tmp_path, version=1, pagecache_limit=ALINUX, global_switch="0")
    switch = str(tmp_path / "sys/kernel/mm/pagecache_limit/enabled")
    real_access = os.access
    monkeypatch.setattr(cgroupfs.os, "access", lambda path, mode: path != switch and real_access(path, mode))
    mechanism, why = find_mechanism(str(tmp_path))
    assert mechanism is None and "global switch" in why


def test_kernel_limit_writes_and_restores(tmp_path: Path) -> None:
    mem = write_cgroup_tree(tmp_path, version=1, pagecache_limit=ALINUX, global_switch="0")
    mechanism, _ = find_mechanism(str(tmp_path))
    assert mechanism is not None
    kernel = pagecache.KernelLimit(mechanism)
    changes = kernel.apply(3 * G, sync=True)
    assert len(changes) == 4
    assert (mem / "memory.pagecache_limit.size").read_text() == str(3 * G)
    assert (mem / "memory.pagecache_limit.sync").read_text() == "1"
    assert (mem / "memory.pagecache_limit.enable").read_text() == "1"
    assert (tmp_path / "sys/kernel/mm/pagecache_limit/enabled").read_text() == "1"
    kernel.restore()
    assert (mem / "memory.pagecache_limit.size").read_text() == "0"
    assert (mem / "memory.pagecache_limit.enable").read_text() == "0"
    assert (tmp_path / "sys/kernel/mm/pagecache_limit/enabled").read_text() == "0"


def test_kernel_limit_failed_write_undoes_the_others(tmp_path: Path) -> None:
    mem = write_cgroup_tree(tmp_path, version=2, pagecache_limit=ALINUX)
    mechanism, _ = find_mechanism(str(tmp_path))
    assert mechanism is not None
    (mem / "memory.pagecache_limit.enable").unlink()
    (mem / "memory.pagecache_limit.enable").mkdir()  # opening it for writing fails (EISDIR)
    with pytest.raises(RuntimeError, match="cannot write"):
        pagecache.KernelLimit(mechanism).apply(G, sync=False)
    assert (mem / "memory.pagecache_limit.size").read_text().strip() == "0"


def test_available_memory(tmp_path: Path) -> None:
    write_cgroup_tree(tmp_path, version=2, group="/a/b", memory_max="max", mem_total_kb=4 * 1024 * 1024)
    (tmp_path / "sys/fs/cgroup/a/memory.max").write_text(str(2 * G))  # the parent's limit binds
    group = cgroupfs.own_group(str(tmp_path), "memory")
    assert group is not None and pagecache.available_memory(group, str(tmp_path)) == 2 * G
    write_cgroup_tree(tmp_path / "v1", version=1, memory_max="9223372036854771712", mem_total_kb=1024)
    group = cgroupfs.own_group(str(tmp_path / "v1"), "memory")
    assert group is not None and pagecache.available_memory(group, str(tmp_path / "v1")) == 1024 * 1024
    write_cgroup_tree(tmp_path / "none", version=2, memory_max="garbage", mem_total_kb=None)
    group = cgroupfs.own_group(str(tmp_path / "none"), "memory")
    assert group is not None and pagecache.available_memory(group, str(tmp_path / "none")) is None


# -- the reclaimer --------------------------------------------------------------------------------------
class Script:
    """An injected wait(): each poll, the next memory.stat text; stops when the list runs out."""

    def __init__(self, mem: Path, stats: list[str]) -> None:
        self.mem = mem
        self.stats = list(stats)
        self.waits: list[float] = []
        self.reclaim_writes: list[str] = []

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.reclaim_writes.append((self.mem / "memory.reclaim").read_text())
        (self.mem / "memory.reclaim").write_text("")
        if not self.stats:
            return True
        (self.mem / "memory.stat").write_text(self.stats.pop(0))
        return False


def _reclaimer(tmp_path: Path, stats: list[str], sync: bool, limit: int = 1000 * M) -> tuple[Reclaimer, Script]:
    mem = write_cgroup_tree(tmp_path, version=2, memory_reclaim=True, memory_stat=stats[0])
    group = cgroupfs.own_group(str(tmp_path), "memory")
    assert group is not None
    script = Script(mem, stats[1:])
    ticks = iter(range(1000))
    return Reclaimer(group, limit, sync, wait=script.wait, clock=lambda: float(next(ticks))), script


def test_async_reclaims_below_the_limit_once_per_excursion(tmp_path: Path) -> None:
    stats = [f"anon 5\nfile {n * M}\n" for n in (500, 1200, 960, 1000, 1001)]
    reclaimer, script = _reclaimer(tmp_path, stats, sync=False)
    reclaimer.run()
    assert script.waits == [pagecache.ASYNC_INTERVAL] * 5
    # Over the limit at 1200M: reclaim to 95% (950M); 960M and exactly 1000M are within it; 1001M is over.
    assert script.reclaim_writes == ["", str(250 * M), "", "", str(51 * M)]
    assert reclaimer.reclaims == 2 and reclaimer.reclaimed_bytes == 301 * M
    assert reclaimer.busy_seconds == 2.0  # one tick of the injected clock per write


def test_sync_reclaims_to_the_limit_on_a_tighter_poll(tmp_path: Path) -> None:
    stats = [f"file {n * M}\n" for n in (1200, 1001, 999)]
    reclaimer, script = _reclaimer(tmp_path, stats, sync=True)
    reclaimer.run()
    assert script.waits == [pagecache.SYNC_INTERVAL] * 3
    assert script.reclaim_writes == [str(200 * M), str(1 * M), ""]


def test_active_plus_inactive_file_when_no_file_key(tmp_path: Path) -> None:
    stats = [f"active_file {700 * M}\ninactive_file {500 * M}\n"]
    reclaimer, script = _reclaimer(tmp_path, stats, sync=True)
    reclaimer.run()
    assert script.reclaim_writes == [str(200 * M)]


@pytest.mark.parametrize("stat", ["", "garbage\n", "file lots\n", "file\n", "\x00\x01"])
def test_garbled_memory_stat_never_reclaims_nor_crashes(tmp_path: Path, stat: str) -> None:
    reclaimer, script = _reclaimer(tmp_path, [stat, stat], sync=False)
    reclaimer.run()
    assert script.reclaim_writes == ["", ""] and reclaimer.failures == 0


def test_failed_reclaim_write_is_counted_and_retried(tmp_path: Path) -> None:
    stats = [f"file {2000 * M}\n", f"file {2000 * M}\n"]
    reclaimer, _ = _reclaimer(tmp_path, stats, sync=True)
    reclaim = Path(reclaimer.group.file("memory.reclaim"))
    reclaim.unlink()
    reclaim.mkdir()  # writing fails like an EAGAIN would: the next poll tries again
    polls: list[float] = []
    reclaimer._wait = lambda s: polls.append(s) or len(polls) >= 3  # type: ignore[method-assign]
    reclaimer.run()
    assert reclaimer.failures == 3 and "cannot write" in reclaimer.last_error


def test_thread_starts_reclaims_and_stops(tmp_path: Path) -> None:
    mem = write_cgroup_tree(tmp_path, version=2, memory_reclaim=True, memory_stat=f"file {3 * G}\n")
    group = cgroupfs.own_group(str(tmp_path), "memory")
    assert group is not None
    seen: list[tuple[int, int]] = []
    reclaimer = Reclaimer(group, G, sync=True, on_reclaim=lambda cache, amount: seen.append((cache, amount)))
    reclaimer.start()
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.02)
    (mem / "memory.stat").write_text(f"file {G // 2}\n")
    reclaimer.stop()
    assert not reclaimer.running
    assert seen and seen[0] == (3 * G, 2 * G)


# -- the feature in-process: apply -> the default deactivate -> apply again -----------------------------
def _pagecache_threads() -> list[Any]:
    import threading

    return [t for t in threading.enumerate() if t.name == "loongkit-pagecache" and t.is_alive()]


def test_kernel_limit_default_deactivate_restores_and_reapplies(tmp_path: Path, loongkit_runtime: Any) -> None:
    from loongkit_core.feature import State

    mem = write_cgroup_tree(tmp_path, version=2, memory_max=str(8 * G), pagecache_limit=ALINUX, global_switch="0")
    switch = tmp_path / "sys/kernel/mm/pagecache_limit/enabled"

    def files() -> tuple[str, ...]:
        return (*((mem / f"memory.pagecache_limit.{k}").read_text().strip() for k in ("enable", "size", "sync")),
                switch.read_text().strip())

    before = files()
    rt = loongkit_runtime({"LOONGKIT_PAGE_CACHE_LIMIT": "1", "LOONGKIT_SYSFS_ROOT": str(tmp_path)},
                          activate={"page_cache_limit": None})
    record = rt.records["page_cache_limit"]
    for _ in range(2):
        assert record.state == State.APPLIED and record.active, record.reason
        assert files() == ("1", str(4 * G), "0", "1")
        rt.deactivate("page_cache_limit")
        assert files() == before and len(rt.contexts["page_cache_limit"].patcher) == 0
        rt.activate(record, None)


def test_reclaimer_default_deactivate_stops_it_and_reapplies(tmp_path: Path, loongkit_runtime: Any) -> None:
    write_cgroup_tree(tmp_path, version=2, memory_max=str(8 * G), memory_reclaim=True)
    assert _pagecache_threads() == []
    rt = loongkit_runtime({"LOONGKIT_PAGE_CACHE_LIMIT": "1", "LOONGKIT_SYSFS_ROOT": str(tmp_path)},
                          activate={"page_cache_limit": None})
    record = rt.records["page_cache_limit"]
    for _ in range(2):
        assert record.reason == "page cache has not exceeded the limit yet"
        assert len(_pagecache_threads()) == 1
        rt.deactivate("page_cache_limit")
        assert _pagecache_threads() == [] and len(rt.contexts["page_cache_limit"].patcher) == 0
        rt.activate(record, None)
