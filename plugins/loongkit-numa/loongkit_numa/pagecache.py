"""LOONGKIT_PAGE_CACHE_LIMIT: keep the container's page cache under a limit (fragmentation jitter).

Two mechanisms, chosen by what the kernel offers on the container's memory cgroup (read under
``LOONGKIT_SYSFS_ROOT``):

* Alibaba Cloud Linux kernels: ``memory.pagecache_limit.{size,sync,enable}`` on the group (and the
  global switch ``/sys/kernel/mm/pagecache_limit/enabled``). The kernel enforces the limit; we
  write the files once and put the previous values back at exit.
* Stock kernels with cgroup v2 ``memory.reclaim`` (Linux >= 5.19): a daemon thread polls
  ``memory.stat`` ("file", else active_file + inactive_file) and, when the page cache is over the
  limit, writes the excess in bytes to ``memory.reclaim``. Asynchronous mode polls every second
  and reclaims a little below the limit (so it does not fire again at once); SYNC=1 polls ten
  times as often and reclaims as soon as the threshold is crossed.

Anything else (cgroup v1 without pagecache_limit, v2 without memory.reclaim, a read-only cgroupfs,
no permission) is not applicable, with the reason. One container needs one limiter: only the main
process of local rank 0 (or of a run without ranks) applies it.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator, Field
from pydantic_settings import SettingsConfigDict

from loongkit_core import cgroupfs
from loongkit_core.context import ActivationContext, Environment, NotApplicable
from loongkit_core.kit import FeatureImpl
from loongkit_core.process import HELPER, LAUNCHER, MAIN
from loongkit_core.settings import LkBool, LoongkitSettings

DEFAULT_SIZE = "50%"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^(\d+)([KMGT]?)$", re.IGNORECASE)
_PERCENT = re.compile(r"^(\d+(?:\.\d+)?)%$")

# Alibaba Cloud Linux's page cache limit: a global switch and per-memory-cgroup files.
PAGECACHE_GLOBAL_SWITCH = "sys/kernel/mm/pagecache_limit/enabled"
PAGECACHE_FILES = ("memory.pagecache_limit.enable", "memory.pagecache_limit.size", "memory.pagecache_limit.sync")

ASYNC_INTERVAL = 1.0  # seconds between polls of memory.stat
SYNC_INTERVAL = 0.1
ASYNC_TARGET = 0.95  # async reclaims down to this fraction of the limit: one write per excursion


@dataclass(frozen=True)
class SizeSpec:
    """A parsed LOONGKIT_PAGE_CACHE_LIMIT_SIZE: absolute bytes or a percentage of the container's memory."""

    text: str
    bytes: int | None = None
    percent: float | None = None

    def resolve(self, available: int | None) -> int | None:
        if self.bytes is not None:
            return self.bytes
        if available is None or self.percent is None:
            return None
        return int(available * self.percent / 100)


def parse_size(value: object) -> SizeSpec:
    """"10737418240", "8G", "512m", "1024K" or "50%"; raise ValueError for anything else."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{value!r} is not a size")
    text = str(value).strip()
    match = _SIZE.match(text)
    if match:
        amount = int(match.group(1)) * _UNITS[match.group(2).upper()]
        if amount <= 0:
            raise ValueError("the size must be more than 0 bytes")
        return SizeSpec(text=text.upper(), bytes=amount)
    match = _PERCENT.match(text)
    if match:
        percent = float(match.group(1))
        if not 0 < percent <= 100:
            raise ValueError("a percentage must be in (0, 100]")
        return SizeSpec(text=text, percent=percent)
    raise ValueError("expected bytes (10737418240), a size with a K/M/G unit (8G) or a percentage (50%)")


def _normalize_size(value: object) -> str:
    return parse_size(value).text


class PageCacheOptions(LoongkitSettings):
    model_config = SettingsConfigDict(env_prefix="LOONGKIT_PAGE_CACHE_LIMIT_", extra="ignore", case_sensitive=False)

    size: Annotated[str, BeforeValidator(_normalize_size)] = Field(
        DEFAULT_SIZE, description="Page cache limit: bytes, 8G/512M/1024K, or a percentage of the container's memory.")
    sync: LkBool = Field(False, description="Reclaim synchronously (at once) rather than in the background.")

    @property
    def spec(self) -> SizeSpec:
        return parse_size(self.size)


# -- what the kernel offers ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Mechanism:
    kind: str  # "pagecache_limit" (Alibaba Cloud Linux) or "memory.reclaim"
    group: cgroupfs.Group
    switch: str | None = None  # the global switch path (pagecache_limit only), when present


def pagecache_switch(root: str) -> str:
    """The path of Alibaba Cloud Linux's global page cache limit switch under ``root``."""
    return os.path.join(root, PAGECACHE_GLOBAL_SWITCH)


