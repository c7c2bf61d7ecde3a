"""A broken plugin never stops the others nor the user's program; the Summary names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from loongkit_core.testing import install_fake_plugin

GOOD = '''
from loongkit_core.feature import Category, Feature
from loongkit_core.kit import FeatureImpl, PluginSpec

plugin = PluginSpec("good")

class Mark(FeatureImpl):
    def activate(self, ctx, target):
        import json
        ctx.patcher.patch(json, "dumps", ctx.counted(json.dumps))

plugin.add(Feature(name="good_feature", env="LOONGKIT_GOOD_FEATURE", level=1, category=Category.OTHER,
                   description="wraps json.dumps", targets=("json",)), impl="good_plugin:Mark")
'''

# A hand-written pluggy plugin (no kit) that raises in the hook named by BAD_HOOK.
BAD = '''
import os
from loongkit_core.feature import Category, Feature, PolicyDecision
from loongkit_core.hookspecs import hookimpl

WHERE = os.environ.get("BAD_HOOK", "")
FEATURE = Feature(name="bad_feature", env="LOONGKIT_BAD_FEATURE", level=1, category=Category.OTHER,
                  description="misbehaves", plugin="bad")

def _maybe(hook):
    if WHERE == hook:
        raise RuntimeError(f"boom in {hook}")

@hookimpl
def loongkit_declare_features():
    _maybe("declare")
    return [FEATURE]

@hookimpl
def loongkit_hardware_policy(hardware, features):
    _maybe("policy")
    return {}

@hookimpl
def loongkit_detect(feature, env):
    if feature.name == "bad_feature":
        _maybe("detect")
    return None

@hookimpl
def loongkit_configure(feature, env, policy):
    if feature.name == "bad_feature":
        _maybe("configure")
        return {"mode": "x"}, []
    return None

@hookimpl
def loongkit_activate(feature, target, ctx):
    if feature.name == "bad_feature":
        _maybe("activate")
        if WHERE == "hang":
            import time
            time.sleep(60)
        ctx.mark_active()

@hookimpl
def loongkit_summary(records):
    _maybe("summary")
    return ["bad plugin says hello"]
'''

USER = "import json; print('user', json.dumps([1]))"


@pytest.fixture
def site(tmp_path: Path) -> Path:
    site = install_fake_plugin(tmp_path / "site", "good_plugin", GOOD, entry_point="good_plugin:plugin")
    install_fake_plugin(site, "bad_plugin", BAD)
    return site


def _run(run_loongkit, site: Path, **env: str):  # type: ignore[no-untyped-def]
    full = {"PYTHONPATH": str(site), "LOONGKIT_GOOD_FEATURE": "1", "LOONGKIT_BAD_FEATURE": "1", **env}
    return run_loongkit(USER, full)


@pytest.mark.parametrize("hook", ["declare", "policy", "detect", "configure", "activate", "summary"])
def test_raising_hook_is_isolated(site: Path, run_loongkit, hook: str) -> None:  # type: ignore[no-untyped-def]
    r = _run(run_loongkit, site, BAD_HOOK=hook)
    assert r.returncode == 0, r.stderr
    assert "user [1]" in r.stdout and r.summaries_printed == 1
    assert r.feature("good_feature")["active"], "the other plugin's feature must still apply"
    faults = r.summary["faults"]  # type: ignore[index]
    assert any(f["plugin"] == "bad_plugin" and f"boom in {hook}" in f["error"] for f in faults), faults
    assert "Plugin faults:" in r.stdout and f"boom in {hook}" in r.stdout
    assert "Traceback" in r.logs()
    if hook in ("detect", "configure", "activate"):
        row = r.feature("bad_feature")
        assert row["state"] == "failed" and f"boom in {hook}" in row["reason"]


def test_healthy_plugins(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = _run(run_loongkit, site)
    assert r.summary["faults"] == []  # type: ignore[index]
    assert r.feature("bad_feature")["active"]
    assert "bad plugin says hello" in r.stdout


def test_hanging_activation_is_bounded(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = _run(run_loongkit, site, BAD_HOOK="hang", LOONGKIT_ACTIVATION_TIMEOUT="1")
    assert r.returncode == 0, r.stderr
    row = r.feature("bad_feature")
    assert row["state"] == "failed" and "LOONGKIT_ACTIVATION_TIMEOUT" in row["reason"]
    assert r.feature("good_feature")["active"]


@pytest.mark.parametrize(("entry", "source", "error"), [
    ("broken_plugin", "import no_such_module_xyz\n", "ModuleNotFoundError"),
    ("broken_plugin:nothing", "x = 1\n", "AttributeError"),
    ("broken_plugin:plugin", "class P:\n    LOONGKIT_CORE_API = (7, 9)\nplugin = P()\n", "core API"),
    ("broken_plugin", "raise SystemExit(4)\n", "SystemExit"),
])
def test_bad_entry_points(site: Path, run_loongkit, entry: str, source: str, error: str) -> None:  # type: ignore[no-untyped-def]
    install_fake_plugin(site, "broken_plugin", source, entry_point=entry)
    r = _run(run_loongkit, site)
    assert r.returncode == 0, r.stderr
    assert r.feature("good_feature")["active"]
    assert any(f["plugin"] == "broken_plugin" and error in f["error"] for f in r.summary["faults"])  # type: ignore[index]


def test_duplicate_feature_name(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    install_fake_plugin(site, "twin_plugin", GOOD.replace('PluginSpec("good")', 'PluginSpec("twin")')
                        .replace("good_plugin:Mark", "twin_plugin:Mark"), entry_point="twin_plugin:plugin")
    r = _run(run_loongkit, site)
    assert r.returncode == 0
    assert r.feature("good_feature")["plugin"] == "good_plugin"  # first (sorted) wins
    assert any("already declared" in f["error"] for f in r.summary["faults"])  # type: ignore[index]


@pytest.mark.parametrize("hook", ["declare", "activate"])
def test_strict_mode_fails_loudly(site: Path, run_loongkit, hook: str) -> None:  # type: ignore[no-untyped-def]
    r = _run(run_loongkit, site, BAD_HOOK=hook, LOONGKIT_STRICT="1")
    assert r.returncode != 0
    assert f"boom in {hook}" in r.stderr


def test_disable_plugins(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = _run(run_loongkit, site, BAD_HOOK="declare", LOONGKIT_DISABLE_PLUGINS="bad_plugin")
    assert r.summary["faults"] == []  # type: ignore[index]
    assert "bad plugin says hello" not in r.stdout  # not loaded: its hooks never ran
    assert [row["name"] for row in r.summary["features"]] == ["good_feature"]  # type: ignore[index]


def _summary_block(text: str) -> str:
    start = text.index("Loongkit Feature Summary")
    return text[start:text.index("\n" + "=" * 20, start)]


def test_disabled_plugin_is_named_not_misspelled(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    """Its feature's variable is not called unknown or misspelled; the log and the Summary say why nothing
    is enabled. (The plugin is not imported to learn its variables: entry-point metadata names none.)"""
    r = run_loongkit(USER, {"PYTHONPATH": str(site), "LOONGKIT_GOOD_FEATURE": "1",
                            "LOONGKIT_DISABLE_PLUGINS": "good_plugin, no_such_plugin"})
    assert r.returncode == 0, r.stderr
    logs = r.logs()
    assert "unknown variable" not in logs and "did you mean" not in logs, logs
    assert "plugin good_plugin disabled by LOONGKIT_DISABLE_PLUGINS" in logs
    block = _summary_block(r.stdout + logs)
    assert "plugin good_plugin disabled by LOONGKIT_DISABLE_PLUGINS" in block
    assert "LOONGKIT_GOOD_FEATURE" in block  # set, and read by no loaded plugin
    assert "LOONGKIT_DISABLE_PLUGINS names no_such_plugin" in logs  # a misspelled plugin name is said
    assert "good_plugin" not in "".join(f["plugin"] for f in r.summary["faults"])  # type: ignore[index]


def test_misspelling_still_caught_without_disabled_plugins(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = run_loongkit(USER, {"PYTHONPATH": str(site), "LOONGKIT_GOOD_FEATUR": "1", "LOONGKIT_ALL": "0"})
    assert "unknown variable LOONGKIT_GOOD_FEATUR; did you mean LOONGKIT_GOOD_FEATURE?" in r.logs()
