"""pytest plugin for loongkit plugin authors (auto-loaded through the ``pytest11`` entry point).

Fixtures:

* ``loongkit_env`` — an environment with no LOONGKIT_* variables and logs in a temp dir; returns
  the monkeypatch so tests set variables with ``loongkit_env.setenv(...)``.
* ``run_loongkit`` — run a Python snippet in a fresh interpreter with the prelude on PYTHONPATH and
  return its exit code, output, parsed JSON Summary and log files.
* ``fake_sysfs`` — build a recorded hardware topology under a temp root (``LOONGKIT_SYSFS_ROOT``).
* ``fake_distribution`` — make a distribution look installed at a chosen version (metadata only, plus any
  stub modules), in this process and in the subprocesses it starts, to test ``requires`` gates.
* ``loongkit_runtime`` — boot an in-process :class:`~loongkit_core.runtime.Runtime` on an explicit
  environment, activate chosen features on their target, and deactivate everything at teardown
  (patches undone), for tests that call the patched code directly.

Helpers: ``skip_outside_declaration(feature, "torch")`` skips a test where the installed torch (or any
distribution named) is outside the feature's own ``requires`` (``outside_declaration`` gives that reason,
or None); ``free_port``, ``read_json``, ``install_fake_plugin``.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest


def prelude_dir() -> str:
    from loongkit_core.prelude import PATH

    return PATH


def clean_environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default os.environ) without LOONGKIT_* variables and without the prelude path."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("LOONGKIT_")}
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and os.path.realpath(p) != os.path.realpath(prelude_dir())]
    if parts:
        env["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        env.pop("PYTHONPATH", None)
    return env


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str
    summary: dict[str, Any] | None
    logdir: Path
    summaries_printed: int = 0
    summary_path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def feature(self, name: str) -> dict[str, Any]:
        """The JSON Summary row of feature ``name`` (KeyError when it is not in the Summary)."""
        assert self.summary is not None, f"no JSON summary; stderr:\n{self.stderr}"
        for row in self.summary["features"]:
            if row["name"] == name:
                return row
        raise KeyError(name)

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.logdir.glob("*.log")))


def loongkit_environ(env: Mapping[str, str] | None = None, *, tmp: Path, prelude: bool = True) -> dict[str, str]:
    """The environment :func:`run_snippet` gives its command: logs in ``tmp/logs``, the JSON Summary at
    ``tmp/summary.json``, ``env`` on top, the prelude first on PYTHONPATH (``prelude=False``: bare).
    For tests that start several jobs at once with ``subprocess.Popen``."""
    tmp.mkdir(parents=True, exist_ok=True)
    full = clean_environ()
    full.update({"LOONGKIT_LOGDIR": str(tmp / "logs"), "LOONGKIT_SUMMARY_JSON": str(tmp / "summary.json")})
    full.update(env or {})
    if prelude:
        parts = [prelude_dir(), *[p for p in full.get("PYTHONPATH", "").split(os.pathsep) if p]]
        full["PYTHONPATH"] = os.pathsep.join(parts)
    return full


def run_snippet(code: str, env: Mapping[str, str] | None = None, *, tmp: Path, prelude: bool = True,
                argv: Sequence[str] | None = None, timeout: float = 300, cwd: str | None = None) -> RunResult:
    """Run ``code`` (or ``argv``) under loongkit in a fresh interpreter; see :class:`RunResult`."""
    logdir = tmp / "logs"
    summary_path = tmp / "summary.json"
    full = loongkit_environ(env, tmp=tmp, prelude=prelude)
    command = list(argv) if argv is not None else [sys.executable, "-c", code]
    proc = subprocess.run(command, env=full, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    extra: dict[str, Any] = {}
    for _ in range(2):
        if not _torchrun_exit_race(command, proc):
            break
        extra.setdefault("retried", []).append(proc.stderr)  # kept, so a test can tell
        summary_path.unlink(missing_ok=True)
        shutil.rmtree(logdir, ignore_errors=True)  # the retry's logs alone, as if it were the only run
        proc = subprocess.run(command, env=full, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return RunResult(proc.returncode, proc.stdout, proc.stderr, summary, logdir,
                     proc.stdout.count("Loongkit Feature Summary"), summary_path, extra)


# torch's own abort at interpreter exit of a gloo rank (see _torchrun_exit_race).
TORCH_EXIT_RACE = "terminate called without an active exception"


def _torchrun_exit_race(command: Sequence[str], proc: subprocess.CompletedProcess[str]) -> bool:
    """A torchrun whose rank died at interpreter exit with torch's own "terminate called without an
    active exception" (a C++ thread destroyed while joinable). Reproduced with torch 2.13 CPU and two
    gloo ranks on a loaded 2-core machine without loongkit at all (bare script, no prelude: 3 in 10
    runs after destroy_process_group printed), so it is retried (twice at most) rather than failing the
    test."""
    return (proc.returncode != 0 and os.path.basename(command[0]) == "torchrun"
            and TORCH_EXIT_RACE in proc.stderr)


@pytest.fixture
def loongkit_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[pytest.MonkeyPatch]:
    for name in list(os.environ):
        if name.startswith("LOONGKIT_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("LOONGKIT_LOGDIR", str(tmp_path / "loongkit-logs"))
    yield monkeypatch


@pytest.fixture
def run_loongkit(tmp_path: Path) -> Callable[..., RunResult]:
    counter = iter(range(1_000_000))

    def run(code: str = "", env: Mapping[str, str] | None = None, **kwargs: Any) -> RunResult:
        return run_snippet(code, env, tmp=tmp_path / f"run{next(counter)}", **kwargs)

    return run


@pytest.fixture
def fake_sysfs(tmp_path: Path) -> Callable[..., Any]:
    """``fake_sysfs(**kw)`` writes a topology (see :mod:`loongkit_core.testing.topology`)."""
    from loongkit_core.testing import topology

    counter = iter(range(1_000_000))

    def build(**kwargs: Any) -> Any:
        return topology.write_topology(tmp_path / f"sysfs{next(counter)}", **kwargs)

    return build


@pytest.fixture
def loongkit_runtime(loongkit_env: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """``loongkit_runtime(environ, activate={feature: target})`` -> a booted Runtime (no exit hooks).

    Features in ``activate`` are activated on their target when armed (a feature that is off, out of
    range or not detected keeps its state, so a test can assert why); all are undone at teardown.
    """
    from loongkit_core.feature import State
    from loongkit_core.runtime import Runtime

    made: list[Runtime] = []

    def make(environ: Mapping[str, str], activate: Mapping[str, str] | None = None) -> Runtime:
        rt = Runtime(environ=dict(environ), arm=False)
        rt.boot(configure_logging=False)
        made.append(rt)
        for name, target in (activate or {}).items():
            record = rt.records[name]
            if record.state == State.ARMED:
                rt.activate(record, target)
        return rt

    yield make
    for rt in reversed(made):
        for name in reversed(list(rt.contexts)):  # newest first: patches of one attribute stack
            rt.deactivate(name)


@pytest.fixture
def fake_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """``fake_distribution(name, version, modules={"mmdet/__init__.py": ""})`` -> the site directory.

    ``name`` is written as in a feature's ``requires`` (``mmseg`` becomes the ``mmsegmentation``
    distribution, see ``loongkit_core.requirements.DISTRIBUTIONS``). The site goes first on ``sys.path``
    and on ``PYTHONPATH`` (so ``run_loongkit`` children see it: keep ``os.environ["PYTHONPATH"]`` when
    passing your own), shadowing a real installation; faking a name again replaces its version. Only
    metadata is faked: ``modules`` (relative path -> source) adds importable stand-ins. Undone at teardown.
    """
    from loongkit_core import requirements

    site = tmp_path / "fake-distributions"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))

    def make(name: str, version: str, modules: Mapping[str, str] | None = None) -> Path:
        dist = requirements.DISTRIBUTIONS.get(name, (name,))[0]
        stem = re.sub(r"[-_.]+", "_", dist).lower()
        for old in site.glob(f"{stem}-*.dist-info"):
            shutil.rmtree(old)
        info = site / f"{stem}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        for rel, source in (modules or {}).items():
            path = site / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(source)
        importlib.invalidate_caches()
        requirements.installed.cache_clear()  # it caches per process
        return site

    yield make
    requirements.installed.cache_clear()  # before monkeypatch restores sys.path: nothing reads it between


def outside_declaration(feature: Any, *distributions: str) -> str | None:
    """Why the installed ``distributions`` (e.g. "torch") fall outside ``feature``'s own ``requires`` (the
    Summary's reason), or None when they are inside it (or the feature declares none of them)."""
    from loongkit_core import requirements

    names = {name.lower() for name in distributions}
    return requirements.check_all([req for req in feature.requires if _requirement_name(req) in names])


