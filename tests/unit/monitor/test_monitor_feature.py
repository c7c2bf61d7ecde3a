"""LOONGKIT_MONITOR in-process on the real torch: applies, undo, not applicable, broken targets, bad
options, loops marking the steps, max steps, and the report into the Summary."""

from __future__ import annotations

import sys
import time
from types import ModuleType
from typing import Any

import pytest

from loongkit_core.feature import State

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torch.utils.data import dataloader as dl  # noqa: E402

ON = {"LOONGKIT_MONITOR": "1"}
TORCH_TARGETS = ("torch.optim.optimizer", "torch.utils.data.dataloader", "torch.autograd", "torch.distributed",
                 "torch.nn.parallel.distributed")


class Sleepy(Dataset):
    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.seconds)
        return torch.ones(4)


def boot(loongkit_runtime: Any, environ: dict[str, str] | None = None, targets: tuple[str, ...] = TORCH_TARGETS) -> Any:
    rt = loongkit_runtime({**ON, **(environ or {})})
    record = rt.records["monitor"]
    for target in targets:
        rt.activate(record, target)
    return rt


def train(steps: int, fetch: float = 0.0, compute: float = 0.0) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for i, x in enumerate(DataLoader(Sleepy(steps * 2, fetch / 2), batch_size=2)):
        time.sleep(compute)
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i + 1 >= steps:
            break


def details(rt: Any) -> dict[str, Any]:
    rt.run_exit_callbacks()
    return rt.records["monitor"].details["monitor"]


def test_applies_counts_steps_and_reports(loongkit_runtime: Any) -> None:
    rt = boot(loongkit_runtime)
    record = rt.records["monitor"]
    assert record.state == State.APPLIED
    train(12, fetch=0.02, compute=0.02)
    assert record.calls == 12
    d = details(rt)
    assert d["steps"] == 12 and d["warm_steps"] == 11 and d["source"] == "optimizer AdamW.step"
    assert d["data_wait_share"] == pytest.approx(0.5, abs=0.15)
    assert d["workers"] == 0 and d["stopped_at_max_steps"] is False
    text = rt.summary_text()
    assert "Training monitor (rank 0; steps = optimizer AdamW.step)" in text
    assert "steps 12 (11 after warm-up)" in text


def test_default_deactivate_undoes_every_hook_and_it_applies_again(loongkit_runtime: Any) -> None:
    originals = (dl._BaseDataLoaderIter.__next__, dl.DataLoader.__iter__, torch.autograd.backward,
                 torch.distributed.all_reduce)
    rt = boot(loongkit_runtime)
    assert dl._BaseDataLoaderIter.__next__ is not originals[0]
    rt.deactivate("monitor")
    assert (dl._BaseDataLoaderIter.__next__, dl.DataLoader.__iter__, torch.autograd.backward,
            torch.distributed.all_reduce) == originals
    record = rt.records["monitor"]
    before = record.calls
    train(3)
    assert record.calls == before  # the optimizer hook is gone
    for target in TORCH_TARGETS:
        rt.activate(record, target)
    train(3)
    assert record.calls == before + 3


