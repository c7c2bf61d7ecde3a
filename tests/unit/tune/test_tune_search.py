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
    {"when": {COUNT: "1"}, "hang": True},
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
    assert [s.key for s in outcome.standings][:4] == ["workers=8", "workers=4", "workers=3", "workers=1"]
    winner = outcome.verdict.winner
    assert winner is not None and winner.key == "ALL=2 + workers=3", outcome.verdict.text
    # Three trials in the search, three in the confirmation's blocks beside its two leave-one-outs.
    assert len(winner.good) == 6 and winner.median == 0.045
    assert abs(winner.speedup(outcome.baseline) - 0.100 / 0.045) < 1e-9  # type: ignore[operator]
    checked = outcome.confirmation
    assert checked is not None and checked.candidate is winner and checked.pairs == 3
    assert checked.gain is not None and abs(checked.gain - 0.100 / 0.045) < 1e-9
    noise = f"{outcome.noise:.1%}"
    assert checked.ablation == [f"ALL=2 kept: without it 1.11x the step (3 pairs, noise {noise})",
                                f"workers=3 kept: without it 2.11x the step (3 pairs, noise {noise})"]
    assert outcome.verdict.text.startswith("ALL=2 + workers=3: 2.22x the baseline, confirmed in 3 alternating pairs")
    crash = by_key["ALL=1 +MALLOC(jemalloc)"]
    assert crash.status == EXCLUDED and crash.reason == "crashed: exit code 1 (RuntimeError: planted crash)"
    changed = by_key["ALL=3"]
    assert changed.status == EXCLUDED and changed.reason.startswith("changes results: loss max rel diff")
    hang = by_key["workers=1"]
    assert hang.status == EXCLUDED and hang.reason == "hangs: no exit within 3 s"
    # Clearly slower candidates ran once: halving dropped them; the baseline ran every round.
    assert by_key["workers=4"].status == DROPPED and len(by_key["workers=4"].trials) == 1
    assert len(outcome.baseline.trials) == 4 + 3
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
    assert set(excluded) == {"ALL=1 +MALLOC(jemalloc)", "ALL=3", "workers=1"}
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


def test_a_part_of_the_winner_that_does_not_help_is_left_out(
        tmp_path: Path, fake_job: list[str], clean_env: dict[str, str]) -> None:
    """Issue 31's thread job: ALL=1 +CONFIG_GUARDS_APPLY_FIX led the search, the gain was ALL=1's."""
    fix = "LOONGKIT_CONFIG_GUARDS_APPLY_FIX"
    rules = [{"when": {"LOONGKIT_ALL": "1"}, "step": 0.080},
             {"when": {"LOONGKIT_ALL": "1", fix: "1"}, "step": 0.079}]
    env = {**clean_env, "FAKE_RULES": json.dumps(rules), "FAKE_WORKERS": "4", "FAKE_DATA_WAIT": "0.01"}
    outcome, out, _ = run_tune(tmp_path, fake_job, env, budget_minutes=3.0, max_level=2)
    assert outcome.search_verdict is not None
    assert outcome.search_verdict.winner is not None
    assert outcome.search_verdict.winner.key == "ALL=1 +CONFIG_GUARDS_APPLY_FIX"
    checked = outcome.confirmation
    assert checked is not None and checked.ablation[0].startswith("ALL=1 kept: without it 1.27x the step")
    assert checked.ablation[1].startswith(
        "+CONFIG_GUARDS_APPLY_FIX left out: without it 1.01x the step, inside the noise")
    assert outcome.verdict.winner is not None and outcome.verdict.winner.key == "ALL=1"
    assert checked.gain is not None and abs(checked.gain - 0.100 / 0.080) < 1e-9
    assert "export LOONGKIT_ALL=1\n#" in out and f"export {fix}" not in out
    assert "ablation: +CONFIG_GUARDS_APPLY_FIX left out" in out
    doc = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert doc["winner"]["env"] == {"LOONGKIT_ALL": "1"} and doc["confirmation"]["pairs"] == 3


def test_a_leader_the_alternating_pairs_do_not_confirm_is_not_printed(
        tmp_path: Path, fake_job: list[str], clean_env: dict[str, str]) -> None:
    """Fast in the search's three trials (the machine was quieter then), equal beside the baseline."""
    rules = [{"when": {COUNT: "3"}, "seq": [0.080, 0.080, 0.080, 0.100]}]
    env = {**clean_env, "FAKE_RULES": json.dumps(rules), "FAKE_STATE": str(tmp_path)}
    outcome, out, _ = run_tune(tmp_path, fake_job, env, max_level=1)
    assert outcome.search_verdict is not None and outcome.search_verdict.winner is not None
    assert outcome.search_verdict.winner.key == "workers=3"
    assert outcome.verdict.winner is None
    assert outcome.verdict.text.startswith("workers=3 not confirmed: 1.00x the baseline in 3 alternating pairs")
    assert outcome.verdict.text.endswith("keep the job as it is")
    assert "# loongkit tune: keep the job as it is (nothing to export)" in out
