"""The hot-path recorder on a scripted clock: step walls, data waits, sync time, pauses, epochs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from loongkit_monitor.recorder import StepRecorder, loader_stats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class FakeIter:
    """What the recorder reads of a ``_BaseDataLoaderIter`` (weak-referenceable, like the real one)."""

    def __init__(self, workers: int, persistent: bool, yielded: int) -> None:
        self._num_workers, self._persistent_workers, self._num_yielded = workers, persistent, yielded


def iterator(workers: int = 0, persistent: bool = False, yielded: int = 0) -> FakeIter:
    return FakeIter(workers, persistent, yielded)


def fetch(rec: StepRecorder, clock: Clock, it: FakeIter, seconds: float) -> None:
    t0 = clock()
    first = it._num_yielded == 0
    t1 = clock.advance(seconds)
    it._num_yielded += 1
    rec.waited(it, t0, t1, first)


def test_first_fetch_starts_the_first_step_and_waits_are_per_step() -> None:
    clock = Clock()
    rec = StepRecorder(clock)
    it = iterator()
    for wait, compute in ((0.5, 0.1), (0.02, 0.1), (0.03, 0.2)):
        fetch(rec, clock, it, wait)
        clock.advance(compute)
        rec.step()
    assert rec.steps == 3
    assert rec.first_timed == 1
    assert list(rec.walls) == pytest.approx([0.6, 0.12, 0.23])
    assert list(rec.waits) == pytest.approx([0.5, 0.02, 0.03])
    stats = rec.main_loader()
    assert stats is not None and stats.batches == 3 and stats.epochs == 1
    assert stats.epoch_start_wait_s == pytest.approx(0.5)


def test_without_a_fetch_the_first_boundary_only_starts_the_clock() -> None:
    clock = Clock()
    rec = StepRecorder(clock)
    clock.advance(5.0)  # model building: not a step
    assert rec.step() is None
    clock.advance(0.25)
    assert rec.step() == pytest.approx(0.25)
    assert rec.first_timed == 2 and list(rec.walls) == pytest.approx([0.25])


def test_pause_excludes_validation_and_its_data_waits() -> None:
    clock = Clock()
    rec = StepRecorder(clock)
    rec.start()
    clock.advance(0.1)
    rec.step()
    rec.pause()
    val = iterator()
    fetch(rec, clock, val, 2.0)  # the validation loader's wait belongs to no step
    clock.advance(3.0)
    rec.resume()
    clock.advance(0.1)
    rec.step()
    assert list(rec.walls) == pytest.approx([0.1, 0.1])
    assert list(rec.waits) == pytest.approx([0.0, 0.0])
    assert rec.total_paused_s == pytest.approx(5.0)
    assert rec.untimed_wait_s == pytest.approx(2.0)


def test_sync_time_counts_outside_pauses_only() -> None:
    clock = Clock()
    rec = StepRecorder(clock)
    rec.start()
    rec.synced(0.04)
    rec.pause()
    rec.synced(9.0)
    rec.resume()
    clock.advance(0.1)
    rec.step()
    assert list(rec.syncs) == pytest.approx([0.04])


def test_iterator_creation_is_data_wait_and_an_epoch_start() -> None:
    clock = Clock()
    rec = StepRecorder(clock)
    loader = object()
    for epoch in range(3):
        t0 = clock()
        clock.advance(0.4)  # workers start
        rec.iterated(loader, clock() - t0)
        it = iterator(workers=2)
        for _ in range(2):
            fetch(rec, clock, it, 0.01)
            clock.advance(0.1)
            rec.step()
        assert rec.loaders[id(it)].epochs == 1, epoch
    waits = list(rec.waits)
    assert waits[0] == pytest.approx(0.41) and waits[1] == pytest.approx(0.01) and waits[2] == pytest.approx(0.41)
    total_iter = sum(s.iter_s for s in rec.loaders.values())
    assert total_iter == pytest.approx(1.2)
    assert sum(s.epoch_start_wait_s for s in rec.loaders.values()) == pytest.approx(1.23)


def test_loader_stats_reads_the_iterator_defensively() -> None:
    stats = loader_stats(SimpleNamespace(_num_workers=3, _persistent_workers=True,
                                         _workers=[SimpleNamespace(_start_method="spawn")]))
    assert (stats.num_workers, stats.persistent, stats.context) == (3, True, "spawn")
    bare = loader_stats(object())
    assert (bare.num_workers, bare.persistent, bare.context) == (0, False, "")


def test_the_training_loader_is_the_one_with_most_batches() -> None:
    clock = Clock()
    rec = StepRecorder(clock)
    train, val = iterator(workers=4), iterator(workers=1)
    for _ in range(5):
        fetch(rec, clock, train, 0.01)
    fetch(rec, clock, val, 0.01)
    main = rec.main_loader()
    assert main is not None and main.num_workers == 4 and main.batches == 5


def test_a_loaders_epochs_share_one_entry_and_no_iterator_is_kept_alive() -> None:
    import gc
    import weakref

    clock = Clock()
    rec = StepRecorder(clock)
    loader = object()
    refs = []
    for _ in range(3):
        it = iterator(workers=2)
        rec.iterated(loader, 0.2, it)
        for _ in range(2):
            fetch(rec, clock, it, 0.01)
            rec.step()
        refs.append(weakref.ref(it))
        del it
    gc.collect()
    assert all(r() is None for r in refs)  # the job's iterators (and their workers) die when the job drops them
    stats = rec.main_loader()
    assert stats is not None and stats.epochs == 3 and stats.batches == 6
    assert stats.iter_s == pytest.approx(0.6)
