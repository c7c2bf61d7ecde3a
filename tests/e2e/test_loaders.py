"""The three ways to load loongkit, the fast path, and the Summary, in real subprocesses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loongkit_core.testing import clean_environ, install_fake_plugin, prelude_dir, run_snippet

LOONGKIT_RUN = shutil.which("loongkit-run") or str(Path(sys.executable).parent / "loongkit-run")

# A plugin whose feature patches a module of its own, so these tests need no torch.
DEMO_PLUGIN = '''
from loongkit_core.feature import Category, Feature
from loongkit_core.kit import FeatureImpl, PluginSpec

plugin = PluginSpec("demo")


class Double(FeatureImpl):
    def activate(self, ctx, target):
        import demo_target
        original = demo_target.compute
        ctx.patcher.patch(demo_target, "compute", ctx.counted(lambda x: original(x) * 2))
        ctx.set_config({"factor": 2})


plugin.add(Feature(name="demo_double", env="LOONGKIT_DEMO_DOUBLE", level=1, category=Category.OTHER,
                   description="doubles demo_target.compute", targets=("demo_target",)),
           impl="demo_plugin:Double")
'''


@pytest.fixture
def site(tmp_path: Path) -> Path:
    site = install_fake_plugin(tmp_path / "site", "demo_plugin", DEMO_PLUGIN, entry_point="demo_plugin:plugin")
    (site / "demo_target.py").write_text("def compute(x):\n    return x + 1\n")
    return site


def _env(site: Path, **extra: str) -> dict[str, str]:
    return {"PYTHONPATH": str(site), **extra}


USE = "import demo_target; print('result', demo_target.compute(1))"


def test_prelude_on_pythonpath(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = run_loongkit(USE, _env(site, LOONGKIT_DEMO_DOUBLE="1"))
    assert r.returncode == 0, r.stderr
    assert "result 4" in r.stdout
    assert r.summaries_printed == 1
    row = r.feature("demo_double")
    assert row["active"] and row["calls"] == 1 and row["config"] == {"factor": 2}
    assert "demo_double                    * {'factor': 2}" in r.stdout


def test_loongkit_run(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = run_loongkit(env=_env(site, LOONGKIT_ALL="1"), prelude=False,
                     argv=[LOONGKIT_RUN, sys.executable, "-c", USE])
    assert r.returncode == 0, r.stderr
    assert "result 4" in r.stdout and r.summaries_printed == 1
    assert r.feature("demo_double")["active"]


def test_import_all_after_target_was_imported(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    code = ("import demo_target\nimport os\nos.environ['LOONGKIT_DEMO_DOUBLE'] = '1'\n"
            "import loongkit_core.all\nprint('result', demo_target.compute(1))")
    r = run_loongkit(code, _env(site), prelude=False)
    assert r.returncode == 0, r.stderr
    assert "result 4" in r.stdout and r.summaries_printed == 1
    assert r.feature("demo_double")["targets"] == ["demo_target"]


def test_target_never_imported_is_armed(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = run_loongkit("print('hi')", _env(site, LOONGKIT_DEMO_DOUBLE="1"))
    row = r.feature("demo_double")
    assert not row["active"] and row["state"] == "armed" and "target not imported" in row["reason"]


def test_explicit_zero_beats_all(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = run_loongkit(USE, _env(site, LOONGKIT_ALL="3", LOONGKIT_DEMO_DOUBLE="off"))
    assert "result 2" in r.stdout
    with pytest.raises(KeyError):
        r.feature("demo_double")


def test_level_gate(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = run_loongkit(USE, _env(site, LOONGKIT_ALL="0", LOONGKIT_LOGLEVEL="debug"))
    assert "result 2" in r.stdout and r.summaries_printed == 0


def test_invalid_bool_reverts_to_default_with_warning(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = run_loongkit(USE, _env(site, LOONGKIT_DEMO_DOUBLE="maybe"))
    assert "result 2" in r.stdout
    assert "LOONGKIT_DEMO_DOUBLE='maybe' is invalid" in r.logs()


def test_did_you_mean(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = run_loongkit(USE, _env(site, LOONGKIT_DEMO_DUOBLE="1"))
    assert "unknown variable LOONGKIT_DEMO_DUOBLE; did you mean LOONGKIT_DEMO_DOUBLE?" in r.logs()


def test_user_sitecustomize_runs_exactly_once(site: Path, tmp_path: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    user = tmp_path / "user_site"
    user.mkdir()
    marker = tmp_path / "marker"
    (user / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'a').write('ran\\n')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(user)]), "LOONGKIT_DEMO_DOUBLE": "1"}
    r = run_loongkit(USE, env)
    assert r.returncode == 0, r.stderr
    assert marker.read_text() == "ran\n"
    assert "result 4" in r.stdout
    # Without any LOONGKIT_ variable the user's still runs, once.
    marker.unlink()
    r = run_loongkit("print('plain')", {"PYTHONPATH": str(user)})
    assert marker.read_text() == "ran\n" and "plain" in r.stdout


def test_prelude_twice_and_nested_launcher_load_once(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    env = _env(site, LOONGKIT_DEMO_DOUBLE="1", LOONGKIT_LOGLEVEL="info")
    env["PYTHONPATH"] = os.pathsep.join([prelude_dir(), str(site), prelude_dir()])
    code = "import loongkit_core.all\n" + USE
    r = run_loongkit(env=env, argv=[LOONGKIT_RUN, LOONGKIT_RUN, sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr
    assert "result 4" in r.stdout and r.summaries_printed == 1
    assert r.logs().count('event="loongkit boot"') == 1


def test_fast_path_imports_nothing_heavy(tmp_path: Path) -> None:
    code = ("import sys; heavy = [m for m in ('pydantic', 'structlog', 'pluggy', 'torch', 'loongkit_core.runtime') "
            "if m in sys.modules]; print('heavy', heavy)")
    for extra in ({}, {"LOONGKIT_LOGLEVEL": "debug", "LOONGKIT_ALL": "0", "LOONGKIT_ALLOW_TF32": "0"}):
        r = run_snippet(code, extra, tmp=tmp_path / str(len(extra)))
        assert "heavy []" in r.stdout, (extra, r.stdout, r.stderr)
        assert r.summaries_printed == 0 and r.summary is None


@pytest.mark.parametrize(("code", "expected_rc"), [
    ("import demo_target; demo_target.compute(1); import sys; sys.exit(3)", 3),
    ("import demo_target; demo_target.compute(1); raise ValueError('user bug')", 1),
    ("import demo_target; demo_target.compute(1); import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -15),
    ("import demo_target; demo_target.compute(1); raise KeyboardInterrupt", -2),  # Python re-raises SIGINT
])
def test_user_exit_codes_preserved_and_summary_once(site: Path, run_loongkit, code: str,  # type: ignore[no-untyped-def]
                                                    expected_rc: int) -> None:
    r = run_loongkit(code, _env(site, LOONGKIT_DEMO_DOUBLE="1"))
    assert r.returncode == expected_rc, r.stderr
    assert r.summaries_printed == 1
    assert r.feature("demo_double")["active"]


def test_os_exit_skips_summary_but_keeps_code(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = run_loongkit("import os; os._exit(7)", _env(site, LOONGKIT_DEMO_DOUBLE="1"))
    assert r.returncode == 7 and r.summaries_printed == 0


def test_launcher_passes_exit_code_and_info(site: Path) -> None:
    env = clean_environ()
    env.update(_env(site, LOONGKIT_DEMO_DOUBLE="1", LOONGKIT_LOGDIR="stderr"))
    r = subprocess.run([LOONGKIT_RUN, sys.executable, "-c", "import sys; sys.exit(5)"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 5
    r = subprocess.run([LOONGKIT_RUN, "--info", "python", "train.py"], env=env, capture_output=True, text=True)
    assert r.returncode == 0
    assert "demo_double" in r.stdout and "will apply on import of demo_target" in r.stdout
    r = subprocess.run([LOONGKIT_RUN, "no-such-command-xyz"], env=env, capture_output=True, text=True)
    assert r.returncode == 127


def test_prelude_path_commands() -> None:
    out = subprocess.run([sys.executable, "-m", "loongkit_core.prelude"], capture_output=True, text=True).stdout
    assert out.strip() == prelude_dir() and (Path(out.strip()) / "sitecustomize.py").exists()
    loongkit = shutil.which("loongkit") or str(Path(sys.executable).parent / "loongkit")
    out = subprocess.run([loongkit, "prelude-path"], capture_output=True, text=True).stdout
    assert out.strip() == prelude_dir()


def test_python_subprocess_of_main_does_not_print_a_second_summary(site: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    code = ("import subprocess, sys\n" + USE + "\n"
            "subprocess.run([sys.executable, '-c', 'import demo_target; print(\"child\", demo_target.compute(1))'])")
    r = run_loongkit(code, _env(site, LOONGKIT_DEMO_DOUBLE="1"))
    assert r.returncode == 0, r.stderr
    assert "result 4" in r.stdout and "child 4" in r.stdout  # features apply in the child too
    assert r.summaries_printed == 1
    assert sum("Loongkit Feature Summary" in p.read_text() for p in r.logdir.glob("*.log")) == 2


EXIT_PLUGIN = DEMO_PLUGIN.replace('''        ctx.set_config({"factor": 2})''', '''        ctx.set_config({"factor": 2})
        ctx.at_exit(lambda: ctx.detail("cleaned", True))''')


@pytest.mark.parametrize("ending", ["pass", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"])
def test_exit_callbacks_run_before_the_summary(tmp_path: Path, run_loongkit, ending: str) -> None:  # type: ignore[no-untyped-def]
    site = install_fake_plugin(tmp_path / "s", "demo_plugin", EXIT_PLUGIN, entry_point="demo_plugin:plugin")
    (site / "demo_target.py").write_text("def compute(x):\n    return x + 1\n")
    r = run_loongkit(USE + "\n" + ending, _env(site, LOONGKIT_DEMO_DOUBLE="1"))
    assert r.feature("demo_double")["details"] == {"cleaned": True}
    assert r.summaries_printed == 1


def test_full_boot_imports_no_target_library(tmp_path: Path) -> None:
    """LOONGKIT_ALL=3 resolves every feature of every plugin without importing what they patch."""
    code = ("import sys; print('targets', [m for m in ('torch', 'numpy', 'mmcv', 'mmdet', 'mmengine', 'cv2', "
            "'transformers', 'triton') if m in sys.modules])")
    r = run_snippet(code, {"LOONGKIT_ALL": "3"}, tmp=tmp_path)
    assert "targets []" in r.stdout, r.stdout + r.stderr
    # It trained nothing (no target imported): the Summary goes to its log, not to its stdout.
    assert r.summaries_printed == 0 and "Loongkit Feature Summary" in r.logs()
