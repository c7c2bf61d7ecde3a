"""The whole search on a synthetic job whose fastest setting is planted (the fake monitor in fake_job.py)."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

from loongkit_monitor.tune import cli, search
from loongkit_monitor.tune.ranking import BUDGET, DROPPED, EXCLUDED, Tolerances
from tune_helpers import cpu_box

COUNT = "LOONGKIT_DATALOADER_WORKERS_COUNT"
PLANTED = [
    {"when": {"LOONGKIT_ALL": "2"}, "step": 0.095},  # a little faster
    {"when": {COUNT: "3"}, "step": 0.050},  # truly fast: 3 workers
    {"when": {"LOONGKIT_ALL": "2", COUNT: "3"}, "step": 0.045},  # fastest: both
    {"when": {"LOONGKIT_MALLOC_ALLOCATOR": "jemalloc"}, "step": 0.010, "crash": True},  # "fastest", crashes
    {"when": {"LOONGKIT_ALL": "3"}, "step": 0.020, "loss_shift": 0.5},  # "fastest", changes the losses
    {"when": {COUNT: "0"}, "hang": True},
]


def run_tune(tmp_path: Path, fake_job: list[str], env: dict[str, str], budget_minutes: float = 5.0,
             **kw: object) -> tuple[search.Outcome, str, str]:
    out, err = io.StringIO(), io.StringIO()
    options: dict[str, object] = dict(steps=8, budget_minutes=budget_minutes, max_level=3, repeats=3,
                                      tolerances=Tolerances(), out=tmp_path / "out", environ=env, launcher=[],
                                      facts=cpu_box(), trial_timeout=3.0, stdout=out, stderr=err)
    options.update(kw)
    outcome = cli.tune(fake_job, **options)  # type: ignore[arg-type]
    return outcome, out.getvalue(), err.getvalue()


def test_the_planted_fastest_is_chosen_and_the_bad_ones_are_excluded(
        tmp_path: Path, fake_job: list[str], clean_env: dict[str, str]) -> None:
    env = {**clean_env, "FAKE_RULES": json.dumps(PLANTED), "FAKE_DATA_WAIT": "0.4", "LOONGKIT_ALL": "1"}
    outcome, out, err = run_tune(tmp_path, fake_job, env)
    by_key = {s.key: s for s in outcome.standings}
    # Data-bound baseline: the worker counts were tried first.
    assert [s.key for s in outcome.standings][:4] == ["workers=4", "workers=3", "workers=1", "workers=0"]
    winner = outcome.verdict.winner
    assert winner is not None and winner.key == "ALL=2 + workers=3", outcome.verdict.text
    assert len(winner.good) == 3 and winner.median == 0.045
    assert abs(winner.speedup(outcome.baseline) - 0.100 / 0.045) < 1e-9  # type: ignore[operator]
    crash = by_key["ALL=1 +MALLOC(jemalloc)"]
    assert crash.status == EXCLUDED and crash.reason == "crashed: exit code 1 (RuntimeError: planted crash)"
    changed = by_key["ALL=3"]
    assert changed.status == EXCLUDED and changed.reason.startswith("changes results: loss max rel diff")
    hang = by_key["workers=0"]
    assert hang.status == EXCLUDED and hang.reason == "hangs: no exit within 3 s"
    # Clearly slower candidates ran once: halving dropped them; the baseline ran every round.
    assert by_key["workers=4"].status == DROPPED and len(by_key["workers=4"].trials) == 1
    assert len(outcome.baseline.trials) == 4
    # The user's LOONGKIT_ALL did not leak into the trials.
    assert "ignoring LOONGKIT_ALL" in err
    assert outcome.baseline.median == 0.100
    # The report: ranked table, paste-ready lines, JSON.
    lines = out.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("1 "))
    assert "45.0 ms" in lines[top] and "2.22x" in lines[top] and " winner " in lines[top]
    crashed = next(line for line in lines if "jemalloc" in line)
    assert crashed.startswith("- ") and " excluded " in crashed
    assert crashed.endswith("<- crashed: exit code 1 (RuntimeError: planted crash)")
    assert ("export LOONGKIT_ALL=2\nexport LOONGKIT_DATALOADER_WORKERS=1\n"
            "export LOONGKIT_DATALOADER_WORKERS_COUNT=3") in out
    assert '  - name: LOONGKIT_DATALOADER_WORKERS_COUNT\n    value: "3"' in out
    doc = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert doc["winner"] == {"key": "ALL=2 + workers=3",
                             "env": {"LOONGKIT_ALL": "2", "LOONGKIT_DATALOADER_WORKERS": "1", COUNT: "3"}}
    assert doc["ranked"][0]["key"] == "ALL=2 + workers=3"
    excluded = {r["key"]: r["reason"] for r in doc["ranked"] if r["status"] == "excluded"}
    assert set(excluded) == {"ALL=1 +MALLOC(jemalloc)", "ALL=3", "workers=0"}
    assert "tune [" in err and "ETA" in err  # the progress bar


def test_the_budget_holds(tmp_path: Path, fake_job: list[str], clean_env: dict[str, str]) -> None:
    env = {**clean_env, "FAKE_RULES": json.dumps(PLANTED[:3]), "FAKE_SLEEP": "1.5"}
    start = time.monotonic()
    outcome, out, _ = run_tune(tmp_path, fake_job, env, budget_minutes=0.4)
    took = time.monotonic() - start
    assert took <= 24.0, took  # the report (JSON, PNG) included
    assert outcome.elapsed_s <= 24.0
    untried = [s for s in outcome.standings if s.status == BUDGET]
    assert untried and all(s.reason == "not tried: the budget (0:24) ran out" for s in untried)
    assert outcome.trials >= 3
    assert "budget (0:24)" in out


def test_nothing_beats_the_baseline(tmp_path: Path, fake_job: list[str], clean_env: dict[str, str]) -> None:
    env = {**clean_env, "FAKE_RULES": json.dumps([{"when": {COUNT: "3"}, "step": 0.099}])}
    outcome, out, _ = run_tune(tmp_path, fake_job, env, repeats=1)
    assert outcome.verdict.winner is None
    assert out.count("keep the job as it is (nothing to export)") == 1
    # The fastest is offered, marked as inside the noise.
    assert "# to try anyway (inside the noise, 1 trial(s)): workers=3" in out
    assert "export LOONGKIT_DATALOADER_WORKERS_COUNT=3" in out


def test_a_failing_baseline_stops_the_search(tmp_path: Path, fake_job: list[str], clean_env: dict[str, str]) -> None:
    env = {**clean_env, "FAKE_RULES": json.dumps([{"crash": True}])}
    outcome, out, _ = run_tune(tmp_path, fake_job, env)
    assert outcome.fatal == "the baseline trial failed: crashed: exit code 1 (RuntimeError: planted crash)"
    assert outcome.trials == 1 and "output tail of the baseline trial" in out


def test_cli_usage_errors(capsys: object) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_cli(parser.add_subparsers())
    assert parser.parse_args(["tune"]).func(parser.parse_args(["tune"])) == 2
    args = parser.parse_args(["tune", "--steps", "2", "--", "python", "x.py"])
    assert args.func(args) == 2
    args = parser.parse_args(["tune", "--budget", "3", "--max-level", "2", "--", "python", "x.py", "--lr", "1"])
    assert args.cmd == ["--", "python", "x.py", "--lr", "1"] and args.max_level == 2