def skip_outside_declaration(feature: Any, *distributions: str) -> None:
    """Skip the calling test where the installed ``distributions`` (e.g. "torch") fall outside
    ``feature``'s own ``requires``: there the feature is not applicable, and says so in its Summary row.

    Tests that build their own stand-in for the framework name only the real distributions they use, so
    a missing mmdet does not skip a test that fakes it. The skip reason is the Summary's."""
    reason = outside_declaration(feature, *distributions)
    if reason is not None:
        names = {name.lower() for name in distributions}
        declared = [req for req in feature.requires if _requirement_name(req) in names]
        pytest.skip(f"{feature.name} declares {', '.join(declared)}: {reason} (not applicable there)")


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower()


def free_port() -> int:
    """A TCP port free on localhost now (for ``torchrun --master-port``): fixed ports collide between
    tests, concurrent runs on one machine and sockets still in TIME_WAIT."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path) as fh:
        return json.load(fh)


def install_fake_plugin(site_dir: str | os.PathLike[str], module: str, source: str, *,
                        entry_point: str | None = None, ep_name: str | None = None,
                        version: str = "0.0.1") -> Path:
    """Write a one-module distribution with a ``loongkit`` entry point into ``site_dir``.

    Put ``site_dir`` on PYTHONPATH (``run_loongkit(env={"PYTHONPATH": ...})``) and the plugin is
    discovered like a pip-installed one. ``entry_point`` defaults to ``"<module>"``.
    """
    site = Path(site_dir)
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(source)
    dist = site / f"{module.replace('_', '-')}-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: {version}\n")
    (dist / "entry_points.txt").write_text(f"[loongkit]\n{ep_name or module} = {entry_point or module}\n")
    return site