def test_not_applicable_off_linux(loongkit_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    rt = loongkit_runtime(ON)
    record = rt.records["monitor"]
    assert record.state == State.NOT_APPLICABLE
    assert "needs Linux" in record.reason


def test_an_optimizer_module_without_global_hooks_is_not_applicable(loongkit_runtime: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    rt = loongkit_runtime(ON)
    record = rt.records["monitor"]
    rt.activate(record, "torch.utils.data.dataloader")
    monkeypatch.setitem(sys.modules, "torch.optim.optimizer", ModuleType("torch.optim.optimizer"))
    rt.activate(record, "torch.optim.optimizer")
    assert record.state == State.NOT_APPLICABLE
    assert "register_optimizer_step_post_hook" in record.reason
    assert getattr(dl._BaseDataLoaderIter.__next__, "__wrapped__", None) is None  # the earlier patch undone


def test_a_broken_loop_module_loses_that_source_only(loongkit_runtime: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = ModuleType("mmengine.runner")
    broken.Runner = type("Runner", (), {})  # type: ignore[attr-defined]  # no call_hook: the interface differs
    monkeypatch.setitem(sys.modules, "mmengine.runner", broken)
    rt = boot(loongkit_runtime, targets=(*TORCH_TARGETS, "mmengine.runner"))
    record = rt.records["monitor"]
    assert record.state == State.APPLIED
    assert record.details["hooks"]["mmengine.runner"].startswith("not hooked: mmengine.runner.Runner has no call_hook")
    train(4)
    assert record.calls == 4  # optimizer steps still seen


def test_a_loop_marks_its_iterations_and_pauses_for_validation(loongkit_runtime: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class BaseRunner:
        def call_hook(self, fn_name: str) -> None:
            calls.append(fn_name)

    module = ModuleType("mmcv.runner")
    module.BaseRunner = BaseRunner  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mmcv.runner", module)
    rt = boot(loongkit_runtime, targets=(*TORCH_TARGETS, "mmcv.runner"))
    record = rt.records["monitor"]
    runner = BaseRunner()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for it in range(6):
        runner.call_hook("before_train_iter")
        time.sleep(0.01)
        if it % 2:  # gradient accumulation: an optimizer step every other iteration
            model(torch.ones(2)).sum().backward()
            opt.step()
        runner.call_hook("after_train_iter")
        if it == 2:
            runner.call_hook("before_val_epoch")
            time.sleep(0.3)
            runner.call_hook("after_val_epoch")
    assert calls.count("after_train_iter") == 6  # the original still runs
    assert record.calls == 6
    d = details(rt)
    assert d["source"] == "mmcv runner iterations" and d["steps"] == 6
    assert d["step_p90_s"] < 0.2  # validation's 0.3 s belongs to no step
    assert d["paused_s"] == pytest.approx(0.3, abs=0.1)


def test_max_steps_ends_with_systemexit_zero(loongkit_runtime: Any) -> None:
    rt = boot(loongkit_runtime, {"LOONGKIT_MONITOR_MAX_STEPS": "3"})
    with pytest.raises(SystemExit) as stop:
        train(10)
    assert stop.value.code == 0
    d = details(rt)
    assert d["steps"] == 3 and d["stopped_at_max_steps"] is True
    assert "stopped at LOONGKIT_MONITOR_MAX_STEPS" in rt.summary_text()


def test_bad_option_values_warn_and_default(loongkit_runtime: Any) -> None:
    rt = loongkit_runtime({**ON, "LOONGKIT_MONITOR_INTERVAL": "-1", "LOONGKIT_MONITOR_MAX_STEPS": "many"})
    config = rt.records["monitor"].config
    assert (config.interval, config.max_steps) == (0.0, 0)
    joined = "\n".join(rt.warnings)
    assert "LOONGKIT_MONITOR_INTERVAL='-1' is invalid" in joined
    assert "LOONGKIT_MONITOR_MAX_STEPS='many' is invalid" in joined
    rt2 = loongkit_runtime({**ON, "LOONGKIT_MONITOR_INTERVAL": "nan"})
    assert rt2.records["monitor"].config.interval == 0.0 and "LOONGKIT_MONITOR_INTERVAL='nan'" in "\n".join(
        rt2.warnings)


def test_progress_lines(loongkit_runtime: Any, capsys: pytest.CaptureFixture[str]) -> None:
    boot(loongkit_runtime, {"LOONGKIT_MONITOR_INTERVAL": "0.05"})
    train(8, compute=0.02)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("[loongkit monitor] step ")]
    assert lines and "per step (median of the last" in lines[0] and "data wait" in lines[0]


def test_no_steps_is_said_and_nothing_crashes(loongkit_runtime: Any) -> None:
    rt = boot(loongkit_runtime)
    torch.nn.Linear(2, 1)(torch.ones(2)).sum().backward()  # no optimizer
    d = details(rt)
    assert d["steps"] == 0 and d["step_median_s"] is None and d["recommendations"] == []
    assert rt.records["monitor"].reason.startswith("no steps seen")
    assert "Training monitor: no steps seen" in rt.summary_text()


def test_a_second_optimizer_does_not_double_the_steps(loongkit_runtime: Any) -> None:
    rt = boot(loongkit_runtime)
    record = rt.records["monitor"]
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.Adam(b.parameters(), lr=0.1)
    for _ in range(5):  # a GAN-like step: both step every iteration
        (a(torch.ones(2)).sum() + b(torch.ones(2)).sum()).backward()
        oa.step()
        ob.step()
    assert record.calls == 5
    for _ in range(4):  # the first one is gone (a new stage): the other takes over at its third step alone
        b(torch.ones(2)).sum().backward()
        ob.step()
    assert record.calls == 5 + 3  # (its step after the last shared iteration was the first)


def test_worker_callbacks_of_a_deactivated_monitor_do_nothing(loongkit_runtime: Any, tmp_path: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from loongkit_monitor.plugin import plugin

    rt = boot(loongkit_runtime)
    monitor = plugin.impl(rt.records["monitor"].feature).monitor
    monkeypatch.setenv("_LOONGKIT_ACTIVITY", f"{tmp_path}:4242")
    monitor.worker_started(0)  # live: a worker starts reporting
    assert monitor.sampler is not None and len(list(tmp_path.iterdir())) == 1
    monitor.worker_stopping(0)
    rt.deactivate("monitor")
    for path in tmp_path.iterdir():
        path.unlink()
    monitor.worker_started(0)
    assert monitor.sampler is None and list(tmp_path.iterdir()) == []


def test_a_subprocess_of_a_rank_gathers_nothing(loongkit_runtime: Any) -> None:
    """A Python subprocess of local rank 0 inherits RANK/LOCAL_RANK/LOCAL_WORLD_SIZE: it must neither
    publish as that rank nor wait at its exit for the node's other ranks."""
    from loongkit_monitor.plugin import plugin

    from loongkit_core import process as process_mod

    rt = loongkit_runtime({**ON, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    rt.process.role, rt.process.local_rank, rt.process.local_world_size = process_mod.SUBPROCESS, 0, 2
    rt.activate(rt.records["monitor"], "torch.optim.optimizer")
    monitor = plugin.impl(rt.records["monitor"].feature).monitor
    assert monitor.gatherer is None
    started = time.monotonic()
    d = details(rt)
    assert time.monotonic() - started < 2.0 and "ranks" not in d


def test_a_leak_freed_before_the_exit_is_still_named(loongkit_runtime: Any) -> None:
    """The report is built at exit, when the loop's locals (what it kept) may be freed already: memory is
    read at the last step boundary, or the fit bends and the leak goes unnamed (a CI run missed it so)."""
    rt = boot(loongkit_runtime)

    def leaky(steps: int) -> None:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        kept = []
        for _ in range(steps):
            loss = model(torch.ones(2, 4)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            kept.append(torch.ones(1 << 18))  # 1 MiB a step, freed when the loop returns
            time.sleep(0.04)

    leaky(72)
    d = details(rt)
    assert d["main_rss_growth_bytes"] >= 48 << 20
    assert d["main_rss_slope_r2"] >= 0.9
    kinds = [r["kind"] for r in d["recommendations"]]
    assert "memory_main" in kinds, d["recommendations"]
