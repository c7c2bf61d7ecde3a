"""ActivationContext's per-activation API: worker callbacks (``ctx.on_worker_start`` / ``on_worker_exit``)
and the scratch space (``ctx.scratch``), both ended by the feature's undo (``ctx.patcher.undo()``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loongkit_core import workers
from loongkit_core.context import ActivationContext, Scratch
from loongkit_core.feature import Category, Feature

FEATURE = Feature(name="ctx_probe", env="LOONGKIT_CTX_PROBE", level=1, category=Category.OTHER,
                  description="a context probe")


@pytest.fixture
def ctx() -> Iterator[ActivationContext]:
    context = ActivationContext.standalone(FEATURE)
    try:
        yield context
    finally:
        context.patcher.undo()
        workers.uninstall()


def _registered() -> list:
    return [cb for _, cb in workers._callbacks] + [cb for _, cb in workers._exit_callbacks]


def _run_loader(tmp_path: Path, tag: str) -> None:
    """Iterate a one-worker forked DataLoader to the end (its loop returns: the exit callbacks run)."""
    from torch.utils.data import DataLoader

    loader = DataLoader(list(range(2)), batch_size=1, num_workers=1, multiprocessing_context="fork")
    assert [int(b) for b in loader] == [0, 1], tag


def _writer(tmp_path: Path, name: str) -> Callable[[int], None]:
    def callback(worker_id: int) -> None:
        with open(tmp_path / f"{name}-{os.getpid()}-{worker_id}", "w"):
            pass

    return callback


def _written(tmp_path: Path, name: str) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f"{name}-"))


# -- worker callbacks ----------------------------------------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked DataLoader workers")
def test_worker_callbacks_run_in_a_forked_worker_until_undo(ctx: ActivationContext, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    start, stop = _writer(tmp_path, "start"), _writer(tmp_path, "exit")
    ctx.on_worker_start(start)
    ctx.on_worker_exit(stop)
    assert start in _registered() and stop in _registered()
    assert len(ctx.patcher) == 2  # in force: each registration is undone with the feature

    _run_loader(tmp_path, "registered")
    started, exited = _written(tmp_path, "start"), _written(tmp_path, "exit")
    assert len(started) == 1 and started[0].endswith("-0") and f"-{os.getpid()}-" not in started[0]
    assert [name.replace("exit", "start") for name in exited] == started  # the same worker, at its end

    ctx.patcher.undo()  # the default deactivate
    assert start not in _registered() and stop not in _registered() and len(ctx.patcher) == 0
    _run_loader(tmp_path, "after undo")
    assert _written(tmp_path, "start") == started and _written(tmp_path, "exit") == exited

    ctx.on_worker_start(start)  # a later activation registers again
    _run_loader(tmp_path, "again")
    assert len(_written(tmp_path, "start")) == 2


def test_undo_removes_only_this_features_callbacks(ctx: ActivationContext) -> None:
    other = ActivationContext.standalone(FEATURE)
    mine, theirs = (lambda worker_id: None), (lambda worker_id: None)
    ctx.on_worker_start(mine)
    ctx.on_worker_start(mine)  # twice: both go
    other.on_worker_start(theirs)
    ctx.patcher.undo()
    assert _registered() == [theirs]
    assert [owner for owner, _ in workers._callbacks] == ["ctx_probe"]  # charged to the feature
    other.patcher.undo()
    assert _registered() == []


def test_undo_unregisters_even_when_another_change_fails(ctx: ActivationContext) -> None:
    def broken() -> None:
        raise RuntimeError("undo step failed")

    ctx.on_worker_exit(lambda worker_id: None)
    ctx.patcher.defer(broken)
    with pytest.raises(RuntimeError, match="undo step failed"):
        ctx.patcher.undo()
    assert _registered() == [] and len(ctx.patcher) == 0


def test_a_failing_worker_callback_never_breaks_the_worker_loop(ctx: ActivationContext) -> None:
    seen: list[int] = []

    def boom(worker_id: int) -> None:
        raise ValueError("feature bug")

    ctx.on_worker_start(boom)
    ctx.on_worker_start(seen.append)
    workers.run_callbacks(3)  # what the wrapped worker loop calls
    assert seen == [3] and any(owner == "ctx_probe" and isinstance(exc, ValueError) for owner, exc in workers._errors)
    workers._errors.clear()


def test_without_the_workers_module_registration_raises_and_leaves_nothing(
        ctx: ActivationContext, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "loongkit_core.workers", None)  # it cannot be imported
    with pytest.raises(ImportError):
        ctx.on_worker_start(lambda worker_id: None)
    with pytest.raises(ImportError):
        ctx.on_worker_exit(lambda worker_id: None)
    assert len(ctx.patcher) == 0


# -- scratch -------------------------------------------------------------------------------------------
def test_scratch_is_made_on_first_use_and_kept_for_the_activation(ctx: ActivationContext) -> None:
    assert ctx._scratch is None  # nothing made until a feature asks
    scratch = ctx.scratch
    assert isinstance(scratch, Scratch) and scratch.live and ctx.scratch is scratch
    scratch.seen = {"A"}
    assert ctx.scratch.seen == {"A"} and "seen={'A'}" in repr(scratch)
    assert len(ctx.patcher) == 0  # not a patch: the scratch alone keeps nothing in force


def test_scratch_is_dropped_at_undo_and_fresh_after(ctx: ActivationContext) -> None:
    scratch = ctx.scratch
    scratch.token = object()
    seen_at_undo: list[object] = []
    ctx.patcher.defer(lambda: seen_at_undo.append(scratch.token))  # undo steps still read it
    ctx.patcher.undo()
    assert seen_at_undo and not scratch.live and not hasattr(scratch, "token")
    fresh = ctx.scratch
    assert fresh is not scratch and fresh.live and not hasattr(fresh, "token")


def test_scratch_is_dropped_when_an_undo_step_fails(ctx: ActivationContext) -> None:
    scratch = ctx.scratch
    ctx.patcher.defer(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        ctx.patcher.undo()
    assert not scratch.live and ctx.scratch is not scratch


def test_a_callback_that_outlives_undo_sees_its_scratch_dead(ctx: ActivationContext) -> None:
    """The switch idiom: an import hook (cannot be unregistered) holding its activation's scratch does
    nothing after that activation's undo, even once a later activation is live."""
    calls: list[str] = []

    def activate() -> None:
        scratch = ctx.scratch
        hooks.append(lambda: calls.append("ran") if scratch.live else None)

    hooks: list = []
    activate()
    ctx.patcher.undo()
    activate()
    for hook in hooks:
        hook()
    assert calls == ["ran"]  # only the live activation's
