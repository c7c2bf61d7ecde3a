"""loongkit_core.replay: a process that reuses its job's resolution restores what the full boot decided
(records, policies, warnings and faults in their order) and confirms each restored feature (its plugin
loaded, its ``detect`` and ``configure`` run here) before its first activation."""

from __future__ import annotations

import marshal
from typing import Any

import pytest

from loongkit_core import resolved
from loongkit_core.feature import PolicyDecision, State
from loongkit_core.manager import LoongkitStrictError
from loongkit_core.runtime import Runtime

FAULT = ("planted", "loongkit_detect", "OSError: sysfs vanished", "Traceback ...", "c")


def resolution(booted: Any, feature: Any, **settings: str) -> resolved.Data:
    """What a full boot of a, b (not applicable) and c (its detect failed) writes, as read back."""
    rt = booted({"LOONGKIT_ALL": "1", **settings}, {}, (feature("a"), feature("b"), feature("c")))
    rt.records["a"].state, rt.records["a"].enabled, rt.records["a"].config = State.ARMED, True, {"k": 1}
    rt.records["b"].state, rt.records["b"].enabled, rt.records["b"].reason = State.NOT_APPLICABLE, True, "no device"
    rt.records["c"].enabled = True
    rt.policies["a"] = PolicyDecision("big machine", option_defaults={"k": 1})
    rt.boot_events = [("warning", "first warning", {}), ("fault", FAULT), ("warning", "second warning",
                                                                             {"feature": "a"})]
    data = marshal.loads(marshal.dumps(resolved.capture(rt, {"format": resolved.FORMAT}, {}, [])))
    data["path"] = "resolved/planted.bin"  # as resolved.load hands it over: where it was read
    return data


def replayed(data: resolved.Data) -> Runtime:
    rt = Runtime(environ={"LOONGKIT_ALL": "1"}, arm=False, resolution=data)
    rt.boot(configure_logging=False)
    return rt


def test_restore_gives_back_records_policies_warnings_and_faults_in_order(booted: Any, feature: Any) -> None:
    rt = replayed(resolution(booted, feature))
    assert [(r.feature.name, r.state, r.enabled, r.reason) for r in rt.records.values()] == [
        ("a", State.ARMED, True, ""), ("b", State.NOT_APPLICABLE, True, "no device"),
        ("c", State.FAILED, True, "loongkit_detect: OSError: sysfs vanished")]
    assert rt.records["a"].config == {"k": 1} and rt.records["a"].feature.plugin == "planted"
    assert rt.policies["a"].reason == "big machine" and rt.policies["a"].option_defaults == {"k": 1}
    assert rt.warnings == ["first warning", "second warning"]
    assert [(f.plugin, f.where, f.feature) for f in rt.manager.faults] == [("planted", "loongkit_detect", "c")]
    assert rt.boot_events == [("warning", "first warning", {}), ("fault", FAULT),
                              ("warning", "second warning", {"feature": "a"})]  # what it would write in turn
    assert rt._unconfirmed == {"a"}


def test_under_strict_the_first_replayed_fault_raises(booted: Any, feature: Any) -> None:
    data = resolution(booted, feature)
    rt = Runtime(environ={"LOONGKIT_ALL": "1"}, arm=False, resolution=data)
    rt.settings = resolved.SettingsSnapshot({**data["settings"], "strict": True})
    with pytest.raises(LoongkitStrictError, match="loongkit_detect"):
        rt.boot(configure_logging=False)
    assert rt.warnings == ["first warning"]


def test_confirm_loads_the_plugin_then_runs_detect_and_configure_once(booted: Any, feature: Any) -> None:
    rt = replayed(resolution(booted, feature))
    calls: list[str] = []
    rt.manager.ensure = lambda name: calls.append(f"ensure {name}") or True  # type: ignore[method-assign]

    def call_owner(plugin: str, hook: str, **kwargs: Any) -> Any:
        calls.append(hook)
        if hook == "loongkit_configure":
            assert kwargs["policy"] is rt.policies["a"]
            return {"k": 2}, ["first warning", "k raised to 2"]  # the resolution's own is not repeated
        return None

    rt.manager.call_owner = call_owner  # type: ignore[method-assign]
    record = rt.records["a"]
    assert rt._confirm(record) and rt._confirm(record)
    assert calls == ["ensure planted", "loongkit_detect", "loongkit_configure"]
    assert record.config == {"k": 2} and record.state == State.ARMED
    assert rt.warnings == ["first warning", "second warning", "k raised to 2"]
    assert rt._confirm(rt.records["b"])  # restored as not armed: nothing to confirm


def test_confirm_says_why_a_restored_feature_does_not_apply_here(booted: Any, feature: Any) -> None:
    rt = replayed(resolution(booted, feature))
    rt.manager.ensure = lambda name: True  # type: ignore[method-assign]
    rt.manager.call_owner = lambda plugin, hook, **kwargs: (  # type: ignore[method-assign]
        "no GPU in this worker" if hook == "loongkit_detect" else None)
    assert not rt._confirm(rt.records["a"])
    assert (rt.records["a"].state, rt.records["a"].reason) == (State.NOT_APPLICABLE, "no GPU in this worker")


def test_confirm_fails_a_feature_whose_plugin_does_not_load(booted: Any, feature: Any) -> None:
    rt = replayed(resolution(booted, feature))
    rt.manager.ensure = lambda name: False  # type: ignore[method-assign]
    assert not rt._confirm(rt.records["a"])
    assert (rt.records["a"].state, rt.records["a"].reason) == (State.FAILED, "plugin planted did not load")
