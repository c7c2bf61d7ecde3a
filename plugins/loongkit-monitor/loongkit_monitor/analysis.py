"""From what was recorded to figures and stragglers (pure functions, no I/O; the recommendations
made from them: :mod:`loongkit_monitor.advice`).

Warm-up: the first tenth of the timed steps (at least one when there are two or more, at most ten)
is dropped; it holds worker start-up, allocator warm-up and lazy initialisation.

Shares are ratios of sums over the warm steps (``sum(data wait) / sum(step wall)``), so a rare long
step weighs what it cost. A rank's *own time* is its step minus the time it spent in synchronising
calls (backward, blocking collectives, DDP's buffer broadcast): under DDP every rank's step lasts as
long as the slowest rank's, and the others wait inside those calls, so own time is what tells a
straggler apart. Without a process group, own time is the step.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

STRAGGLER = 0.10  # own time above the other ranks' median, as a share of the step (docs/features/monitor.md)


def warm_count(timed: int) -> int:
    """Timed steps dropped as warm-up."""
    if timed < 2:
        return 0
    return min(10, max(1, timed // 10))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (``q`` in 0..1) of non-empty ``values``."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def pct(share: float) -> str:
    return f"{share * 100:.0f} %"


def ms(seconds: float) -> str:
    """84.2 ms; 37.82 s from ten seconds up."""
    return f"{seconds * 1000:.1f} ms" if abs(seconds) < 10 else f"{seconds:.2f} s"


def mib(n: float) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def cpus(n: float) -> str:
    return f"{n:.1f}"


@dataclass
class StepFigures:
    steps: int  # step boundaries seen
    timed: int
    warm_steps: int
    warm_from: int  # 0-based number of the first warm step
    median_s: float | None = None
    p90_s: float | None = None
    wall_s: float = 0.0  # sum of the warm steps
    data_wait_s: float = 0.0
    sync_s: float = 0.0
    data_wait_share: float | None = None
    sync_share: float | None = None
    data_wait_median_s: float | None = None
    own_median_s: float | None = None


def step_figures(steps: int, walls: Sequence[float], waits: Sequence[float], syncs: Sequence[float],
                 first_timed: int, distributed: bool) -> StepFigures:
    """Figures of the warm steps; ``first_timed`` is the 1-based boundary that ended ``walls[0]``."""
    timed = len(walls)
    drop = warm_count(timed)
    fig = StepFigures(steps=steps, timed=timed, warm_steps=timed - drop,
                      warm_from=max(0, first_timed - 1) + drop)
    w, d, s = list(walls[drop:]), list(waits[drop:]), list(syncs[drop:])
    if not w:
        return fig
    fig.median_s = statistics.median(w)
    fig.p90_s = percentile(w, 0.9)
    fig.wall_s = sum(w)
    fig.data_wait_s = sum(d)
    fig.sync_s = sum(s)
    if fig.wall_s > 0:
        fig.data_wait_share = min(1.0, fig.data_wait_s / fig.wall_s)
        fig.sync_share = min(1.0, fig.sync_s / fig.wall_s)
    fig.data_wait_median_s = statistics.median(d)
    fig.own_median_s = statistics.median([a - b for a, b in zip(w, s, strict=True)]) if distributed else fig.median_s
    return fig


# --------------------------------------------------------------------------------------------------
# Stragglers


def stragglers(ranks: Mapping[int, Mapping[str, Any]]) -> tuple[dict[int, float], list[dict[str, Any]]]:
    """A score per rank (own time above the other ranks' median, as a share of the median step) and
    the ranks flagged (score >= STRAGGLER) with their evidence."""
    own = {r: float(d["own_median_s"]) for r, d in ranks.items() if d.get("own_median_s") is not None}
    steps = [float(d["step_median_s"]) for d in ranks.values() if d.get("step_median_s")]
    if len(own) < 2 or not steps:
        return {}, []
    step = statistics.median(steps)
    scores: dict[int, float] = {}
    flagged: list[dict[str, Any]] = []
    for rank in sorted(own):
        others = statistics.median([v for r, v in own.items() if r != rank])
        score = (own[rank] - others) / step if step > 0 else 0.0
        scores[rank] = score
        if score < STRAGGLER:
            continue
        evidence = (f"rank {rank} spends {ms(own[rank] - others)} more per step outside synchronisation than "
                    f"the median of the other ranks ({ms(own[rank])} vs {ms(others)}; "
                    f"{pct(score)} of the {ms(step)} step)")
        waits = {r: ranks[r].get("data_wait_median_s") for r in own}
        mine = waits.get(rank)
        rest = [v for r, v in waits.items() if r != rank and v is not None]
        extra_wait = None
        if mine is not None and rest:
            extra_wait = mine - statistics.median(rest)
            evidence += f"; its data wait {ms(mine)} vs {ms(statistics.median(rest))}"
        flagged.append({"rank": rank, "slower_by": round(score, 4), "evidence": evidence,
                        "extra_data_wait_s": extra_wait, "lag_s": own[rank] - others})
    return scores, flagged