def find_mechanism(root: str) -> tuple[Mechanism | None, str]:
    """The limiter this kernel and cgroup tree allow under ``root``, or None and the reason why not."""
    group = cgroupfs.own_group(root, "memory")
    if group is None:
        ver = cgroupfs.version(root)
        where = f"{root.rstrip('/')}/{cgroupfs.CGROUP_MOUNT}"
        return None, f"no memory cgroup under {where}" + ("" if ver is None else f" (cgroup v{ver})")
    alinux = [group.file(name) for name in PAGECACHE_FILES]
    if any(cgroupfs.read_text(path) is not None for path in alinux):
        missing = [p for p in alinux if not cgroupfs.writable(p)]
        if missing:
            return None, f"cannot write {', '.join(missing)} (read-only cgroupfs or no permission)"
        switch = pagecache_switch(root)
        state = cgroupfs.read_text(switch)
        if state is not None and state.strip() != "1" and not cgroupfs.writable(switch):
            return None, f"the global switch {switch} is {state.strip()!r} and cannot be written"
        return Mechanism("pagecache_limit", group, switch if state is not None else None), ""
    if group.version == 2:
        reclaim = group.file("memory.reclaim")
        if cgroupfs.read_text(group.file("memory.stat")) is None:
            return None, f"cannot read {group.file('memory.stat')}"
        if not os.path.exists(reclaim):
            return None, (f"{group.path} has neither memory.pagecache_limit.* (Alibaba Cloud Linux) nor "
                          "memory.reclaim (Linux >= 5.19)")
        if not cgroupfs.writable(reclaim):
            return None, f"cannot write {reclaim} (read-only cgroupfs or no permission)"
        return Mechanism("memory.reclaim", group), ""
    return None, (f"cgroup v1 memory controller at {group.path} has no memory.pagecache_limit.* "
                  "(not an Alibaba Cloud Linux kernel), and memory.reclaim needs cgroup v2")


def available_memory(group: cgroupfs.Group, root: str) -> int | None:
    """The container's memory: its cgroup limit, capped by the machine's MemTotal."""
    limit = cgroupfs.memory_limit(group)
    total = cgroupfs.mem_total(root)
    if limit is None:
        return total
    return limit if total is None else min(limit, total)


# -- Alibaba Cloud Linux ----------------------------------------------------------------------------------
class KernelLimit:
    """Writes memory.pagecache_limit.* (and the global switch) and restores the previous values."""

    def __init__(self, mechanism: Mechanism) -> None:
        self.mechanism = mechanism
        self._previous: list[tuple[str, str]] = []

    def apply(self, limit: int, sync: bool) -> list[str]:
        """Write the limit; return the changes made. A failed write undoes the others and raises RuntimeError."""
        group = self.mechanism.group
        writes: list[tuple[str, str]] = []
        if self.mechanism.switch is not None:
            writes.append((self.mechanism.switch, "1"))
        writes += [(group.file("memory.pagecache_limit.size"), str(limit)),
                   (group.file("memory.pagecache_limit.sync"), "1" if sync else "0"),
                   (group.file("memory.pagecache_limit.enable"), "1")]
        done: list[str] = []
        for path, value in writes:
            before = (cgroupfs.read_text(path) or "").strip()
            if before == value:
                continue
            problem = cgroupfs.write_text(path, value)
            if problem:
                self.restore()
                raise RuntimeError(problem)
            self._previous.append((path, before))
            done.append(f"{path}: {before or '?'} -> {value}")
        return done

    def restore(self) -> None:
        while self._previous:
            path, value = self._previous.pop()
            if value:
                cgroupfs.write_text(path, value)


