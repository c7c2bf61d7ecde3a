"""loongkit_core.activity_gather: the runtime's side of activity across processes (the channel itself is
tested in tests/unit/core/test_activity.py and tests/e2e/test_activity.py): the signs that a process is a
training job, folding workers' counts in, a worker's reporter."""

from __future__ import annotations

import os
from typing import Any

import pytest

from loongkit_core import activity, activity_gather, runtime


def test_the_launcher_constant_is_the_runtimes() -> None:
    assert runtime.LAUNCHED_ENV is activity_gather.LAUNCHED_ENV == "_LOONGKIT_LAUNCHED"


def test_signs_of_a_training_job(booted: Any, feature: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(activity_gather.LAUNCHED_ENV, raising=False)
    rt = booted({}, {}, (feature("a"),))
    record = rt.records["a"]
    assert not rt.is_training_job()
    record.calls = record.activation_calls = 2  # calls made while activating are no sign
    assert not rt.is_training_job()
    record.calls = 3  # the program called it later
    assert rt.is_training_job()
    record.calls = 2
    record.worker_calls = 1
    assert rt.is_training_job()
    record.worker_calls = 0
    rt.optimizer_stepped = True
    assert rt.is_training_job()


def test_the_command_loongkit_run_started_is_one_once_it_imports_a_target(booted: Any, feature: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    rt = booted({}, {}, (feature("a"),))
    monkeypatch.setenv(activity_gather.LAUNCHED_ENV, str(rt.process.pid))
    assert not rt.is_training_job()
    rt.targets_seen.append("torch")
    assert rt.is_training_job()
    monkeypatch.setenv(activity_gather.LAUNCHED_ENV, str(rt.process.pid + 1))  # a child of that command
    assert not rt.is_training_job()


def test_without_a_channel_gathering_changes_nothing(booted: Any, feature: Any) -> None:
    rt = booted({}, {}, (feature("a"),))
    rt.records["a"].calls = 5
    assert rt.channel is None
    rt.gather_activity()
    assert (rt.records["a"].worker_calls, rt.records["a"].node) == (0, None) and not rt.records_have_node_view()
    rt.records["a"].node = {0: {"calls": 5}}
    assert rt.records_have_node_view()


def test_a_worker_reports_only_when_its_main_handed_a_channel(booted: Any, feature: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    rt = booted({}, {}, (feature("a"),))
    monkeypatch.delenv(activity.ENV, raising=False)
    rt._worker_started(0)
    assert rt._reporter is None
    rt._worker_stopping(0)  # nothing to stop


def test_a_main_gathers_its_workers_counts_through_its_channel(booted: Any, feature: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    rt = booted({}, {}, (feature("a"), feature("b")))
    monkeypatch.setenv(activity.ENV, "")  # _open_channel hands the channel to children through it
    rt._open_channel()
    if rt.channel is None:
        pytest.skip("no directory for the activity channel here")
    try:
        handoff = activity.parse_handoff(os.environ[activity.ENV])
        assert handoff is not None
        # a worker's report (its reporter thread and SIGTERM handler left out of this process)
        activity.WorkerReporter(handoff[0], handoff[1], 0, lambda: {"a": 7}, {}).flush()
        rt.gather_activity()
        assert (rt.records["a"].worker_calls, rt.records["a"].workers) == (7, 1)
        assert rt.records["b"].worker_calls == 0
    finally:
        rt.channel.close()
