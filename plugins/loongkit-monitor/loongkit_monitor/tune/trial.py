"""One trial: the user's command in a fresh process under one candidate's settings, for N steps.

The trial's environment is the base (the user's, without feature switches) plus the candidate's
variables plus ``LOONGKIT_MONITOR=1``, ``LOONGKIT_MONITOR_MAX_STEPS=N`` and its own
``LOONGKIT_SUMMARY_JSON``. The command runs under ``loongkit-run`` in a new session (its own process
group), so a hung trial is ended with everything it started (torchrun's ranks, DataLoader workers),
and nothing it leaves behind disturbs the next trial's timing. Losses are read from the command's
output with :func:`loongkit_core.compare.parse_metrics` (what ``loongkit compare`` uses).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from loongkit_core.compare import parse_metrics
from loongkit_monitor.tune import figures as figures_mod
from loongkit_monitor.tune.figures import Figures
from loongkit_monitor.tune.space import OWN_FEATURES, Candidate

KILL_GRACE_S = 5.0  # SIGTERM first (the job's own handlers, loongkit's Summary), then SIGKILL
TAIL_CHARS = 4000
# torch's own abort at interpreter exit of a gloo rank (loongkit_core.testing.TORCH_EXIT_RACE).
TORCH_EXIT_RACE = "terminate called without an active exception"


@dataclass
class Setup:
    """What every trial of one tune run shares."""

    command: list[str]
    base_env: dict[str, str]
    steps: int
    workdir: Path
    launcher: list[str] = field(default_factory=list)  # ["/venv/bin/loongkit-run"]; [] runs the command bare
    echo: TextIO | None = None  # stream the trials' output here, prefixed


@dataclass
class TrialResult:
    key: str
    attempt: int
    returncode: int | None
    wall_s: float
    figures: Figures | None
    losses: list[float]
    error: str = ""  # why this trial cannot be ranked; "" when it can
    kind: str = ""  # "crash", "hang", "budget", "no figures" (with error)
    output_tail: str = ""
    summary_path: str = ""
    exit_race: bool = False  # died of torch's exit race after its work (retried once by the search)
    active_level: int | None = None  # the highest level of the features that ran (None: unknown)

    @property
    def ok(self) -> bool:
        return not self.error and self.figures is not None and self.figures.usable

    @property
    def step_s(self) -> float | None:
        return self.figures.step_s if self.figures is not None else None


def trial_environ(setup: Setup, candidate: Candidate, summary_path: Path) -> dict[str, str]:
    env = dict(setup.base_env)
    env.update(candidate.environ)
    env.update({"LOONGKIT_MONITOR": "1", "LOONGKIT_MONITOR_MAX_STEPS": str(setup.steps),
                "LOONGKIT_SUMMARY_JSON": str(summary_path)})
    return env


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:60] or "trial"


SUMMARY_START = "=" * 28 + " Loongkit Feature Summary"
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b(:.*)?$")


def _last_line(text: str) -> str:
    """The exception that ended the job (the last ``SomeError: message`` line before loongkit's
    Summary, which follows it), else the job's last line of output."""
    cut = text.find(SUMMARY_START)
    lines = [line.strip() for line in (text if cut < 0 else text[:cut]).splitlines() if line.strip()]
    for line in reversed(lines):
        if EXCEPTION_LINE.match(line):
            return line[:200]
    return lines[-1][:200] if lines else ""


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: subprocess.Popen[str]) -> None:
    _kill_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid, signal.SIGKILL)
        proc.wait()


def run(setup: Setup, candidate: Candidate, index: int, attempt: int, timeout: float,
        budget_cut: bool = False) -> TrialResult:
    """Run one trial; ``timeout`` in seconds; ``budget_cut``: the timeout is what the budget left."""
    summary_path = setup.workdir / f"{index:03d}-{_slug(candidate.key)}-{attempt}.json"
    summary_path.unlink(missing_ok=True)
    env = trial_environ(setup, candidate, summary_path)
    start = time.monotonic()
    try:
        proc = subprocess.Popen([*setup.launcher, *setup.command], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace",
                                start_new_session=True)
    except OSError as exc:
        return TrialResult(candidate.key, attempt, None, 0.0, None, [], f"crashed: cannot start: {exc}", "crash")
    chunks: list[str] = []
    timed_out = False
    # From here on, Ctrl-C (which reaches tune only: the trial runs in its own session) ends the trial
    # before it propagates, wherever it lands; a job left running would also keep its output pipe open and
    # hang this interpreter's exit on the reader thread's lock.
    try:
        reader = threading.Thread(target=_read, args=(proc, chunks, setup.echo, candidate.key), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=max(0.1, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
    except BaseException:
        _stop(proc)
        raise
    wall = time.monotonic() - start
    _kill_group(proc.pid, signal.SIGKILL)  # what the job left running (orphaned workers, ranks)
    reader.join(timeout=KILL_GRACE_S)
    output = "".join(chunks)
    log_path = summary_path.with_suffix(".log")
    try:  # the whole output, for the user to read why a trial failed
        log_path.write_text(output)
    except OSError:
        pass
    losses = parse_metrics(output)["loss"]
    figures, summary, why = figures_mod.read(summary_path)
    result = TrialResult(candidate.key, attempt, proc.returncode, wall, figures, losses,
                         output_tail=output[-TAIL_CHARS:], summary_path=str(summary_path),
                         active_level=figures_mod.active_level(summary, OWN_FEATURES))
    if timed_out:
        result.error, result.kind = ((f"stopped after {timeout:.0f} s: the budget ran out", "budget") if budget_cut
                                     else (f"hangs: no exit within {timeout:.0f} s", "hang"))
    elif proc.returncode != 0:
        detail = _last_line(output)
        result.error, result.kind = f"crashed: {_describe_exit(proc.returncode)}" + (
            f" ({detail})" if detail else ""), "crash"
        result.exit_race = TORCH_EXIT_RACE in output
    elif figures is None:
        result.error, result.kind = f"no figures: {why}", "no figures"
    elif not figures.usable:
        result.error, result.kind = f"no figures: the monitor saw {figures.steps} step(s), none warm", "no figures"
    return result


def _read(proc: subprocess.Popen[str], chunks: list[str], echo: TextIO | None, label: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        chunks.append(line)
        if echo is not None:
            echo.write(f"[{label}] {line}")
            echo.flush()


def loongkit_run() -> list[str]:
    """The launcher next to this interpreter (the same installation as the plugins tune found)."""
    here = Path(sys.executable).with_name("loongkit-run")
    return [str(here)] if here.exists() else [sys.executable, "-m", "loongkit_core.launcher"]


def base_environ(environ: Mapping[str, str], keep: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """The user's environment without LOONGKIT_* feature switches and options (the trials choose
    them); the core's own settings in ``keep`` pass through. Returns (env, names dropped)."""
    env: dict[str, str] = {}
    dropped: list[str] = []
    for name, value in environ.items():
        if name.startswith("_LOONGKIT_"):  # a process's hand-offs to its own children (activity channel)
            continue
        if name.startswith("LOONGKIT_") and name not in keep:
            dropped.append(name)
            continue
        env[name] = value
    return env, sorted(dropped)
