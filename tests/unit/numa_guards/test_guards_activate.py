"""ConfigGuards activated in-process on fake trees: findings, once-per-node logging, APPLY_FIX, faults."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from loongkit_numa import guards

from loongkit_core import workers
from loongkit_core.context import NotApplicable
from loongkit_core.process import LAUNCHER, WORKER

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _restore_torch_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    before = torch.get_num_threads()
    monkeypatch.delenv(guards.WORKER_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    # torch allows set_num_interop_threads once per process: keep the real one out of this test process
    # (the subprocess test in test_guards_torchrun.py exercises it).
    monkeypatch.setattr(torch, "get_num_interop_threads", lambda: 1)
    monkeypatch.setattr(torch, "set_num_interop_threads", lambda n: None)
    yield
    torch.set_num_threads(before)


def _activate(impl: Any, ctx: Any) -> None:
    impl.activate(ctx, "torch")


def test_thread_variables_and_dataloader_warn_once(guard_ctx: Any) -> None:
    impl, ctx, log = guard_ctx(environ={"OMP_NUM_THREADS": "16"}, local_rank=0, lws=2, tree=dict(cpus="0-3"))
    try:
        _activate(impl, ctx)
        warnings = log.at("warning")
        assert warnings == ["config_guards: OMP_NUM_THREADS=16 x 2 local ranks = 32 > 4 CPUs available to this "
                            "node's job; suggest OMP_NUM_THREADS=2"]
        assert ctx.record.calls >= 1  # the thread check ran on the real torch runtime
        loader = torch.utils.data.DataLoader(list(range(4)), num_workers=8)
        torch.utils.data.DataLoader(list(range(4)), num_workers=8)  # the same finding again: not logged twice
        assert loader.num_workers == 8  # no APPLY_FIX: nothing changes
        dl_lines = [w for w in log.at("warning") if "DataLoader" in w]
        assert dl_lines == ["config_guards: DataLoader num_workers=8 x 2 local ranks = 16 > 4 CPUs available to "
                            "this node's job; suggest num_workers=2"]
        config = ctx.record.config
        assert config["cpu_budget"] == 4 and config["apply_fix"] is False
        assert len(config["findings"]) == 2
        handoff = json.loads(guards.os.environ[guards.WORKER_ENV])
        assert (handoff["cpus"], handoff["lws"], handoff["workers"]) == (4, 2, 8)
    finally:
        impl.deactivate(ctx)
    assert "__wrapped__" not in vars(torch.utils.data.DataLoader.__init__)  # patch undone
    calls = ctx.record.calls
    torch.utils.data.DataLoader(list(range(4)), num_workers=8)
    assert ctx.record.calls == calls


def test_other_local_ranks_stay_quiet_but_record(guard_ctx: Any) -> None:
    impl, ctx, log = guard_ctx(environ={"OMP_NUM_THREADS": "16"}, local_rank=1, lws=2, tree=dict(cpus="0-3"))
    try:
        _activate(impl, ctx)
        torch.utils.data.DataLoader(list(range(4)), num_workers=8)
        assert log.at("warning") == []
        assert len(ctx.record.config["findings"]) == 2
    finally:
        impl.deactivate(ctx)


def test_apply_fix(guard_ctx: Any) -> None:
    env = {"OMP_NUM_THREADS": "16", "LOONGKIT_CONFIG_GUARDS_APPLY_FIX": "1"}
    impl, ctx, log = guard_ctx(environ=env, local_rank=0, lws=2, tree=dict(cpus="0-7", cpu_max="200000 100000"))
    torch.set_num_threads(2)  # 2 x 2 ranks > 2 CPUs of quota
    try:
        _activate(impl, ctx)
        assert torch.get_num_threads() == 1
        assert guards.os.environ["OMP_NUM_THREADS"] == "1"
        plain = torch.utils.data.DataLoader(list(range(4)), num_workers=8)
        persistent = torch.utils.data.DataLoader(list(range(4)), num_workers=8, persistent_workers=True)
        assert plain.num_workers == 1  # 2 CPUs // 2 ranks
        assert persistent.num_workers == 1
        changes = ctx.record.config["changes"]
        assert "torch.set_num_threads(1) (was 2)" in changes
        assert "DataLoader num_workers 8 -> 1" in changes
        assert any("set OMP_NUM_THREADS 16 -> 1" in w for w in log.at("warning"))
    finally:
        impl.deactivate(ctx)


def test_apply_fix_keeps_one_worker_when_options_need_workers(guard_ctx: Any) -> None:
    env = {"LOONGKIT_CONFIG_GUARDS_APPLY_FIX": "yes"}
    impl, ctx, _ = guard_ctx(environ=env, local_rank=0, lws=4, tree=dict(cpus="0-1"))
    try:
        _activate(impl, ctx)
        assert torch.utils.data.DataLoader(list(range(4)), num_workers=4).num_workers == 0
        kept = torch.utils.data.DataLoader(list(range(4)), num_workers=4, prefetch_factor=2)
        assert kept.num_workers == 1  # prefetch_factor without workers would raise ValueError
        assert list(kept) == [torch.tensor([i]) for i in range(4)]
    finally:
        impl.deactivate(ctx)


def test_user_errors_in_dataloader_still_raise_from_torch(guard_ctx: Any) -> None:
    impl, ctx, _ = guard_ctx(local_rank=0, lws=1, tree=dict(cpus="0-1"))
    try:
        _activate(impl, ctx)
        with pytest.raises(ValueError, match="num_workers option should be non-negative"):
            torch.utils.data.DataLoader(list(range(4)), num_workers=-1)
        with pytest.raises(TypeError):
            torch.utils.data.DataLoader(list(range(4)), no_such_argument=1)
    finally:
        impl.deactivate(ctx)


def test_bad_apply_fix_value_is_default_with_warning(guard_ctx: Any) -> None:
    _, ctx, log = guard_ctx(environ={"LOONGKIT_CONFIG_GUARDS_APPLY_FIX": "maybe"}, tree=dict(cpus="0-1"))
    assert ctx.record.config.apply_fix is False
    assert any("LOONGKIT_CONFIG_GUARDS_APPLY_FIX='maybe' is invalid" in w for w in log.at("warning"))


def test_not_applicable_in_launchers(guard_ctx: Any) -> None:
    impl, ctx, _ = guard_ctx(role=LAUNCHER)
    assert impl.detect(ctx.env) == "nothing to check in a launcher process"
    impl, ctx, _ = guard_ctx()
    assert impl.detect(ctx.env) is None


def test_broken_dataloader_is_not_applicable(guard_ctx: Any) -> None:
    impl, ctx, _ = guard_ctx(local_rank=0, lws=1, tree=dict(cpus="0-1"))

    class OddLoader:
        def __init__(self, dataset: Any, workers: int = 0) -> None:
            self.dataset = dataset

    fake = types.SimpleNamespace(utils=types.SimpleNamespace(data=types.SimpleNamespace(DataLoader=OddLoader)))
    with pytest.raises(NotApplicable, match="no num_workers parameter"):
        impl._patch_dataloader(ctx, fake)
    assert "__wrapped__" not in vars(OddLoader.__init__)


def test_inductor_compile_threads(guard_ctx: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    impl, ctx, log = guard_ctx(environ={"LOONGKIT_CONFIG_GUARDS_APPLY_FIX": "1"}, local_rank=0, lws=2,
                               tree=dict(cpus="0-7"))
    config = types.ModuleType(guards.INDUCTOR_TARGET)
    config.compile_threads = 32  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, guards.INDUCTOR_TARGET, config)
    impl.activate(ctx, guards.INDUCTOR_TARGET)
    assert config.compile_threads == 4  # type: ignore[attr-defined]
    assert ("config_guards: inductor compile_threads=32 x 2 local ranks = 64 > 8 CPUs available to this node's "
            "job; suggest torch._inductor.config.compile_threads=4") in log.at("warning")
    config.compile_threads = None  # type: ignore[attr-defined]  # fbcode's lazy default: nothing to check
    with pytest.raises(NotApplicable, match="compile_threads is None"):
        impl.activate(ctx, guards.INDUCTOR_TARGET)


def test_real_inductor_config_is_checked(guard_ctx: Any) -> None:
    import torch._inductor.config as inductor_config

    impl, ctx, _ = guard_ctx(local_rank=0, lws=64, tree=dict(cpus="0-1"))
    impl.activate(ctx, guards.INDUCTOR_TARGET)
    value = inductor_config.compile_threads
    if value > 1:
        assert any("inductor compile_threads" in f for f in ctx.record.config["findings"])
    assert ctx.record.calls == 1


class FakeCv2(types.ModuleType):
    def __init__(self, threads: int) -> None:
        super().__init__("cv2")
        self.threads = threads

    def getNumThreads(self) -> int:
        return self.threads

    def setNumThreads(self, n: int) -> None:
        self.threads = n


def _handoff(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> None:
    data = {"cpus": 4, "mask": 4, "quota": None, "lws": 2, "workers": 4, "apply_fix": False, "logged": False}
    data.update(kw)
    monkeypatch.setenv(guards.WORKER_ENV, json.dumps(data))


def test_cv2_in_workers(monkeypatch: pytest.MonkeyPatch, recording_log: Any) -> None:
    RecordingLog = recording_log
    cv2 = FakeCv2(8)
    monkeypatch.setitem(sys.modules, "cv2", cv2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    _handoff(monkeypatch)
    log = RecordingLog()
    finding = guards.on_worker_start(0, log)
    assert finding is not None and cv2.threads == 8
    assert log.at("warning") == ["config_guards: OpenCV threads=8 in each of 4 DataLoader workers x 2 local ranks "
                                 "= 64 > 4 CPUs available to this node's job; suggest cv2.setNumThreads(1) in workers"]
    log2 = RecordingLog()
    guards.on_worker_start(3, log2)  # other workers and later epochs stay quiet
    monkeypatch.setenv("LOCAL_RANK", "1")
    guards.on_worker_start(0, log2)
    assert log2.at("warning") == []
    _handoff(monkeypatch, apply_fix=True)
    guards.on_worker_start(1, log2)
    assert cv2.threads == 1
    _handoff(monkeypatch, apply_fix=True)
    assert guards.on_worker_start(0, log2) is None  # already 1


def test_cv2_check_needs_cv2_and_a_handoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "cv2", raising=False)
    _handoff(monkeypatch)
    assert guards.on_worker_start(0, None) is None  # cv2 not imported in the worker: never imported by us
    assert "cv2" not in sys.modules
    monkeypatch.setitem(sys.modules, "cv2", FakeCv2(8))
    monkeypatch.setenv(guards.WORKER_ENV, "{garbled")
    assert guards.on_worker_start(0, None) is None


def test_worker_role_only_hooks_workers(guard_ctx: Any) -> None:
    impl, ctx, log = guard_ctx(role=WORKER, environ={"OMP_NUM_THREADS": "64"}, tree=dict(cpus="0-1"))
    impl.activate(ctx, "torch")
    assert ctx.record.config["findings"] == [] and log.at("warning") == []
    # Only the worker callback is recorded: nothing of torch is patched in a worker.
    assert ctx.patcher.patched == [] and len(ctx.patcher) == 1 and ctx.scratch.worker_hook
    assert [owner for owner, _ in workers._callbacks].count("config_guards") == 1
    impl.deactivate(ctx)
    assert len(ctx.patcher) == 0 and "config_guards" not in [owner for owner, _ in workers._callbacks]


# -- issue 17: the intra-op pool as the job sets it, not only at boot ----------------------------------
INTRA_SET = ("torch intra-op threads (torch.set_num_threads)=4 x 2 local ranks = 8 > 2 CPUs available to this "
             "node's job; suggest torch.set_num_threads(1)")


def test_intra_op_threads_set_after_boot(guard_ctx: Any) -> None:
    impl, ctx, log = guard_ctx(local_rank=0, lws=2, tree=dict(cpus="0-1"))
    torch.set_num_threads(1)  # nothing to find at boot
    try:
        _activate(impl, ctx)
        assert not any("intra-op" in f for f in ctx.record.config["findings"])
        torch.set_num_threads(4)  # the job's own call, after torch's import
        assert torch.get_num_threads() == 4  # no APPLY_FIX: the job's value stays
        assert INTRA_SET in ctx.record.config["findings"]
        assert log.at("warning").count(f"config_guards: {INTRA_SET}") == 1
        torch.set_num_threads(4)
        iter(torch.utils.data.DataLoader(list(range(4)), num_workers=0))
        assert log.at("warning").count(f"config_guards: {INTRA_SET}") == 1  # the same finding: logged once
    finally:
        impl.deactivate(ctx)


def test_intra_op_threads_checked_when_the_loader_iterates(guard_ctx: Any) -> None:
    """A pool set behind the patched function (a name bound before torch's import hook ran, a C++
    library): found when the DataLoader iterator is created."""
    impl, ctx, _ = guard_ctx(local_rank=0, lws=2, tree=dict(cpus="0-1"))
    torch.set_num_threads(1)
    set_directly = torch._C.set_num_threads  # what torch.set_num_threads is, unpatched
    try:
        _activate(impl, ctx)
        loader = torch.utils.data.DataLoader(list(range(4)), num_workers=0)
        set_directly(3)
        assert not any("intra-op" in f for f in ctx.record.config["findings"])
        iter(loader)
        assert ("torch intra-op threads (in force when a DataLoader iterated)=3 x 2 local ranks = 6 > 2 CPUs "
                "available to this node's job; suggest torch.set_num_threads(1)") in ctx.record.config["findings"]
    finally:
        impl.deactivate(ctx)


def test_apply_fix_clamps_the_jobs_intra_op_call_and_undo_restores_it(guard_ctx: Any) -> None:
    impl, ctx, _ = guard_ctx(environ={"LOONGKIT_CONFIG_GUARDS_APPLY_FIX": "1"}, local_rank=0, lws=2,
                             tree=dict(cpus="0-1"))
    torch.set_num_threads(1)
    original = torch.set_num_threads
    try:
        _activate(impl, ctx)
        torch.set_num_threads(4)
        assert torch.get_num_threads() == 1
        assert "torch.set_num_threads(1) (was 4)" in ctx.record.config["changes"]
    finally:
        impl.deactivate(ctx)
    assert torch.set_num_threads is original
    assert torch.get_num_threads() == 4  # what the job asked for, once loongkit's fix is undone


def test_default_deactivate_restores_and_reapplies(guard_ctx: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With APPLY_FIX every kind of change is made (thread variable, intra-op pool, DataLoader patches,
    the workers' handoff, inductor's compile_threads); the default deactivate (no override) puts each
    back, and activating again does it all again."""
    monkeypatch.setenv("OMP_NUM_THREADS", "16")  # what the fix rewrites for child processes
    impl, ctx, _ = guard_ctx(environ={"OMP_NUM_THREADS": "16", "LOONGKIT_CONFIG_GUARDS_APPLY_FIX": "1"},
                             local_rank=0, lws=2, tree=dict(cpus="0-1"))
    inductor = types.ModuleType(guards.INDUCTOR_TARGET)
    inductor.compile_threads = 32  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, guards.INDUCTOR_TARGET, inductor)
    torch.set_num_threads(2)
    loader_cls = torch.utils.data.DataLoader

    def state() -> tuple[Any, ...]:
        return (torch.set_num_threads, loader_cls.__dict__["__init__"], loader_cls.__dict__["__iter__"],
                guards.os.environ.get("OMP_NUM_THREADS"), guards.os.environ.get(guards.WORKER_ENV),
                torch.get_num_threads(), inductor.compile_threads)  # type: ignore[attr-defined]

    before = state()
    assert before[3:] == ("16", None, 2, 32)
    for _ in range(2):
        impl.activate(ctx, "torch")
        impl.activate(ctx, guards.INDUCTOR_TARGET)
        assert (torch.get_num_threads(), guards.os.environ["OMP_NUM_THREADS"], inductor.compile_threads) == (
            1, "1", 1)  # type: ignore[attr-defined]
        assert loader_cls(list(range(4)), num_workers=8).num_workers == 1
        assert json.loads(guards.os.environ[guards.WORKER_ENV])["workers"] == 1
        impl.deactivate(ctx)
        assert state() == before and len(ctx.patcher) == 0
