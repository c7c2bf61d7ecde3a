"""The seed's Quick Start, typed as its documentation shows, loads loongkit (issue 23: the seed's names work).

  1. ``pip install loongkit``: the meta distribution in meta/loongkit (the core and the five plugins);
  2. ``PYTHONPATH=<site-packages>/loongkit/prelude/:$PYTHONPATH LOONGKIT_ALL=1 <your_training_command>``;
  3. ``LOONGKIT_ALL=1 loongkit-run <your_training_command>``;
  4. ``import loongkit.all`` at the top of the entry script.

Each line runs through a shell, verbatim but for the site-packages path, which is obtained as the seed
says (``python3 -c "import site; print(site.getsitepackages()[0])"``, with this venv's python). The
path recipe needs the meta package installed as a real package (an editable install has no
``<site-packages>/loongkit/prelude/``): ``pip install --no-deps ./meta/loongkit``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from loongkit_core.testing import RunResult, prelude_dir, run_snippet

ROOT = Path(__file__).resolve().parents[2]
META = ROOT / "meta" / "loongkit"
BIN = Path(sys.executable).parent
INSTALL = "pip install --no-deps ./meta/loongkit"
FIRST_PARTY = ("loongkit-core", "loongkit-data", "loongkit-monitor", "loongkit-numa", "loongkit-ops",
               "loongkit-precision")

# The user's training command: a few AdamW steps on a Linear model.
TRAIN = """\
import torch

model = torch.nn.Linear(8, 2)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _ in range(3):
    optimizer.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
print("trained")
"""

# As in test_loaders.test_fast_path_imports_nothing_heavy.
HEAVY = ("pydantic", "structlog", "pluggy", "torch", "loongkit_core.runtime")
HEAVY_PROBE = f"import sys; print('heavy', [m for m in {HEAVY!r} if m in sys.modules])"


def site_packages() -> Path:
    """The seed's way to find the prelude's parent, run with this venv's python."""
    out = subprocess.run([sys.executable, "-c", "import site; print(site.getsitepackages()[0])"],
                         capture_output=True, text=True, check=True).stdout
    return Path(out.strip())


def seed_prelude() -> Path:
    """``<site-packages>/loongkit/prelude/``; skips when the meta package is not installed there for real."""
    prelude = site_packages() / "loongkit" / "prelude"
    if not (prelude / "sitecustomize.py").is_file():
        pytest.skip(f"no {prelude}/sitecustomize.py: the seed's path recipe needs the meta package installed as "
                    f"a real (non-editable) package: {INSTALL}")
    return prelude


def needs_meta() -> None:
    try:
        metadata.distribution("loongkit")
    except metadata.PackageNotFoundError:
        pytest.skip(f"the loongkit meta distribution is not installed: {INSTALL}")


