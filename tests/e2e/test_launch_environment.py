"""loongkit-run sets what enabled features need before the command starts (loongkit_launch_environment)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from loongkit_core.testing import install_fake_plugin

LAUNCHER = shutil.which("loongkit-run") or str(Path(sys.executable).parent / "loongkit-run")

PLUGIN = '''
from loongkit_core.feature import Category, Feature
from loongkit_core.kit import FeatureImpl, PluginSpec

plugin = PluginSpec("envdemo")

class Nothing(FeatureImpl):
    def activate(self, ctx, target):
        ctx.mark_active()

plugin.add(Feature(name="env_demo", env="LOONGKIT_ENV_DEMO", level=1, category=Category.OTHER,
                   description="needs variables at exec"), impl="env_plugin:Nothing")

@plugin.launch_env
def extra(records, environ):
    if any(r.feature.name == "env_demo" and r.enabled for r in records):
        return {"DEMO_LAUNCH_VAR": "from-plugin", "DEMO_USER_VAR": "from-plugin"}
    return {}
'''

SHOW = "import os; print('vars', os.environ.get('DEMO_LAUNCH_VAR'), os.environ.get('DEMO_USER_VAR'))"


def test_plugin_variables_reach_the_command_and_user_values_win(tmp_path: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    site = install_fake_plugin(tmp_path / "site", "env_plugin", PLUGIN, entry_point="env_plugin:plugin")
    env = {"PYTHONPATH": str(site), "LOONGKIT_ENV_DEMO": "1", "DEMO_USER_VAR": "mine"}
    r = run_loongkit(env=env, prelude=False, argv=[LAUNCHER, sys.executable, "-c", SHOW])
    assert r.returncode == 0, r.stderr
    assert "vars from-plugin mine" in r.stdout
    r = run_loongkit(env={**env, "LOONGKIT_ENV_DEMO": "0"}, prelude=False, argv=[LAUNCHER, sys.executable, "-c", SHOW])
    assert "vars None mine" in r.stdout


def _library(kind: str) -> str | None:
    from loongkit_data import allocator

    return allocator.find_library(kind)


@pytest.mark.parametrize("kind", ["jemalloc", "tcmalloc"])
def test_malloc_allocator_preloaded_by_the_launcher(kind: str, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    if _library(kind) is None:
        pytest.skip(f"{kind} is not installed (Debian: libjemalloc2 / libtcmalloc-minimal4)")
    code = f"print('mapped', any({kind[:5]!r} in line for line in open('/proc/self/maps')))"
    r = run_loongkit(env={"LOONGKIT_MALLOC": "1", "LOONGKIT_MALLOC_ALLOCATOR": kind}, prelude=False,
                     argv=[LAUNCHER, sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr
    assert "mapped True" in r.stdout
    row = r.feature("malloc")
    assert row["active"] and row["config"]["allocator"] == kind and row["config"]["preloaded"] is True
