"""The loongkit command line: features, doctor, info."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loongkit_core.testing import clean_environ, install_fake_plugin

LOONGKIT = shutil.which("loongkit") or str(Path(sys.executable).parent / "loongkit")
LAUNCHER = shutil.which("loongkit-run") or str(Path(sys.executable).parent / "loongkit-run")
SEED_VARIABLES = [
    "LOONGKIT_DATA_CONTAINER", "LOONGKIT_DATA_PREFETCH", "LOONGKIT_MMENGINE_DATA_PREFETCH", "LOONGKIT_IMNORMALIZE",
    "LOONGKIT_DISTORTION", "LOONGKIT_PYTORCH", "LOONGKIT_PAGE_CACHE_LIMIT", "LOONGKIT_NUMA_AFFINITY",
    "LOONGKIT_SUBCGROUPS", "LOONGKIT_CONFIG_GUARDS", "LOONGKIT_COMPILE_RESNET", "LOONGKIT_FUSED_ADAMW",
    "LOONGKIT_OPENVLA", "LOONGKIT_MMDET_MODULES", "LOONGKIT_DICE_LOSS", "LOONGKIT_DAG", "LOONGKIT_VOXELIZATION",
    "LOONGKIT_BEVFORMER", "LOONGKIT_UNIAD", "LOONGKIT_BEVFUSION", "LOONGKIT_HF_ACC_COMPILE",
    "LOONGKIT_DYNAMIC_SHAPE_FIX", "LOONGKIT_COMPILE_PI0PYTORCH", "LOONGKIT_DONATED_BUFFER_FIX", "LOONGKIT_ALLOW_TF32",
]
SEED_LEVELS = {"LOONGKIT_IMNORMALIZE": 3, "LOONGKIT_DISTORTION": 3, "LOONGKIT_PAGE_CACHE_LIMIT": 2,
               "LOONGKIT_SUBCGROUPS": 2, "LOONGKIT_VOXELIZATION": 3, "LOONGKIT_BEVFUSION": 3,
               "LOONGKIT_HF_ACC_COMPILE": 3}


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = clean_environ()
    full.update(env or {})
    return subprocess.run([LOONGKIT, *args], env=full, capture_output=True, text=True, timeout=120)


def test_features_lists_every_seed_variable_with_its_level() -> None:
    r = _run("features", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["env"]: row for row in json.loads(r.stdout)["features"]}
    for var in SEED_VARIABLES:
        assert var in rows, var
        assert rows[var]["level"] == SEED_LEVELS.get(var, 1), var
        assert rows[var]["applies_here"]  # "yes" or a reason
    assert rows["LOONGKIT_DONATED_BUFFER_FIX"]["applies_here"].startswith("not applicable: torch")


def test_features_text_and_enabled_marker() -> None:
    r = _run("features", env={"LOONGKIT_ALLOW_TF32": "1"})
    assert "LOONGKIT_ALLOW_TF32" in r.stdout and "[enabled now]" in r.stdout


def test_doctor(tmp_path: Path) -> None:
    r = _run("doctor", "--json", env={"LOONGKIT_ALL": "1", "LOONGKIT_SYSFS_ROOT": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["python"].startswith("3.") and report["versions"]["torch"].startswith("2.")
    assert report["settings"]["all"] == 1 and report["settings"]["sysfs_root"] == str(tmp_path)
    assert "allow_tf32" in report["enabled"]
    assert report["cpu_vendor"] == "unknown"  # an empty root: nothing to read, nothing raised


def test_info_shows_resolution_and_warnings() -> None:
    r = _run("info", "python", "train.py", env={"LOONGKIT_ALL": "1", "LOONGKIT_ALOW_TF32": "1"})
    assert r.returncode == 0
    assert "did you mean LOONGKIT_ALLOW_TF32?" in r.stdout
    assert "allow_tf32" in r.stdout and "will apply on import of torch" in r.stdout


# A third-party plugin as the author had it: an option model, and a second feature whose impl
# path has a typo (a boot-time fault).
THIRD_PARTY = '''
from pydantic_settings import SettingsConfigDict
from loongkit_core.feature import Category, Feature
from loongkit_core.kit import FeatureImpl, PluginSpec
from loongkit_core.settings import LoongkitSettings

plugin = PluginSpec("third")

class ChunkOptions(LoongkitSettings):
    model_config = SettingsConfigDict(env_prefix="LOONGKIT_THIRD_", extra="ignore")
    chunk: int = 1024

class Chunked(FeatureImpl):
    options = ChunkOptions

    def activate(self, ctx, target):
        ctx.count()

plugin.add(Feature(name="third", env="LOONGKIT_THIRD", level=1, category=Category.OTHER, description="chunks",
                   options=("LOONGKIT_THIRD_CHUNK",)), impl="third_plugin:Chunked")
plugin.add(Feature(name="typo", env="LOONGKIT_TYPO", level=1, category=Category.OTHER, description="typo'd impl"),
           impl="third_plugin_typo:Nope")
'''


@pytest.fixture
def third(tmp_path: Path) -> dict[str, str]:
    """The environment with the third-party plugin installed and logs in a temp directory."""
    site = install_fake_plugin(tmp_path / "site", "third_plugin", THIRD_PARTY, entry_point="third_plugin:plugin")
    return {"PYTHONPATH": str(site), "LOONGKIT_LOGDIR": str(tmp_path / "logs")}


def _logs(env: dict[str, str]) -> str:
    return "".join(p.read_text() for p in sorted(Path(env["LOONGKIT_LOGDIR"]).glob("*.log")))


def test_info_warns_about_an_invalid_option(third: dict[str, str]) -> None:
    """`loongkit-run --info` showed `chunk=1024` for LOONGKIT_THIRD_CHUNK=lots and no warning."""
    full = clean_environ()
    full.update(third, LOONGKIT_THIRD="1", LOONGKIT_THIRD_CHUNK="lots")
    r = subprocess.run([LAUNCHER, "--info", "python", "train.py"], env=full, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "warning: LOONGKIT_THIRD_CHUNK='lots' is invalid" in r.stdout and "the default 1024" in r.stdout
    assert "config: chunk=1024" in r.stdout


def test_empty_values_are_unset_everywhere(third: dict[str, str]) -> None:
    """`LOONGKIT_X=` means unset for core settings, switches and options alike: defaults, no warning."""
    r = _run("info", env={**third, "LOONGKIT_ALL": "1", "LOONGKIT_LOGLEVEL": "", "LOONGKIT_ACTIVATION_TIMEOUT": " ",
                          "LOONGKIT_ALLOW_TF32": "", "LOONGKIT_THIRD_CHUNK": "", "LOONGKIT_TYPO": "0"})
    assert r.returncode == 0, r.stderr
    assert "warning:" not in r.stdout, r.stdout
    assert "'loglevel': 'warning'" in r.stdout and "allow_tf32" in r.stdout and "config: chunk=1024" in r.stdout


@pytest.mark.parametrize("command", [["features"], ["info"], ["features", "--json"]])
def test_a_boot_fault_is_logged_once_to_the_log(third: dict[str, str], command: list[str]) -> None:
    """An impl path typo: one readable record in the log (LOONGKIT_LOGDIR), none on the terminal's stderr,
    and the command's own report names it once."""
    r = _run(*command, env={**third, "LOONGKIT_TYPO": "1"})
    assert r.returncode == 0, r.stderr
    assert "third_plugin_typo" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    logs = _logs(third)
    assert logs.count("plugin fault") == 1, logs
    assert "ModuleNotFoundError: No module named 'third_plugin_typo'" in logs
    if "--json" in command:
        assert [f["feature"] for f in json.loads(r.stdout)["faults"]] == ["typo"]
    else:  # one report line, naming where the traceback is
        lines = [line for line in r.stdout.splitlines() if "plugin third_plugin (loongkit_detect" in line]
        assert len(lines) == 1 and "traceback in " + str(Path(third["LOONGKIT_LOGDIR"])) in lines[0], r.stdout


