"""Trials folded per candidate: median step, spread, loss check, exclusions, the noise, the winner.

* A candidate's figure is the median of its trials' mean warm steps (the monitor's ``step_mean_s``;
  its median step where a Summary lacks it); its spread the range of those figures relative to it
  (one trial: no spread, shown as such).
* Excluded, and never chosen: a candidate with any trial that crashed or hung, or whose losses are
  not the baseline's within the tolerance (the level-1 tolerance for level 0-1 settings, the
  deep one for level 2-3). The loss check only runs when the job prints losses and two baseline
  runs agree with each other (a job that is not reproducible cannot show a setting changed it).
* The noise is the larger of a floor, the run-to-run deviation of the baseline's own trials (robust:
  one trial disturbed by another job on the machine does not set it) and the standard error of a
  trial's median step (from its p90); successive halving drops the slower half
  of the candidates unless they are inside the noise of the leader, and anything more than three
  times the noise behind; the winner must beat the baseline by more than the noise, else the job's
  own configuration stays.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from loongkit_core.compare import compare_losses
from loongkit_monitor.tune.space import BASELINE, WORKERS_COUNT_ENV, Candidate
from loongkit_monitor.tune.trial import TrialResult

NOISE_FLOOR = 0.02  # 2 %: below this, differences between fresh processes are not worth a setting
CLEAR = 3.0  # behind the leader by more than CLEAR x the noise: dropped whatever the halving keeps
OK, EXCLUDED, DROPPED, NOT_TRIED, BUDGET = "ok", "excluded", "dropped", "not tried", "budget"


@dataclass(frozen=True)
class LossCheck:
    ok: bool
    text: str


@dataclass(frozen=True)
class Tolerances:
    basic: float = 1e-3  # level 0-1 settings: the job's own numerics
    deep: float = 1e-2  # level 2-3 settings

    def for_level(self, level: int) -> float:
        return self.basic if level <= 1 else self.deep


def check_losses(baseline: Sequence[float], candidate: Sequence[float], tolerance: float) -> LossCheck:
    if not baseline:
        return LossCheck(True, "the job prints no losses")
    if not candidate:
        return LossCheck(False, f"changes results: printed no losses (the baseline printed {len(baseline)})")
    if len(candidate) < len(baseline):  # the whole trial or nothing: a divergence grows with the steps
        return LossCheck(False, f"changes results: printed {len(candidate)} losses, the baseline {len(baseline)}")
    n = len(baseline)
    result = compare_losses(list(baseline), list(candidate), n)
    if result["bitwise"]:
        return LossCheck(True, f"{n} losses bitwise identical")
    diff = float(result["max_rel_diff"])
    if diff <= tolerance:
        return LossCheck(True, f"{n} losses within {tolerance:g} (max rel diff {diff:.1e})")
    return LossCheck(False, f"changes results: loss max rel diff {diff:.1e} > tolerance {tolerance:g} "
                            f"over {n} losses")


@dataclass
class Standing:
    candidate: Candidate
    trials: list[TrialResult] = field(default_factory=list)
    status: str = NOT_TRIED
    reason: str = ""
    loss: LossCheck | None = None

    @property
    def key(self) -> str:
        return self.candidate.key

    @property
    def good(self) -> list[TrialResult]:
        return [t for t in self.trials if t.ok]

    @property
    def medians(self) -> list[float]:
        return [t.step_s for t in self.good if t.step_s is not None]

    @property
    def median(self) -> float | None:
        values = self.medians
        return statistics.median(values) if values else None

    @property
    def spread(self) -> float | None:
        """(max - min) / median of the trials' medians; None with fewer than two."""
        values = self.medians
        if len(values) < 2:
            return None
        return (max(values) - min(values)) / statistics.median(values)

    @property
    def data_wait(self) -> float | None:
        shares = [t.figures.data_wait_share for t in self.good
                  if t.figures is not None and t.figures.data_wait_share is not None]
        return statistics.median(shares) if shares else None

    @property
    def wall_s(self) -> float:
        return sum(t.wall_s for t in self.trials)

    @property
    def rankable(self) -> bool:
        return self.status in (OK, DROPPED) and self.median is not None

    def speedup(self, baseline: Standing) -> float | None:
        if self.median is None or baseline.median is None:
            return None
        return baseline.median / self.median


