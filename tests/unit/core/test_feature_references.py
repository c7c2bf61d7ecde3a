"""Cross-plugin feature references are checked handles: a plugin that names another plugin's feature
gets a ``FeatureRef`` from ``PluginSpec.refer``; the boot and the conformance check resolve it against
the referenced plugin's real declarations, so a misspelt name is a fault, not a silent no-op."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from loongkit_core.feature import Category, Feature, FeatureRecord, FeatureRef
from loongkit_core.hookspecs import ENTRY_POINT_GROUP
from loongkit_core.kit import PluginSpec
from loongkit_core.runtime import Runtime
from loongkit_core.testing import install_fake_plugin
from loongkit_core.testing.conformance import reference_problems

REFERRER = '''
from loongkit_core.feature import Category, Feature
from loongkit_core.kit import FeatureImpl, PluginSpec

plugin = PluginSpec("referrer")
plugin.add(Feature(name="referrer_own", env="LOONGKIT_REFERRER_OWN", level=1, category=Category.OTHER,
                   description="names other plugins' features"), impl="referrer:Impl")
GOOD = plugin.refer("data", "pytorch")
TYPO = plugin.refer("data", "pytorch_memory")
ABSENT = plugin.refer("not_installed_plugin", "anything")


class Impl(FeatureImpl):
    pass
'''


def _installed() -> set[str]:
    return {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _declared(name: str) -> list[str]:
    ep = next(ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name)
    return [f.name for f in ep.load().features]


@pytest.fixture
def referrer_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                     loongkit_runtime: Callable[..., Runtime]) -> Runtime:
    if "data" not in _installed():
        pytest.skip("loongkit-data is not installed here")
    site = install_fake_plugin(tmp_path / "site", "referrer", REFERRER, entry_point="referrer:plugin")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "referrer", raising=False)
    return loongkit_runtime({"LOONGKIT_REFERRER_OWN": "1", "LOONGKIT_DISABLE_PLUGINS": "monitor,numa,ops,precision"})


def test_a_misspelt_reference_is_a_boot_fault_naming_the_declared_feature(referrer_runtime: Runtime) -> None:
    faults = [f for f in referrer_runtime.manager.faults if f.where == "loongkit_feature_references"]
    assert [f.plugin for f in faults] == ["referrer"]  # the typo only: the good one and the absent plugin pass
    assert "'pytorch_memory' of plugin 'data'" in faults[0].error
    assert "did you mean 'pytorch'?" in faults[0].error
    assert referrer_runtime.records["referrer_own"].enabled  # the fault costs the plugin nothing else


def test_a_reference_to_a_plugin_not_installed_is_unresolved_not_a_fault() -> None:
    ref = FeatureRef("absent", "x")
    assert ref.problem({"data": ["pytorch"]}) is None
    assert ref.find([]) is None


def test_find_needs_the_declaring_plugin_too() -> None:
    feature = Feature(name="pytorch", env="LOONGKIT_PYTORCH", level=1, category=Category.DATA, description="d",
                      plugin="other")
    record = FeatureRecord(feature)
    assert FeatureRef("data", "pytorch").find([record]) is None
    assert FeatureRef("other", "pytorch").find([record]) is record


def test_conformance_fails_on_a_misspelt_reference_and_passes_the_real_ones() -> None:
    if "data" not in _installed():
        pytest.skip("loongkit-data is not installed here")
    spec = PluginSpec("someone", category=Category.OTHER)
    spec.refer("data", "pytorch_memory")
    spec.refer("data", "pytorch")
    problems = reference_problems(spec)
    assert len(problems) == 1 and "did you mean 'pytorch'?" in problems[0]


@pytest.mark.parametrize("holder", ["monitor"])
def test_every_first_party_reference_resolves_against_the_real_declarations(holder: str) -> None:
    """Built from the installed plugins' own declarations, not from a copy of the names."""
    installed = _installed()
    if holder not in installed:
        pytest.skip(f"{holder} is not installed here")
    ep = next(ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == holder)
    spec = ep.load()
    assert spec.references, "the monitor names other plugins' features through handles"
    checked = 0
    for ref in spec.references:
        if ref.plugin not in installed:
            continue
        assert ref.name in _declared(ref.plugin), ref
        checked += 1
    assert checked or not (installed - {holder})
    assert reference_problems(spec) == []