def test_launcher_routes_a_boot_fault_to_the_process_log(third: dict[str, str], tmp_path: Path) -> None:
    """loongkit-run printed the fault as an escaped one-line traceback on the terminal although the process
    log goes to a file; now the command's own boot logs it there, once."""
    full = clean_environ()
    full.update(third, LOONGKIT_TYPO="1", LOONGKIT_THIRD="1", LOONGKIT_SUMMARY_JSON=str(tmp_path / "s.json"))
    r = subprocess.run([LAUNCHER, sys.executable, "-c", "print('user ran')"], env=full, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "user ran" in r.stdout
    assert "Traceback" not in r.stderr and "plugin fault" not in r.stderr, r.stderr
    logs = _logs(third)
    assert logs.count("plugin fault") == 1 and "third_plugin_typo" in logs, logs
    faults = json.loads((tmp_path / "s.json").read_text())["faults"]
    assert [f["feature"] for f in faults] == ["typo"]


def test_launcher_logs_a_launch_environment_fault(tmp_path: Path) -> None:
    """A fault in loongkit_launch_environment (which only the launcher runs) goes to the same log, once,
    and the command still runs without the variables."""
    source = THIRD_PARTY + '''
@plugin.launch_env
def broken(records, environ):
    raise RuntimeError("launch env boom")
'''
    site = install_fake_plugin(tmp_path / "site", "third_plugin", source, entry_point="third_plugin:plugin")
    full = clean_environ()
    full.update(PYTHONPATH=str(site), LOONGKIT_LOGDIR=str(tmp_path / "logs"), LOONGKIT_THIRD="1")
    r = subprocess.run([LAUNCHER, sys.executable, "-c", "print('user ran')"], env=full, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "user ran" in r.stdout, r.stderr
    assert "boom" not in r.stderr, r.stderr
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert logs.count("plugin fault") == 1 and "launch env boom" in logs and "Traceback" in logs, logs
    r = subprocess.run([LAUNCHER, sys.executable, "-c", "print('user ran')"], env={**full, "LOONGKIT_STRICT": "1"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and "launch env boom" in r.stderr and "user ran" not in r.stdout


def test_help_lists_the_plugins_subcommands() -> None:
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    for command in ("features", "doctor", "numa", "malloc-env"):
        assert command in r.stdout, r.stdout


def test_launch_environment_hooks_see_a_failed_feature_as_failed(tmp_path: Path) -> None:
    """The launcher's probe does not log boot faults, but still records them: a hook deciding on a
    feature's state (e.g. an allocator preload) must not see a feature whose detect raised as armed."""
    source = THIRD_PARTY + '''
@plugin.launch_env
def state(records, environ):
    return {"TYPO_STATE": next(r.state.value for r in records if r.feature.name == "typo")}
'''
    site = install_fake_plugin(tmp_path / "site", "third_plugin", source, entry_point="third_plugin:plugin")
    full = clean_environ()
    full.update(PYTHONPATH=str(site), LOONGKIT_LOGDIR=str(tmp_path / "logs"), LOONGKIT_TYPO="1")
    r = subprocess.run([LAUNCHER, sys.executable, "-c", "import os; print('state', os.environ['TYPO_STATE'])"],
                       env=full, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "state failed" in r.stdout, (r.stdout, r.stderr)
