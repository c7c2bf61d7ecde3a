"""The hot path: one call per training step, one per batch fetch, one per synchronising call.

Everything here is a few float additions and an ``array`` append: no lock, no syscall but the clock,
no allocation per step beyond the arrays' amortised growth. The figures (medians, shares) are
computed at exit by :mod:`loongkit_monitor.analysis` from the arrays kept here.

A *step* is the time between two step boundaries (an optimizer step of the job's first optimizer,
or the end of a training-loop iteration of mmengine / mmcv 1.x). The first step starts at the job's
first batch fetch (or first loop iteration) when there is one; otherwise the first boundary only
starts the clock. Time while the recorder is *paused* (a validation loop inside training) belongs to
no step.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REBUILT = 3  # alike one-epoch loaders from which a job counts as building one per epoch
MAX_KEPT = 1 << 20  # per-step figures kept (8 bytes each, three arrays); later steps are counted only


@dataclass
class LoaderStats:
    """One DataLoader (all its iterators, one per epoch unless persistent) as the main process saw it."""

    num_workers: int
    persistent: bool
    context: str  # multiprocessing start method of its workers ("fork", "spawn", ...; "" without workers)
    batches: int = 0
    wait_s: float = 0.0
    epochs: int = 0  # times its first batch was fetched (a new or reset iterator)
    epoch_start_wait_s: float = 0.0  # creating the iterator (starting workers) and its first batch
    iter_s: float = 0.0  # of which in DataLoader.__iter__ (not in wait_s, the batches' waits)
    batch_size: int | None = None
    built: int = 1  # loader objects this stands for (a loop that builds one per epoch: several)
    dataset: Any = None  # loongkit_monitor.dataset.DatasetView of its dataset, looked at once

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["dataset"] = self.dataset.to_json() if self.dataset is not None else None
        return out


def loader_stats(iterator: Any) -> LoaderStats:
    """What a ``_BaseDataLoaderIter`` says about its loader (private attributes: read defensively)."""
    workers = int(getattr(iterator, "_num_workers", 0) or 0)
    context = ""
    if workers:
        # the iterator keeps its worker processes, not the context: a SpawnProcess says "spawn"
        processes = getattr(iterator, "_workers", None) or []
        context = str(getattr(processes[0], "_start_method", None) or "") if processes else ""
        if not context:
            import multiprocessing

            context = multiprocessing.get_start_method(allow_none=True) or "fork"
    from loongkit_monitor import dataset

    sampler = getattr(iterator, "_index_sampler", None)
    batch = getattr(sampler, "batch_size", None)
    data = getattr(iterator, "_dataset", None)
    return LoaderStats(workers, bool(getattr(iterator, "_persistent_workers", False)), context,
                       batch_size=batch if isinstance(batch, int) else None,
                       dataset=dataset.describe(data) if data is not None else None)


class StepRecorder:
    """Per-step wall time, data wait and synchronisation time of this process."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.steps = 0  # step boundaries seen
        self.walls = array("d")  # per timed step: seconds, paused time excluded
        self.waits = array("d")  # per timed step: seconds in the DataLoader iterator
        self.syncs = array("d")  # per timed step: seconds in backward and blocking collectives
        self.first_timed = 0  # step number (1-based) of walls[0]
        self.last: float | None = None  # the clock at the last boundary (or at the first step's start)
        self.wait = 0.0  # accumulated within the current step
        self.sync = 0.0
        self.paused_s = 0.0
        self.paused_at: float | None = None
        self.total_paused_s = 0.0
        self.untimed_wait_s = 0.0  # data wait outside steps (paused, or after the last boundary)
        self.loaders: dict[int, LoaderStats] = {}
        self._loader_of: dict[int, int] = {}  # id(iterator) -> its DataLoader's key, from DataLoader.__iter__
        # id(DataLoader) -> (a weak reference to it, its key): a loader built after another died may
        # reuse its id, and is still a new loader (a loop that builds one per epoch)
        self._loader_keys: dict[int, tuple[Any, int]] = {}
        self._next_key = 1
        self._last_id = 0  # id of the last iterator seen (never a reference: it must die with the job's loop)
        self._last_stats: LoaderStats | None = None
        self._iter_s = 0.0  # the last DataLoader.__iter__'s seconds, until the first batch it leads to

    # -- boundaries ----------------------------------------------------------------------------
    def start(self, now: float | None = None) -> None:
        """The first step starts now (a loop's first iteration), unless a fetch already started it."""
        if self.last is None:
            self.last = self.clock() if now is None else now

    def step(self, now: float | None = None) -> float | None:
        """A step boundary; returns the step's wall time (None for an untimed first step)."""
        if now is None:
            now = self.clock()
        self.steps += 1
        wall = None
        if self.paused_at is not None:  # a boundary inside a pause: the pause so far is not the step's
            self.paused_s += now - self.paused_at
            self.paused_at = now
        if self.last is not None:
            wall = now - self.last - self.paused_s
            if len(self.walls) < MAX_KEPT:
                if not self.walls:
                    self.first_timed = self.steps
                self.walls.append(wall)
                self.waits.append(self.wait)
                self.syncs.append(self.sync)
        self.last = now
        self.wait = self.sync = self.paused_s = 0.0
        return wall

    # -- inside a step -------------------------------------------------------------------------
    def waited(self, iterator: Any, t0: float, t1: float, first: bool) -> None:
        """The main process spent ``t0..t1`` in ``iterator.__next__`` (``first``: its first batch)."""
        ident = id(iterator)
        if ident == self._last_id:
            stats = self._last_stats
        else:
            key = self._loader_of.get(ident, ident)  # a loader's epochs share one entry
            stats = self.loaders.get(key)
            if stats is None:
                stats = self.loaders[key] = loader_stats(iterator)
            self._last_id, self._last_stats = ident, stats
        seconds = t1 - t0
        assert stats is not None
        stats.batches += 1
        stats.wait_s += seconds
        if first:
            stats.epochs += 1
            stats.epoch_start_wait_s += seconds + self._iter_s
            stats.iter_s += self._iter_s
            self._iter_s = 0.0
        if self.paused_at is not None:
            self.untimed_wait_s += seconds
            return
        if self.last is None:
            self.last = t0  # the job's first fetch starts its first step
        self.wait += seconds

    def iterated(self, loader: Any, seconds: float, iterator: Any = None) -> None:
        """``DataLoader.__iter__`` took ``seconds`` (workers started, or a persistent iterator reset)
        and returned ``iterator``."""
        self._iter_s += seconds
        if iterator is not None:
            if len(self._loader_of) > 4096:  # ids of iterators long gone
                self._loader_of.clear()
            self._loader_of[id(iterator)] = self._key(loader)
        self._last_id = 0  # a new iterator may reuse a dead one's id
        if self.paused_at is not None:
            self.untimed_wait_s += seconds
            return
        if self.last is None:
            self.last = self.clock() - seconds
        self.wait += seconds

    def _key(self, loader: Any) -> int:
        """A key per DataLoader object (never its id alone, see ``_loader_keys``)."""
        import weakref

        known = self._loader_keys.get(id(loader))
        if known is not None and known[0]() is loader:
            return known[1]
        key = self._next_key
        self._next_key += 1
        try:
            ref: Any = weakref.ref(loader)
        except TypeError:  # a loader class with __slots__ and no __weakref__: keep it alive instead
            ref = (lambda obj: lambda: obj)(loader)
        if len(self._loader_keys) > 4096:
            self._loader_keys = {k: v for k, v in self._loader_keys.items() if v[0]() is not None}
        self._loader_keys[id(loader)] = (ref, key)
        return key

    def synced(self, seconds: float) -> None:
        """Seconds in a synchronising call (backward, a blocking collective)."""
        if self.paused_at is None:
            self.sync += seconds

    # -- pauses (validation inside the training loop) ------------------------------------------
    def pause(self) -> None:
        if self.paused_at is None:
            self.paused_at = self.clock()

    def resume(self) -> None:
        if self.paused_at is not None:
            elapsed = self.clock() - self.paused_at
            self.paused_s += elapsed
            self.total_paused_s += elapsed
            self.paused_at = None

    @property
    def timed(self) -> int:
        return len(self.walls)

    def main_loader(self) -> LoaderStats | None:
        """The loader that delivered the most batches: the training loader. A job that builds a new
        loader for each epoch has several alike (same workers, dataset type): they count as one,
        whose ``built`` says how many there were."""
        if not self.loaders:
            return None
        single = max(self.loaders.values(), key=lambda s: s.batches)
        groups: dict[tuple[Any, ...], list[LoaderStats]] = {}
        for stats in self.loaders.values():
            if stats.epochs > 1:  # iterated again: built once
                continue
            kind = stats.dataset.kind if stats.dataset is not None else None
            groups.setdefault((stats.num_workers, stats.persistent, stats.context, kind), []).append(stats)
        best = max(groups.values(), key=lambda group: sum(s.batches for s in group), default=[])
        if len(best) < REBUILT or sum(s.batches for s in best) <= single.batches:
            return single
        first = best[0]
        merged = LoaderStats(first.num_workers, first.persistent, first.context, batch_size=first.batch_size,
                             dataset=first.dataset, built=len(best))
        for stats in best:
            merged.batches += stats.batches
            merged.wait_s += stats.wait_s
            merged.epochs += stats.epochs
            merged.epoch_start_wait_s += stats.epoch_start_wait_s
            merged.iter_s += stats.iter_s
        return merged