def shell(line: str, tmp: Path, script: str = TRAIN, **env: str) -> RunResult:
    """Run ``line`` through bash in ``tmp`` (holding train.py), as a user types it; the venv's bin first on
    PATH (``loongkit-run``, ``python``) and info-level logs, to count boots."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "train.py").write_text(script)
    path = os.pathsep.join([str(BIN), os.environ.get("PATH", "")])
    return run_snippet("", {"PATH": path, "LOONGKIT_LOGLEVEL": "info", **env}, tmp=tmp, prelude=False,
                       argv=["bash", "-c", line], cwd=str(tmp))


def assert_loaded_once(r: RunResult) -> None:
    """Trained, with the Feature Summary printed once (fused_adamw starred) and one boot in the log."""
    assert r.returncode == 0, r.stderr
    assert "trained" in r.stdout
    assert r.summaries_printed == 1, r.stdout
    assert re.search(r"^fused_adamw +\* ", r.stdout, re.MULTILINE), r.stdout
    assert r.feature("fused_adamw")["active"]
    assert r.logs().count('event="loongkit boot"') == 1, r.logs()


def test_pip_install_loongkit_brings_the_core_and_plugins() -> None:
    """Quick Start line 1: the distribution is named loongkit and requires what it is made of."""
    needs_meta()
    requires = {Requirement(line).name: Requirement(line) for line in metadata.requires("loongkit") or []}
    assert sorted(requires) == sorted(FIRST_PARTY)
    for name, requirement in requires.items():
        assert requirement.specifier.contains(metadata.version(name)), (name, requirement)
    # loongkit-run comes with the core: there is no second launcher to keep in step.
    scripts = {ep.name: ep.value for ep in metadata.distribution("loongkit-core").entry_points
               if ep.group == "console_scripts"}
    assert scripts["loongkit-run"] == "loongkit_core.launcher:main"


def test_wheel_ships_the_prelude(tmp_path: Path) -> None:
    """The non-editable install puts loongkit/prelude/sitecustomize.py under site-packages, with the marker that
    makes loongkit_core's prelude skip that directory: both are in the wheel."""
    pytest.importorskip("setuptools")
    source = tmp_path / "src"
    shutil.copytree(META, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("loongkit-0.1.0-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"loongkit/__init__.py", "loongkit/all.py", "loongkit/prelude/__init__.py",
            "loongkit/prelude/sitecustomize.py", "loongkit/prelude/LOONGKIT_PRELUDE"} <= names, names


def test_seed_pythonpath_recipe(tmp_path: Path) -> None:
    """Quick Start line 2, verbatim with the path the seed says to look up."""
    seed_prelude()
    sp = shlex.quote(str(site_packages()))
    line = f"PYTHONPATH={sp}/loongkit/prelude/:$PYTHONPATH LOONGKIT_ALL=1 python train.py"
    assert_loaded_once(shell(line, tmp_path))


def test_seed_pythonpath_recipe_without_variables_stays_light(tmp_path: Path) -> None:
    """On PYTHONPATH with no LOONGKIT_* variable (the seed: "by default, it does not enable any optimization
    features"), or with only passive ones, the seed's prelude imports nothing heavy and prints nothing."""
    seed_prelude()
    sp = shlex.quote(str(site_packages()))
    for variables in ("", "LOONGKIT_LOGLEVEL=debug LOONGKIT_ALL=0 "):
        r = shell(f"PYTHONPATH={sp}/loongkit/prelude/:$PYTHONPATH {variables}python train.py",
                  tmp_path / str(len(variables)), script=HEAVY_PROBE)
        assert r.returncode == 0, r.stderr
        assert "heavy []" in r.stdout, (variables, r.stdout, r.stderr)
        assert r.summaries_printed == 0 and r.summary is None


def test_loongkit_run(tmp_path: Path) -> None:
    """Quick Start line 3: the core's launcher, installed with the meta package."""
    needs_meta()
    assert (BIN / "loongkit-run").exists()
    assert_loaded_once(shell("LOONGKIT_ALL=1 loongkit-run python train.py", tmp_path))


def test_import_loongkit_all(tmp_path: Path) -> None:
    """Quick Start line 4: ``import loongkit.all`` at the top of the entry script."""
    needs_meta()
    assert_loaded_once(shell("LOONGKIT_ALL=1 python train.py", tmp_path, script="import loongkit.all\n" + TRAIN))


def test_import_loongkit_all_sets_the_variables_first(tmp_path: Path) -> None:
    """The seed's FAQ: variables set in os.environ before ``import loongkit.all`` apply."""
    needs_meta()
    script = "import os\nos.environ['LOONGKIT_ALL'] = '1'\nimport loongkit.all\n" + TRAIN
    assert_loaded_once(shell("python train.py", tmp_path, script=script))


def test_import_loongkit_is_light(tmp_path: Path) -> None:
    """``loongkit`` and ``loongkit.prelude`` are names only: importing them loads nothing heavy."""
    needs_meta()
    code = "import loongkit, loongkit.prelude\n" + HEAVY_PROBE
    r = run_snippet(code, {"LOONGKIT_ALL": "1"}, tmp=tmp_path, prelude=False)
    assert r.returncode == 0, r.stderr
    assert "heavy []" in r.stdout, r.stdout + r.stderr


def test_prelude_path_command() -> None:
    """``python -m loongkit.prelude`` prints the directory of the seed's recipe (the real one when installed)."""
    needs_meta()
    out = subprocess.run([sys.executable, "-m", "loongkit.prelude"], capture_output=True, text=True, check=True)
    path = Path(out.stdout.strip())
    assert (path / "sitecustomize.py").is_file()
    if (site_packages() / "loongkit" / "prelude").is_dir():
        assert path.resolve() == (site_packages() / "loongkit" / "prelude").resolve()


# The seed's prelude directory alone (its recipe) or with loongkit_core's, in either order, the user's own
# sitecustomize after them (or between them), and the other loaders stacked on top: the user's file runs
# once per process, loongkit boots once.
ORDERS = {
    "seed-only": ("seed", "user"),
    "seed-first": ("seed", "core", "user"),
    "core-first": ("core", "seed", "user"),
    "seed-twice": ("seed", "core", "seed", "user"),
    "user-between": ("seed", "user", "core"),
}
STACKED = {
    "python": "{python} train.py",
    "nested-loongkit-run": "loongkit-run loongkit-run {python} train.py",
}
LIGHT = "import loongkit.all\nimport loongkit_core.all\nprint('trained')\n"


@pytest.mark.parametrize("launch", sorted(STACKED))
@pytest.mark.parametrize("order", sorted(ORDERS))
def test_both_preludes_chain_once_and_boot_once(tmp_path: Path, order: str, launch: str) -> None:
    prelude = seed_prelude()
    user = tmp_path / "user_site"
    user.mkdir()
    marker = tmp_path / "marker"
    (user / "sitecustomize.py").write_text(
        "import os, sys\n"
        f"if os.path.basename(sys.argv[0]) == 'train.py': open({str(marker)!r}, 'a').write('ran\\n')\n")
    dirs = {"seed": str(prelude), "core": prelude_dir(), "user": str(user)}
    path = os.pathsep.join(dirs[name] for name in ORDERS[order])
    line = f"PYTHONPATH={shlex.quote(path)} LOONGKIT_ALL=1 " + STACKED[launch].format(python="python")
    r = shell(line, tmp_path / "run", script=LIGHT)
    assert r.returncode == 0, r.stderr
    assert "trained" in r.stdout
    assert marker.read_text() == "ran\n"  # the training process ran the user's sitecustomize exactly once
    assert r.logs().count('event="loongkit boot"') == 1, r.logs()


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_user_sitecustomize_runs_once_without_variables(tmp_path: Path, order: str) -> None:
    prelude = seed_prelude()
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import sys\nsys.user_sitecustomize_runs = "
                                           "getattr(sys, 'user_sitecustomize_runs', 0) + 1\n")
    dirs = {"seed": str(prelude), "core": prelude_dir(), "user": str(user)}
    path = os.pathsep.join(dirs[name] for name in ORDERS[order])
    code = "import sys\nprint('runs', sys.user_sitecustomize_runs)\n" + HEAVY_PROBE
    r = run_snippet(code, {"PYTHONPATH": path}, tmp=tmp_path / "run", prelude=False)
    assert r.returncode == 0, r.stderr
    assert "runs 1" in r.stdout and "heavy []" in r.stdout, r.stdout + r.stderr