def trial_noise(trial: TrialResult) -> float:
    """Relative standard error of one trial's median step, from its p90 (normal steps: p90 - median
    is about 1.28 sigma; the median's error is about 1.25 sigma / sqrt(n))."""
    f = trial.figures
    if f is None or not f.step_median_s or f.step_p90_s is None or f.warm_steps < 2 or not f.step_s:
        return 0.0
    sigma = max(0.0, f.step_p90_s - f.step_median_s) / 1.28
    return 1.25 * sigma / math.sqrt(f.warm_steps) / f.step_s


def run_to_run(values: Sequence[float]) -> float | None:
    """Relative standard deviation between trials, robust to one disturbed trial (another job on the
    machine): 1.4826 x the median absolute deviation from three trials on, the range / sqrt(2) with two."""
    if len(values) < 2:
        return None
    mid = statistics.median(values)
    if mid <= 0:
        return None
    if len(values) == 2:
        return abs(values[0] - values[1]) / math.sqrt(2) / mid
    return 1.4826 * statistics.median(abs(v - mid) for v in values) / mid


def noise(baseline: Standing) -> float:
    within = statistics.median([trial_noise(t) for t in baseline.good]) if baseline.good else 0.0
    return max(NOISE_FLOOR, run_to_run(baseline.medians) or 0.0, within)


def reproducible(baseline: Standing, tolerances: Tolerances) -> LossCheck:
    """Do the baseline's own trials print the same losses?"""
    runs = [t for t in baseline.good if t.losses]
    if len(runs) < 2:
        return LossCheck(True, "one baseline run with losses" if runs else "the job prints no losses")
    check = check_losses(runs[0].losses, runs[1].losses, tolerances.basic)
    if check.ok:
        return LossCheck(True, f"two baseline runs agree: {check.text}")
    return LossCheck(False, f"the job's losses differ between two baseline runs ({check.text.split(': ', 1)[-1]}): "
                            "not reproducible, so not used to exclude settings")


def tolerance_of(trial: TrialResult, standing: Standing, tolerances: Tolerances) -> float:
    """The result tolerance of the features that ran in ``trial`` (a level-3 switch that enabled only
    level-1 code here is held to level 1's), else of the candidate's level."""
    level = trial.active_level if trial.active_level is not None else standing.candidate.level
    return tolerances.for_level(level)


def judge(standing: Standing, baseline: Standing, tolerances: Tolerances, losses_usable: bool) -> None:
    """Set ``standing``'s status from its trials: excluded (crash, hang, changed losses) or ok."""
    if standing.status == BUDGET and not standing.trials:
        return
    bad = next((t for t in standing.trials if t.error and t.kind in ("crash", "hang", "no figures")), None)
    if bad is not None:
        standing.status, standing.reason = EXCLUDED, bad.error
        return
    if not standing.good:
        cut = next((t for t in standing.trials if t.kind == "budget"), None)
        standing.status, standing.reason = (BUDGET, cut.error) if cut else (NOT_TRIED, standing.reason)
        return
    base_losses = next((t.losses for t in baseline.good if t.losses), [])
    if standing.candidate.group == BASELINE or not losses_usable:
        standing.loss = None
    else:
        for trial in standing.good:
            check = check_losses(base_losses, trial.losses, tolerance_of(trial, standing, tolerances))
            if not check.ok:
                standing.status, standing.reason, standing.loss = EXCLUDED, check.text, check
                return
            standing.loss = check
    if standing.status != DROPPED:
        standing.status, standing.reason = OK, ""


