"""loongkit tune [--steps N] [--budget MINUTES] [--max-level L] -- <training command>

Runs the training command for N steps (LOONGKIT_MONITOR_MAX_STEPS) under candidate LOONGKIT_*
settings, each trial a fresh process under loongkit-run, and ranks them by the training monitor's
mean warm step: LOONGKIT_ALL=1..L, each level-2 option that applies on this machine, the
DataLoader worker count (LOONGKIT_DATALOADER_WORKERS_COUNT), TF32 and compile features on a GPU.
Clearly slower candidates are dropped early, the leaders and the baseline repeated; a candidate
that crashes, hangs or changes the losses is reported and never chosen. Stays inside --budget.

Prints the ranked table and the winner as lines to paste (shell, Kubernetes); writes tune.json
and tune.png (with matplotlib) into --out. Works with `torchrun ...` (rank 0's figures).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from loongkit_monitor.tune import facts as facts_mod
from loongkit_monitor.tune import report, trial
from loongkit_monitor.tune.budget import Budget, Progress
from loongkit_monitor.tune.facts import Facts
from loongkit_monitor.tune.ranking import Tolerances
from loongkit_monitor.tune.search import Outcome, Plan, Search

DEFAULT_STEPS = 20  # a few warm-up steps plus enough warm ones for a median, at a bounded cost
MIN_STEPS = 5  # the monitor drops the first steps as warm-up; fewer leave nothing to rank by
# The core's own settings pass from the user's environment to every trial; feature switches and
# options do not (the trials choose them).
KEEP = ("LOONGKIT_SYSFS_ROOT", "LOONGKIT_LOGDIR", "LOONGKIT_LOGLEVEL", "LOONGKIT_ACTIVATION_TIMEOUT",
        "LOONGKIT_DISABLE_PLUGINS")


def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser("tune", help="try LOONGKIT_* settings on a training command; rank them by step time",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"steps per trial (default {DEFAULT_STEPS})")
    p.add_argument("--budget", type=float, default=10.0, metavar="MINUTES",
                   help="wall-clock budget for the whole search (default 10)")
    p.add_argument("--max-level", type=int, default=3, choices=(1, 2, 3), help="highest LOONGKIT_ALL level to try")
    p.add_argument("--repeats", type=int, default=3, help="trials of each leader (default 3)")
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="max relative loss difference for level 0-1 settings (default 1e-3)")
    p.add_argument("--tolerance-deep", type=float, default=1e-2,
                   help="max relative loss difference for level 2-3 settings (default 1e-2)")
    p.add_argument("--trial-timeout", type=float, metavar="SECONDS",
                   help="a trial running longer hangs (default: 3x the baseline's, at least 30 s)")
    p.add_argument("--out", default="loongkit-tune", metavar="DIR",
                   help="directory for tune.json, tune.png and the trials' Summaries (default ./loongkit-tune)")
    p.add_argument("--echo", action="store_true", help="stream the trials' output to stderr, prefixed")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the training command")
    p.set_defaults(func=main)


def tune(command: Sequence[str], *, steps: int, budget_minutes: float, max_level: int, repeats: int,
         tolerances: Tolerances, out: Path, environ: Mapping[str, str], trial_timeout: float | None = None,
         launcher: Sequence[str] | None = None, facts: Facts | None = None, echo: bool = False,
         stdout: TextIO | None = None, stderr: TextIO | None = None) -> Outcome:
    """The whole run, for the CLI and for tests (``launcher=[]`` runs the command bare; ``facts``
    replaces asking loongkit what applies)."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    budget = Budget(budget_minutes * 60)
    base_env, dropped = trial.base_environ(environ, KEEP)
    if dropped:
        stderr.write(f"loongkit tune: ignoring {', '.join(dropped)} from the environment (the trials set them)\n")
    if facts is None:
        facts = facts_mod.gather(base_env, max_level)
    workdir = out / "trials"
    workdir.mkdir(parents=True, exist_ok=True)
    setup = trial.Setup(list(command), base_env, steps, workdir,
                        trial.loongkit_run() if launcher is None else list(launcher), stderr if echo else None)
    plan = Plan(steps=steps, max_level=max_level, repeats=repeats, tolerances=tolerances, trial_timeout=trial_timeout)
    outcome = Search(setup, plan, facts, budget, Progress(budget, stderr)).run()
    stdout.write(report.render_table(outcome))
    if outcome.fatal:
        last = outcome.baseline.trials[-1] if outcome.baseline.trials else None
        if last is not None and last.output_tail:
            stdout.write(f"--- output tail of the baseline trial ---\n{last.output_tail}\n")
    stdout.write(report.paste_lines(outcome, command))
    json_path = out / "tune.json"
    report.write_json(json_path, report.to_json(outcome, command, steps))
    note = report.write_png(out / "tune.png", outcome)
    stdout.write(f"wrote {json_path}" + (f"; {note}" if note else f" and {out / 'tune.png'}") + "\n")
    return outcome


def main(args: argparse.Namespace) -> int:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        sys.stderr.write("usage: loongkit tune [--steps N] [--budget MINUTES] [--max-level L] -- <command>\n")
        return 2
    if args.steps < MIN_STEPS:
        sys.stderr.write(f"loongkit tune: --steps must be at least {MIN_STEPS} (warm-up steps are not counted)\n")
        return 2
    if args.budget <= 0 or args.repeats < 1:
        sys.stderr.write("loongkit tune: --budget must be positive and --repeats at least 1\n")
        return 2
    outcome = tune(command, steps=args.steps, budget_minutes=args.budget, max_level=args.max_level,
                   repeats=args.repeats, tolerances=Tolerances(args.tolerance, args.tolerance_deep),
                   out=Path(args.out), environ=os.environ, trial_timeout=args.trial_timeout, echo=args.echo)
    return 1 if outcome.fatal else 0
