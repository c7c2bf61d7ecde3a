"""What tune prints and writes: the ranked table, the winner as lines to paste, JSON and a PNG chart."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loongkit_monitor.tune.budget import clock_text
from loongkit_monitor.tune.ranking import BUDGET, DROPPED, EXCLUDED, NOT_TRIED, OK, Standing, leaders
from loongkit_monitor.tune.search import Outcome

WIDTH = 100
COLUMNS = ("#", "median step", "speed-up", "spread", "data wait", "trials", "status", "settings")


def ranked(outcome: Outcome) -> list[Standing]:
    """Rows in table order: the winner, every other timed candidate and the baseline by median step (the
    ones still in the race first), then the excluded, then those the budget left untried."""
    def by_median(rows: Sequence[Standing]) -> list[Standing]:
        return sorted(rows, key=lambda s: s.median if s.median is not None else math.inf)

    timed = [s for s in outcome.standings if s.status == OK and s.median is not None]
    timed = by_median([*timed, outcome.baseline] if outcome.baseline.median is not None else timed)
    winner = outcome.verdict.winner  # first even when a tie went to fewer workers
    if winner in timed:
        timed = [winner, *(s for s in timed if s is not winner)]
    dropped = by_median([s for s in outcome.standings if s.status == DROPPED])
    excluded = [s for s in outcome.standings if s.status == EXCLUDED]
    rest = [s for s in outcome.standings if s.status in (BUDGET, NOT_TRIED)]
    return [*timed, *dropped, *excluded, *rest]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _status(s: Standing, outcome: Outcome) -> str:
    if outcome.verdict.winner is s:
        return "winner"
    if s is outcome.baseline:
        return "baseline"
    return s.status


def _note(s: Standing, outcome: Outcome) -> str:
    return s.reason if s.status != OK and s is not outcome.baseline else ""


def row(s: Standing, outcome: Outcome) -> tuple[str, ...]:
    speedup = s.speedup(outcome.baseline)
    spread = s.spread
    trials = len(s.good)
    return (
        _ms(s.median),
        "-" if speedup is None else f"{speedup:.2f}x",
        ("-" if not trials else "1 trial") if spread is None else f"±{spread / 2:.1%}",
        _share(s.data_wait),
        f"{trials}/{len(s.trials)}" if s.trials else "0",
        _status(s, outcome),
        s.candidate.settings if s is not outcome.baseline else "(monitor only)",
    )


def render_table(outcome: Outcome) -> str:
    """The ranked table: '#' numbers the candidates still in the race and the baseline, fastest
    first; the dropped, excluded and untried follow with their reason after the settings."""
    rows = ranked(outcome)
    numbered = [s for s in rows if s.status == OK or s is outcome.baseline]
    cells = [COLUMNS, *((str(numbered.index(s) + 1) if s in numbered else "-", *row(s, outcome)) for s in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS) - 1)]
    lines = ["=" * WIDTH, f"loongkit tune: {outcome.trials} trials in {clock_text(outcome.elapsed_s)} "
                          f"(budget {clock_text(outcome.budget_s)}), ranked by the monitor's mean warm step",
             "-" * WIDTH]
    for i, cell in enumerate(cells):
        text = "  ".join(c.ljust(w) if j in (0, len(widths) - 1) else c.rjust(w)
                         for j, (c, w) in enumerate(zip(cell, widths, strict=False)))
        note = _note(rows[i - 1], outcome) if i else ""
        lines.append(f"{text}  {cell[-1]}" + (f"  <- {note}" if note else ""))
        if i == 0:
            lines.append("-" * WIDTH)
    lines.append("-" * WIDTH)
    lines.append(f"noise: {outcome.noise:.1%} (the larger of the baseline's run-to-run deviation, a trial's own "
                 "error and 2 %); spread: ± half the range of a candidate's trial medians")
    lines.append(f"losses: {outcome.reproducible.text}")
    lines.extend(f"not tried: {k.label}: {k.reason}" for k in outcome.skipped)
    lines.extend(f"note: {n}" for n in outcome.facts.notes)
    if outcome.confirmation is not None and outcome.search_verdict is not None:
        lines.append(f"search: {outcome.search_verdict.text}")
        lines.extend(f"ablation: {text}" for text in outcome.confirmation.ablation)
    lines.append(f"verdict: {outcome.verdict.text}")
    lines.append("=" * WIDTH)
    return "\n".join(lines) + "\n"


def winner_env(outcome: Outcome) -> dict[str, str]:
    winner = outcome.verdict.winner
    return winner.candidate.environ if winner is not None else {}


def _env_lines(env: dict[str, str], command: Sequence[str]) -> list[str]:
    lines = ["# shell (run the job under loongkit-run, or with the prelude on PYTHONPATH):"]
    lines += [f"export {k}={v}" for k, v in env.items()]
    lines.append(f"# loongkit-run {' '.join(command)}")
    lines.append("# Kubernetes container:")
    lines.append("env:")
    for k, v in env.items():
        lines += [f"  - name: {k}", f"    value: {json.dumps(v)}"]
    return lines


def paste_lines(outcome: Outcome, command: Sequence[str]) -> str:
    """The winner's variables (shell and Kubernetes); without a winner, the job stays as it is, and
    the fastest candidate still in the race is offered as what to try next, marked as inside the noise."""
    env = winner_env(outcome)
    if env:
        return "\n".join([f"# loongkit tune winner: {outcome.verdict.text}", *_env_lines(env, command)]) + "\n"
    lines = ["# loongkit tune: keep the job as it is (nothing to export)", f"# {outcome.verdict.text}"]
    fastest = next((s for s in leaders(outcome.standings)
                    if (s.speedup(outcome.baseline) or 0) > 1 and s.candidate.env), None)
    if fastest is not None and not outcome.fatal:
        lines.append(f"# to try anyway (inside the noise, {len(fastest.good)} trial(s)): {fastest.key}")
        lines += _env_lines(fastest.candidate.environ, command)
    return "\n".join(lines) + "\n"


def _trial_json(t: Any) -> dict[str, Any]:
    f = t.figures
    return {"attempt": t.attempt, "returncode": t.returncode, "wall_s": round(t.wall_s, 3), "ok": t.ok,
            "error": t.error or None, "kind": t.kind or None, "losses": t.losses[:50],
            "step_median_s": f.step_median_s if f else None, "step_p90_s": f.step_p90_s if f else None,
            "data_wait_share": f.data_wait_share if f else None, "steps": f.steps if f else None,
            "warm_steps": f.warm_steps if f else None, "workers": f.workers if f else None,
            "summary": t.summary_path or None,
            "output_tail": t.output_tail[-2000:] if t.error else None}


def _standing_json(s: Standing, outcome: Outcome) -> dict[str, Any]:
    c = s.candidate
    return {"key": c.key, "env": c.environ, "group": c.group, "level": c.level, "why": c.why,
            "status": s.status, "reason": s.reason or None, "median_step_s": s.median, "spread": s.spread,
            "speedup": s.speedup(outcome.baseline), "data_wait_share": s.data_wait,
            "loss_check": s.loss.text if s.loss else None, "trials": [_trial_json(t) for t in s.trials]}


def _confirmation_json(outcome: Outcome) -> dict[str, Any] | None:
    c = outcome.confirmation
    if c is None:
        return None
    return {"key": c.candidate.key if c.candidate else None, "confirmed": c.candidate is not None,
            "gain": c.gain, "low": c.low, "high": c.high, "pairs": c.pairs, "ablation": c.ablation, "text": c.text}


def to_json(outcome: Outcome, command: Sequence[str], steps: int) -> dict[str, Any]:
    facts = outcome.facts
    return {
        "version": 1,
        "command": list(command),
        "steps": steps,
        "budget_s": outcome.budget_s,
        "elapsed_s": round(outcome.elapsed_s, 2),
        "trials": outcome.trials,
        "noise": outcome.noise,
        "losses": {"reproducible": outcome.reproducible.ok, "text": outcome.reproducible.text},
        "verdict": outcome.verdict.text,
        "fatal": outcome.fatal or None,
        "winner": {"key": outcome.verdict.winner.key, "env": winner_env(outcome)} if outcome.verdict.winner else None,
        "search_verdict": outcome.search_verdict.text if outcome.search_verdict else None,
        "confirmation": _confirmation_json(outcome),
        "baseline": _standing_json(outcome.baseline, outcome),
        "ranked": [_standing_json(s, outcome) for s in ranked(outcome)],
        "skipped": [{"label": k.label, "reason": k.reason} for k in outcome.skipped],
        "facts": {"gpus": facts.gpus, "cpus": facts.cpus, "numa_nodes": facts.numa_nodes,
                  "l3_caches": facts.l3_caches, "numa_topology": facts.numa_topology or None,
                  "allocators": facts.allocators, "notes": facts.notes,
                  "features": {n: ("yes" if f.applies else f.reason) for n, f in sorted(facts.features.items())}},
    }


def write_json(path: str | os.PathLike[str], payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def write_png(path: str | os.PathLike[str], outcome: Outcome) -> str | None:
    """A bar per timed candidate (median step, the range of its trials), the baseline as a line;
    None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no chart (pip install matplotlib)"
    rows = [s for s in ranked(outcome) if s.median is not None]
    if not rows:
        return "no timed trial: no chart"
    labels = [s.key + ("" if s.status == OK else f" ({s.status})") for s in rows]
    medians = [(s.median or 0) * 1000 for s in rows]
    low = [m - min(s.medians) * 1000 for m, s in zip(medians, rows, strict=True)]
    high = [max(s.medians) * 1000 - m for m, s in zip(medians, rows, strict=True)]

    def color(s: Standing) -> str:
        if outcome.verdict.winner is s:
            return "tab:green"
        if s is outcome.baseline:
            return "tab:orange"
        return {OK: "tab:blue", EXCLUDED: "tab:red"}.get(s.status, "tab:gray")

    colors = [color(s) for s in rows]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6))
    y = list(range(len(rows)))[::-1]
    ax.barh(y, medians, xerr=[low, high], color=colors, capsize=3)
    ax.set_yticks(y, labels)
    if outcome.baseline.median is not None:
        ax.axvline(outcome.baseline.median * 1000, color="tab:orange", linestyle="--", linewidth=1)
    ax.set_xlabel("mean warm step (ms); bars: range of the trials' medians")
    ax.set_title(f"loongkit tune: {outcome.trials} trials in {clock_text(outcome.elapsed_s)}\n"
                 "green: winner, orange: baseline, blue: ok, gray: dropped, red: excluded", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
