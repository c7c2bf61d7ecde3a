"""One resolution per job (loongkit_core.resolved): later processes reuse what the first resolved, and
still say and do what a full boot would; anything the resolution depended on changing means a full boot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loongkit_core.testing import clean_environ, install_fake_plugin, prelude_dir

# detect/configure/activate note themselves in DEMO_RECORD; detect reads DEMO_BLOCK (a variable) and
# DEMO_BLOCK_FILE (a file) through env.environ; configure leaves state that activate needs.
DEMO_PLUGIN = '''
import os
from loongkit_core.feature import Category, Feature
from loongkit_core.kit import FeatureImpl, PluginSpec

plugin = PluginSpec("demo")


def _note(hook):
    with open(os.environ["DEMO_RECORD"], "a") as fh:
        fh.write(f"{os.getpid()} {hook}\\n")


class Double(FeatureImpl):
    def detect(self, env):
        _note("detect")
        if env.environ.get("DEMO_BLOCK"):
            return "blocked by DEMO_BLOCK"
        if os.path.exists(env.environ.get("DEMO_BLOCK_FILE", "/nonexistent")):
            return "blocked by a file"
        return None

    def configure(self, env, policy):
        _note("configure")
        self.factor = 2
        return {"factor": 2}, ["demo option warning"]

    def activate(self, ctx, target):
        _note("activate")
        import demo_target
        original, factor = demo_target.compute, self.factor
        ctx.patcher.patch(demo_target, "compute", ctx.counted(lambda x: original(x) * factor))


plugin.add(Feature(name="demo_double", env="LOONGKIT_DEMO_DOUBLE", level=1, category=Category.OTHER,
                   description="doubles demo_target.compute", targets=("demo_target",)),
           impl="demo_plugin:Double")
'''

PROBE = ("import os, sys; print('pid', os.getpid()); "
         "print('loaded', [m for m in ('pydantic_settings', 'pluggy', 'importlib.metadata', 'demo_plugin') "
         "if m in sys.modules])\n")
USE = PROBE + "import demo_target; print('result', demo_target.compute(1))\n"


class Job:
    """Runs snippets with one fixed LOONGKIT_* environment (the resolution's key) in ``tmp``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.site = install_fake_plugin(tmp / "site", "demo_plugin", DEMO_PLUGIN, entry_point="demo_plugin:plugin")
        (self.site / "demo_target.py").write_text("def compute(x):\n    return x + 1\n")
        self.record = tmp / "hooks.txt"
        self.logs = tmp / "logs"
        self.summary = tmp / "summary.json"
        self.env = {**clean_environ(), "PYTHONPATH": os.pathsep.join([prelude_dir(), str(self.site)]),
                    "DEMO_RECORD": str(self.record), "LOONGKIT_DEMO_DOUBLE": "1", "LOONGKIT_LOGLEVEL": "info",
                    "LOONGKIT_LOGDIR": str(self.logs), "LOONGKIT_SUMMARY_JSON": str(self.summary)}

    def run(self, code: str = USE, script: Path | None = None, **extra: str) -> dict[str, Any]:
        self.summary.unlink(missing_ok=True)
        argv = [sys.executable, str(script)] if script is not None else [sys.executable, "-c", code]
        proc = subprocess.run(argv, env={**self.env, **extra}, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        pid = next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("pid "))
        log = "".join(p.read_text() for p in self.logs.glob(f"*-{pid}.log"))
        hooks = [line.split()[1] for line in self.record.read_text().splitlines() if line.split()[0] == pid] \
            if self.record.exists() else []
        summary = json.loads(self.summary.read_text()) if self.summary.exists() else None
        return {"stdout": proc.stdout, "log": log, "hooks": hooks, "summary": summary, "pid": pid}


def row(result: dict[str, Any], name: str = "demo_double") -> dict[str, Any]:
    return next(r for r in result["summary"]["features"] if r["name"] == name)


def reused(result: dict[str, Any]) -> bool:
    boot = next(line for line in result["log"].splitlines() if 'event="loongkit boot"' in line)
    return "resolution=/" in boot


@pytest.fixture
def job(tmp_path: Path) -> Job:
    return Job(tmp_path)


def test_a_later_process_reuses_the_resolution_and_resolves_its_feature_at_activation(job: Job) -> None:
    first, second = job.run(), job.run()
    assert not reused(first) and reused(second)
    assert "result 4" in first["stdout"] and "result 4" in second["stdout"]
    # Full boot: every hook at boot. Reused: nothing plugin-side until the target is imported, then
    # the feature's own detect and configure (configure's state is what activate uses) before activate.
    assert first["hooks"] == ["detect", "configure", "activate"] == second["hooks"]
    assert "loaded []" in second["stdout"], "pydantic-settings, pluggy, entry points or the plugin loaded at boot"
    assert "'demo_plugin'" in first["stdout"]
    for key in ("state", "active", "calls", "config", "reason", "enabled", "explicit"):
        assert row(first)[key] == row(second)[key], key
    assert row(second)["config"] == {"factor": 2}


def test_warnings_and_faults_are_replayed(job: Job) -> None:
    install_fake_plugin(job.site, "broken_plugin", "import no_such_module_xyz\n")
    extra = {"LOONGKIT_DEMO_DUBLE": "1", "LOONGKIT_STRICT": "maybe"}
    first, second = job.run(PROBE, **extra), job.run(PROBE, **extra)
    assert reused(second)
    for result in (first, second):
        assert "unknown variable LOONGKIT_DEMO_DUBLE; did you mean LOONGKIT_DEMO_DOUBLE?" in result["log"]
        assert "LOONGKIT_STRICT='maybe' is invalid" in result["log"]
        assert "demo option warning" in result["log"]
        assert "ModuleNotFoundError" in result["log"]
        faults = result["summary"]["faults"]
        assert [(f["plugin"], f["where"]) for f in faults] == [("broken_plugin", "load")], faults
    assert second["hooks"] == [], "the reusing process ran a plugin hook although nothing activated"


def test_an_edited_plugin_is_resolved_again(job: Job) -> None:
    job.run(PROBE)
    plugin = job.site / "demo_plugin.py"
    plugin.write_text(plugin.read_text().replace("doubles demo_target.compute", "doubles it, edited"))
    os.utime(plugin, ns=(plugin.stat().st_atime_ns, plugin.stat().st_mtime_ns + 10**9))
    again = job.run(PROBE)
    assert not reused(again) and again["hooks"] == ["detect", "configure"]


def test_a_variable_a_plugin_read_is_part_of_the_key(job: Job) -> None:
    assert row(job.run(PROBE))["state"] == "armed"
    blocked = job.run(PROBE, DEMO_BLOCK="1")
    assert not reused(blocked)
    assert row(blocked)["state"] == "not applicable" and row(blocked)["reason"] == "blocked by DEMO_BLOCK"
    assert reused(job.run(PROBE, DEMO_BLOCK="1")) and reused(job.run(PROBE))


def test_detect_runs_again_before_activation(job: Job) -> None:
    """What a reused resolution says is armed is detected again in this process before it activates."""
    block = job.tmp / "block"
    job.run(PROBE, DEMO_BLOCK_FILE=str(block))
    block.write_text("")
    result = job.run(DEMO_BLOCK_FILE=str(block))
    assert reused(result) and "result 2" in result["stdout"] and result["hooks"] == ["detect"]
    assert row(result)["state"] == "not applicable" and row(result)["reason"] == "blocked by a file"


def test_spawned_worker_inherits_its_mains_resolution(job: Job) -> None:
    code = PROBE + (
        "import multiprocessing as mp\n"
        "def work(q):\n"
        "    import os, demo_target\n"
        "    q.put((os.getpid(), demo_target.compute(1)))\n"
        "if __name__ == '__main__':\n"
        "    q = mp.get_context('spawn').Queue()\n"
        "    p = mp.get_context('spawn').Process(target=work, args=(q,))\n"
        "    p.start(); pid, value = q.get(timeout=120); p.join()\n"
        "    print('worker', pid, value, os.environ['_LOONGKIT_RESOLVED'])\n")
    script = job.tmp / "spawner.py"
    script.write_text(code)
    result = job.run(script=script)
    worker_pid, value, handoff = next(line.split()[1:] for line in result["stdout"].splitlines()
                                      if line.startswith("worker "))
    path, _, writer = handoff.rpartition(":")
    assert value == "4" and not reused(result) and path.endswith(".bin") and writer == result["pid"]
    worker_log = "".join(p.read_text() for p in job.logs.glob(f"*-{worker_pid}.log"))
    assert f"resolution={path}" in worker_log and "role=worker" in worker_log
    worker_hooks = [line.split()[1] for line in job.record.read_text().splitlines() if line.split()[0] == worker_pid]
    assert worker_hooks == ["detect", "configure", "activate"]


@pytest.mark.parametrize("extra", [{"LOONGKIT_RESOLVE_ONCE": "0"}, {"LOONGKIT_SYSFS_ROOT": "FAKE"}])
def test_switched_off_or_under_a_fake_sysfs_root(job: Job, extra: dict[str, str]) -> None:
    if "LOONGKIT_SYSFS_ROOT" in extra:
        (job.tmp / "sysfs").mkdir()
        extra = {"LOONGKIT_SYSFS_ROOT": str(job.tmp / "sysfs")}
    first, second = job.run(PROBE, **extra), job.run(PROBE, **extra)
    assert not reused(first) and not reused(second)
    assert second["hooks"] == ["detect", "configure"]


def test_a_reused_boot_imports_no_dataclasses_or_inspect(tmp_path: Path) -> None:
    # ~12 ms of a reused boot's imports until the core's records became plain classes (docs/benchmarks.md,
    # start-up); at the default log level no record is emitted, so structlog (which needs them) stays out.
    env = {**clean_environ(), "PYTHONPATH": prelude_dir(), "LOONGKIT_ALL": "1", "LOONGKIT_LOGDIR": str(tmp_path)}
    probe = "import sys; print('loaded', [m for m in ('dataclasses', 'inspect', 'typing') if m in sys.modules])"
    outs = [subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
            for _ in range(2)]  # the first boots in full and writes the resolution; the second reuses it
    assert all(o.returncode == 0 for o in outs), [o.stderr for o in outs]
    assert outs[1].stdout.strip().splitlines()[0] == "loaded []", outs[1].stdout
