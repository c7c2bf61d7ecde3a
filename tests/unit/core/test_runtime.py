"""A feature's state follows its verbs: the runtime moves a feature from armed to applied after its
activation hook returns only where the hook said nothing else. A ``ctx.not_applicable()`` said while
``activate`` runs (a registry watch told of a class registered earlier that does not fit) ends NOT
APPLICABLE, and the feature's other targets still activate while its watch is in force.

A planted plugin stands in for the registry features (no OpenMMLab); dag and bevfusion themselves,
through the runtime, are in tests/unit/ops_models/test_ops_models_states.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loongkit_core.feature import State
from loongkit_core.runtime import Runtime
from loongkit_core.testing import install_fake_plugin

PLANTED = '''
from loongkit_core.context import NotApplicable
from loongkit_core.feature import Category, Feature
from loongkit_core.kit import FeatureImpl, PluginSpec

plugin = PluginSpec("planted_states")
SEEN = []  # (feature, target) of every activation hook that ran


def _feature(name, targets):
    return Feature(name=name, env="LOONGKIT_" + name.upper(), level=1, category=Category.OTHER,
                   description="says something while activating", targets=targets)


class Watches(FeatureImpl):
    """A registry watch: an earlier class differs (not applicable), a later target's class fits (applied)."""

    def activate(self, ctx, target):
        SEEN.append((self.feature.name, target))
        ctx.patcher.defer(lambda: None)  # the watch stays in force until undo
        if target == "json":
            ctx.not_applicable("interface differs: json.Old")
        elif target == "csv":
            ctx.applied()


class Quiet(FeatureImpl):
    def activate(self, ctx, target):
        SEEN.append((self.feature.name, target))


class Waits(FeatureImpl):
    def activate(self, ctx, target):
        ctx.waiting("no CUDA device yet")


class Raises(FeatureImpl):
    def activate(self, ctx, target):
        SEEN.append((self.feature.name, target))
        ctx.patcher.defer(lambda: None)
        raise NotApplicable("target differs")


plugin.add(_feature("states_watch", ("json", "wave", "csv")), impl="planted_states:Watches")
plugin.add(_feature("states_quiet", ("json",)), impl="planted_states:Quiet")
plugin.add(_feature("states_wait", ("json",)), impl="planted_states:Waits")
plugin.add(_feature("states_raise", ("json", "wave")), impl="planted_states:Raises")
'''

ALL = {"LOONGKIT_STATES_WATCH": "1", "LOONGKIT_STATES_QUIET": "1", "LOONGKIT_STATES_WAIT": "1",
       "LOONGKIT_STATES_RAISE": "1"}


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loongkit_runtime: Callable[..., Runtime]
            ) -> tuple[Runtime, Any]:
    site = install_fake_plugin(tmp_path / "site", "planted_states", PLANTED, entry_point="planted_states:plugin")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(__import__("sys").modules, "planted_states", raising=False)
    rt = loongkit_runtime({**ALL, "LOONGKIT_DISABLE_PLUGINS": "data,monitor,numa,ops,precision"})
    import planted_states

    return rt, planted_states


def test_not_applicable_said_while_activating_stays(planted: tuple[Runtime, Any]) -> None:
    rt, _ = planted
    record = rt.records["states_watch"]
    assert record.state == State.ARMED
    rt.activate(record, "json")
    assert (record.state, record.reason) == (State.NOT_APPLICABLE, "interface differs: json.Old")
    assert record.applied_targets == ["json"]  # activated: its watch is in force


def test_a_feature_in_force_activates_on_its_other_targets(planted: tuple[Runtime, Any]) -> None:
    rt, module = planted
    record = rt.records["states_watch"]
    rt.activate(record, "json")
    rt.activate(record, "wave")  # says nothing: what it said before stays
    assert (record.state, record.reason) == (State.NOT_APPLICABLE, "interface differs: json.Old")
    rt.activate(record, "csv")  # a class that fits: applied again
    assert (record.state, record.reason) == (State.APPLIED, "")
    assert [t for name, t in module.SEEN if name == "states_watch"] == ["json", "wave", "csv"]
    rt.deactivate("states_watch")
    assert record.state == State.ARMED and len(rt.contexts["states_watch"].patcher) == 0
    rt.activate(record, "wave")
    assert (record.state, record.reason) == (State.APPLIED, "")


def test_nothing_said_is_applied_and_waiting_keeps_its_reason(planted: tuple[Runtime, Any]) -> None:
    rt, _ = planted
    quiet, waits = rt.records["states_quiet"], rt.records["states_wait"]
    rt.activate(quiet, "json")
    rt.activate(waits, "json")
    assert (quiet.state, quiet.reason) == (State.APPLIED, "")
    assert (waits.state, waits.reason) == (State.APPLIED, "no CUDA device yet")


def test_raised_not_applicable_is_undone_and_ends_the_feature(planted: tuple[Runtime, Any]) -> None:
    rt, module = planted
    record = rt.records["states_raise"]
    rt.activate(record, "json")
    assert (record.state, record.reason) == (State.NOT_APPLICABLE, "target differs")
    assert len(rt.contexts["states_raise"].patcher) == 0
    rt.activate(record, "wave")  # nothing in force: its other targets do not activate
    assert [t for name, t in module.SEEN if name == "states_raise"] == ["json"]
