"""The conformance check carries the seam rules: each fails for a planted plugin that breaks it (writes
its feature record or assigns a State, overrides deactivate, imports another plugin, reads the core's
runtime internals or a private name), and none fires for the forms plugins legitimately use (reading
records and states, the ActivationContext verbs, attributes of their own objects that share a record
field's name)."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from loongkit_core.testing import install_fake_plugin
from loongkit_core.testing.conformance import assert_conforms, plugin_problems

TEMPLATE = '''
import importlib
import sys

from loongkit_core.context import ActivationContext
from loongkit_core.feature import Category, Feature, State
from loongkit_core.kit import FeatureImpl, PluginSpec

plugin = PluginSpec("{name}")


class Impl(FeatureImpl):
    def activate(self, ctx, target):
{body}

{extra}

plugin.add(Feature(name="{name}_feature", env="LOONGKIT_{upper}_FEATURE", level=1, category=Category.OTHER,
                   description="planted"), impl="{name}:Impl")
'''


def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str = "pass",
            extra: str = "") -> list[str]:
    """The seam problems of a one-module plugin ``name`` whose activate runs ``body``."""
    source = TEMPLATE.format(name=name, upper=name.upper(), body=textwrap.indent(textwrap.dedent(body), " " * 8),
                             extra=textwrap.dedent(extra))
    site = install_fake_plugin(tmp_path / "site", name, source, entry_point=f"{name}:plugin")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, name, raising=False)  # a parametrized case before this one imported it
    importlib.invalidate_caches()
    return plugin_problems(name, imports=False)


@pytest.mark.parametrize("body, shown", [
    ("ctx.record.state = State.APPLIED", "writes the feature record (ctx.record.state)"),
    ("ctx.record.reason = 'mine'", "writes the feature record (ctx.record.reason)"),
    ("record = ctx.record\nrecord.state, record.reason = State.NOT_APPLICABLE, 'no'",
     "writes the feature record (record.state)"),
    ("rec = ctx.record\nrec.calls += 1", "writes the feature record (rec.calls)"),
    ("ctx.record.details['k'] = 1", "writes the feature record (ctx.record.details['k'])"),
    ("ctx.record.details.update(k=1)", "writes the feature record (ctx.record.details.update(...))"),
    ("ctx.record.applied_targets.append(target)", "writes the feature record (ctx.record.applied_targets.append"),
    ("setattr(ctx.record, 'state', None)", "writes the feature record (setattr(..., 'state'))"),
    ("del ctx.record.config", "writes the feature record (ctx.record.config)"),
])
def test_a_record_write_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, shown: str) -> None:
    problems = "\n".join(planted(tmp_path, monkeypatch, "seam_write", body))
    assert "seam_write: seam_write.py:" in problems and shown in problems, problems
    with pytest.raises(AssertionError, match="does not conform"):
        assert_conforms("seam_write", imports=False)


@pytest.mark.parametrize("body", ["verdict = State.FAILED", "self.last: State = State.ARMED",
                                  "import loongkit_core.feature as f\nmine = f.State.APPLIED"])
def test_a_state_assignment_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    problems = "\n".join(planted(tmp_path, monkeypatch, "seam_state", body))
    assert "assigns a State member" in problems, problems


def test_a_deactivate_override_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    extra = '''
    class Base(FeatureImpl):
        def deactivate(self, ctx):
            pass


    class Child(Base):
        def activate(self, ctx, target):
            pass


    plugin.add(Feature(name="seam_deact_child", env="LOONGKIT_SEAM_DEACT_CHILD", level=1, category=Category.OTHER,
                       description="planted"), impl="seam_deact:Child")
    '''
    problems = planted(tmp_path, monkeypatch, "seam_deact", extra=extra)
    found = [p for p in problems if "overrides deactivate" in p]
    assert len(found) == 1 and found[0].startswith("seam_deact: seam_deact_child: Base overrides deactivate "
                                                   "(seam_deact.py:"), problems
    assert found[0].endswith("): make every change through ctx.patcher, which the default deactivate undoes")


@pytest.mark.parametrize("body, module", [
    ("from loongkit_numa import cgroupfs", "loongkit_numa"),
    ("import loongkit_ops.patches.registry", "loongkit_ops.patches.registry"),
    ("importlib.import_module('loongkit_data.malloc')", "loongkit_data.malloc"),
    ("sys.modules.get('loongkit_monitor.feature')", "loongkit_monitor.feature"),
    ("import loongkit_someone_else", "loongkit_someone_else"),  # not installed here: still another plugin's
])
def test_importing_another_plugin_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str,
                                        module: str) -> None:
    problems = "\n".join(planted(tmp_path, monkeypatch, "seam_other", body))
    assert f"imports {module}, another loongkit plugin's package" in problems, problems


@pytest.mark.parametrize("body, shown", [
    ("from loongkit_core import runtime\nrecords = runtime.current().records",
     "uses loongkit_core.runtime.current: the core's runtime internals"),
    ("import loongkit_core.runtime", "imports loongkit_core.runtime: the core's runtime internals"),
    ("from loongkit_core.runtime import current", "imports loongkit_core.runtime: the core's runtime internals"),
    ("import loongkit_core\nloongkit_core.runtime.current()", "uses loongkit_core.runtime.current: the core's"),
    ("from loongkit_core import importhooks", "imports loongkit_core.importhooks: the core's runtime internals"),
    ("sys.modules['loongkit_core.resolved']", "imports loongkit_core.resolved: the core's runtime internals"),
    ("from loongkit_core.settings import _loaded", "loongkit_core.settings._loaded: a private name of the core"),
    ("from loongkit_core import activity\nactivity._handoff = None", "loongkit_core.activity._handoff: a private"),
])
def test_reading_the_runtime_internals_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str,
                                            shown: str) -> None:
    problems = "\n".join(planted(tmp_path, monkeypatch, "seam_internal", body))
    assert shown in problems, problems


def test_what_plugins_legitimately_do_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = '''
    from loongkit_core import activity, cgroupfs, log, workers
    from loongkit_core.workers import on_worker_start
    if ctx.record.state == State.APPLIED or ctx.state in (State.FAILED, State.NOT_APPLICABLE):
        return
    details = ctx.record.details  # read only
    ctx.count()
    ctx.detail("k", dict(details))
    ctx.waiting("no CUDA device yet")
    ctx.not_applicable("differs")
    ctx.applied()
    for feature in ctx.features():
        seen = (feature.state.value, feature.enabled, feature.reason)
    self.reason, self.state = "my own", "mine"
    self.calls = 0
    state = {}
    state["x"] = 1
    log.destination_kind(), activity.job_directory(), cgroupfs.cpu_quota("/"), workers, on_worker_start
    importlib.import_module("json")
    '''
    extra = '''
    @plugin.summary
    def lines(records):
        return [r.feature.name for r in records if r.state.value in ("applied", "active") and record_ok(r)]


    def record_ok(record):
        return record.reason != "x" and record.details.get("k") is None
    '''
    assert planted(tmp_path, monkeypatch, "seam_clean", body, extra) == []