def leaders(standings: Sequence[Standing]) -> list[Standing]:
    """Candidates still in the race (not the baseline), fastest first."""
    live = [s for s in standings if s.status == OK and s.median is not None and s.candidate.group != BASELINE]
    return sorted(live, key=lambda s: s.median or math.inf)


def halve(standings: Sequence[Standing], level_noise: float, keep_fraction: float = 0.5) -> list[Standing]:
    """Successive halving: drop the clearly slower and keep the faster part; returns those dropped."""
    ranked = leaders(standings)
    if len(ranked) <= 1:
        return []
    best = ranked[0].median or math.inf
    keep = max(1, math.ceil(len(ranked) * keep_fraction))
    dropped = []
    for i, s in enumerate(ranked):
        behind = (s.median or math.inf) / best - 1
        # "Clearly slower" is beyond three times the noise: the noise comes from two or three baseline
        # trials and one trial of each, so a tighter cut drops equal candidates on a loaded machine.
        # The slower half goes too, unless it is inside the noise of the leader, and only once both it
        # and the leader have two trials: one trial each is a difference of two noisy draws.
        repeated = len(s.good) >= 2 and len(ranked[0].good) >= 2
        if behind > CLEAR * level_noise or (i >= keep and repeated and behind > level_noise):
            s.status = DROPPED
            s.reason = f"{behind:.0%} slower than {ranked[0].key} after {len(s.good)} trial(s)"
            dropped.append(s)
    return dropped


@dataclass(frozen=True)
class Verdict:
    winner: Standing | None  # None: keep the job as it is
    text: str


def choose(standings: Sequence[Standing], baseline: Standing, level_noise: float) -> Verdict:
    ranked = leaders(standings)
    if baseline.median is None:
        return Verdict(None, "the baseline has no figures: nothing to compare against")
    if not ranked:
        return Verdict(None, "no candidate finished cleanly: keep the job as it is")
    best = ranked[0]
    speedup = best.speedup(baseline) or 0.0
    if speedup <= 1 + level_noise:
        return Verdict(None, f"no candidate beats the job as it is beyond the noise ({level_noise:.1%}); "
                             f"the fastest, {best.key}, is {speedup:.2f}x: keep the job as it is")
    fewer = _fewer_workers(best, ranked, level_noise)
    tie = ""
    if fewer is not None:
        tie = f"; {best.key} was {best.speedup(fewer) or 0.0:.2f}x it, inside the noise: fewer workers win the tie"
        best, speedup = fewer, fewer.speedup(baseline) or 0.0
    trials = len(best.good)
    return Verdict(best, f"{best.key}: {speedup:.2f}x the baseline's median step over {trials} trial(s) "
                         f"(noise {level_noise:.1%}){tie}")


def _workers(candidate: Candidate) -> tuple[int | None, tuple[tuple[str, str], ...]]:
    """(its worker count, the rest of its settings)."""
    env = dict(candidate.env)
    count = env.pop(WORKERS_COUNT_ENV, None)
    return (int(count) if count is not None and count.isdigit() else None), tuple(sorted(env.items()))


def _fewer_workers(best: Standing, ranked: Sequence[Standing], level_noise: float) -> Standing | None:
    """The candidate with the fewest workers that differs from ``best`` in its worker count alone and is
    inside the noise of it: each worker costs memory and CPU, so a gain the noise hides does not pay for
    them (the simpler setting wins a tie, as in the ablation)."""
    count, rest = _workers(best.candidate)
    if count is None or best.median is None:
        return None
    fewest: tuple[int, Standing] | None = None
    for s in ranked:
        if s.median is None or s.median > best.median * (1 + level_noise):
            continue
        n, other = _workers(s.candidate)
        if n is not None and n < count and other == rest and (fewest is None or n < fewest[0]):
            fewest = (n, s)
    return fewest[1] if fewest else None