# -- stock kernels: the reclaimer --------------------------------------------------------------------------
class Reclaimer:
    """Keeps a cgroup v2 group's page cache under ``limit`` by writing to its memory.reclaim.

    ``wait(seconds)`` sleeps between polls and returns True to stop (default: an Event's wait), and
    ``clock`` times the reclaims; tests inject both.
    """

    def __init__(self, group: cgroupfs.Group, limit: int, sync: bool, *,
                 wait: Callable[[float], bool] | None = None, clock: Callable[[], float] = time.monotonic,
                 on_reclaim: Callable[[int, int], None] | None = None, log: Any = None) -> None:
        self.group = group
        self.limit = limit
        self.sync = sync
        self.interval = SYNC_INTERVAL if sync else ASYNC_INTERVAL
        self._stop = threading.Event()
        self._wait = wait or self._stop.wait
        self._clock = clock
        self._on_reclaim = on_reclaim
        self._log = log
        self._thread: threading.Thread | None = None
        self.reclaims = 0
        self.reclaimed_bytes = 0  # requested; the kernel may reclaim less
        self.failures = 0
        self.last_error = ""
        self.busy_seconds = 0.0

    def target(self) -> int:
        return self.limit if self.sync else int(self.limit * ASYNC_TARGET)

    def step(self) -> int:
        """One poll: the bytes asked of memory.reclaim (0 when under the limit or unreadable)."""
        cache = cgroupfs.page_cache_bytes(cgroupfs.memory_stat(self.group))
        if cache is None or cache <= self.limit:
            return 0
        amount = cache - self.target()
        start = self._clock()
        problem = cgroupfs.write_text(self.group.file("memory.reclaim"), str(amount))
        self.busy_seconds += self._clock() - start
        if problem:
            # EAGAIN: the kernel reclaimed less than asked; the next poll tries again.
            self.failures += 1
            if problem != self.last_error and self._log is not None:
                self._log.info(f"page_cache_limit: {problem}")
            self.last_error = problem
        self.reclaims += 1
        self.reclaimed_bytes += amount
        if self._on_reclaim is not None:
            self._on_reclaim(cache, amount)
        return amount

    def run(self) -> None:
        while True:
            try:
                self.step()
            except Exception as exc:  # never let a surprise end the thread silently
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            if self._wait(self.interval):
                return

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="loongkit-pagecache", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


# -- the feature ------------------------------------------------------------------------------------------
class PageCacheLimit(FeatureImpl):
    """The kernel limit's restore and the reclaimer's stop are deferred on ``ctx.patcher`` (and run at
    exit too: both are idempotent), so the default ``deactivate`` undoes the feature."""

    options = PageCacheOptions

    def __init__(self, feature: Any) -> None:
        super().__init__(feature)
        self.mechanism: Mechanism | None = None

    @staticmethod
    def _leader(env: Environment) -> bool:
        return env.process.role == MAIN and env.process.local_rank in (None, 0)

    def detect(self, env: Environment) -> str | None:
        if env.process.role in (LAUNCHER, HELPER):
            return f"nothing to limit from a {env.process.role} process"
        if not self._leader(env):
            return None  # activation says that local rank 0 handles the container
        mechanism, reason = find_mechanism(env.settings.sysfs_root)
        if mechanism is None:
            return reason
        self.mechanism = mechanism
        return None

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        options = ctx.config if isinstance(ctx.config, PageCacheOptions) else PageCacheOptions()
        if not self._leader(ctx.env):
            ctx.waiting("the main process of local rank 0 limits the container's page cache")
            return
        if self.mechanism is None:
            mechanism, reason = find_mechanism(ctx.env.settings.sysfs_root)
            if mechanism is None:
                raise NotApplicable(reason)
            self.mechanism = mechanism
        mechanism = self.mechanism
        spec = options.spec
        available = available_memory(mechanism.group, ctx.env.settings.sysfs_root)
        limit = spec.resolve(available)
        if limit is None or limit <= 0:
            raise NotApplicable(f"cannot resolve {spec.text}: the container's memory size is unknown")
        config = {"size": spec.text, "limit_bytes": limit, "sync": options.sync, "mechanism": mechanism.kind,
                  "cgroup": mechanism.group.path}
        ctx.set_config(config)
        if mechanism.kind == "pagecache_limit":
            kernel = KernelLimit(mechanism)
            try:
                changes = kernel.apply(limit, options.sync)
            except RuntimeError as exc:
                raise NotApplicable(str(exc)) from exc
            ctx.patcher.defer(kernel.restore)
            ctx.at_exit(kernel.restore)
            for change in changes:
                ctx.log.info(f"page_cache_limit: {change}")
            ctx.log.info(f"page_cache_limit: kernel page cache limit {limit} bytes on {mechanism.group.path} "
                         f"({'sync' if options.sync else 'async'} reclaim)")
            ctx.count()
            return

        def on_reclaim(cache: int, amount: int) -> None:
            ctx.count()
            ctx.waiting("")
            ctx.detail("reclaims", reclaimer.reclaims)
            ctx.detail("reclaim_requested_bytes", reclaimer.reclaimed_bytes)

        def stop() -> None:
            reclaimer.stop()
            ctx.detail("reclaims", reclaimer.reclaims)

        reclaimer = Reclaimer(mechanism.group, limit, options.sync, on_reclaim=on_reclaim, log=ctx.log)
        reclaimer.start()
        ctx.patcher.defer(stop)
        ctx.at_exit(reclaimer.stop)
        ctx.waiting("page cache has not exceeded the limit yet")
        ctx.log.info(f"page_cache_limit: reclaimer started: page cache of {mechanism.group.path} kept under "
                     f"{limit} bytes through memory.reclaim (poll {reclaimer.interval:g}s, "
                     f"{'sync' if options.sync else 'async'})")
