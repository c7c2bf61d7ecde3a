"""The schedule: baseline, one round over every candidate, successive halving with repeats.

1. The baseline (the job as it is, monitor on) runs first; its figures order the search. It fails:
   tune stops (nothing can be compared). It runs a second time at once: the spread between its two
   trials is the noise, and their losses say whether the job is reproducible.
2. Round 1: each candidate once, in search order, while the budget allows the next trial.
3. The best feature setting and the best worker count, when both beat the baseline beyond the
   noise, are tried together.
4. Rounds 2..repeats: the clearly slower are dropped (successive halving), the baseline and the
   leaders run again; until the leaders have ``repeats`` trials or the budget is spent.
5. The leader is ablated and confirmed in alternating blocks beside the baseline (:mod:`.confirm`);
   steps 1-4 keep back the budget those blocks need. Only a confirmed setting is the winner.

Every trial is a fresh process (:mod:`.trial`); a trial that died of torch's exit race at
interpreter exit is run once more, as the project's tests do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loongkit_monitor.tune import confirm, ranking, space, trial
from loongkit_monitor.tune.budget import Budget, Progress, clock_text
from loongkit_monitor.tune.confirm import Confirmation
from loongkit_monitor.tune.facts import Facts
from loongkit_monitor.tune.ranking import BUDGET, NOT_TRIED, OK, Standing, Tolerances, Verdict
from loongkit_monitor.tune.space import Candidate, Skipped
from loongkit_monitor.tune.trial import Setup, TrialResult

HANG_FACTOR = 3.0  # a trial with no exit after 3x the slowest baseline trial hangs ...
HANG_FLOOR_S = 30.0  # ... and never sooner than this (start-up on a loaded machine)

Runner = Callable[..., TrialResult]


def planned_trials(candidates: int, repeats: int) -> int:
    """The trials the schedule expects: two baselines, round 1, then per repeat round the baseline
    and the surviving half (the progress bar's denominator; the budget may cut it short)."""
    total, live = 2 + candidates, candidates
    for _ in range(2, repeats + 1):
        live = max(1, -(-live // 2)) if live else 0
        total += 1 + live
    return total


@dataclass
class Plan:
    steps: int
    max_level: int
    repeats: int = 3
    tolerances: Tolerances = field(default_factory=Tolerances)
    trial_timeout: float | None = None  # None: HANG_FACTOR x the baseline


@dataclass
class Outcome:
    baseline: Standing
    standings: list[Standing]  # candidates in search order (the baseline not included)
    skipped: list[Skipped]
    facts: Facts
    noise: float
    reproducible: ranking.LossCheck
    verdict: Verdict
    elapsed_s: float
    budget_s: float
    trials: int
    fatal: str = ""  # tune could not compare anything (the baseline failed)
    search_verdict: Verdict | None = None  # the search's leader before its confirmation
    confirmation: Confirmation | None = None


class Search:
    def __init__(self, setup: Setup, plan: Plan, facts: Facts, budget: Budget, progress: Progress | None = None,
                 runner: Runner = trial.run) -> None:
        self.setup, self.plan, self.facts, self.budget = setup, plan, facts, budget
        self.progress = progress
        self.runner = runner
        self.trials = 0
        self.planned = 2
        self.baseline = Standing(space.baseline())
        self.standings: list[Standing] = []
        self.skipped: list[Skipped] = []
        self.confirming = False

    def _kept_back(self) -> int:
        """Trials the search leaves in the budget for confirming its leader, once it has one that beats
        the baseline beyond the noise (before that, nothing would be confirmed)."""
        if self.confirming or self.baseline.median is None:
            return 0
        bar = 1 + ranking.noise(self.baseline)
        top = [s for s in ranking.leaders(self.standings)[:2] if (s.speedup(self.baseline) or 0) > bar]
        return max((confirm.trials_needed(s.candidate) for s in top), default=0)

    # -- running ---------------------------------------------------------------------------------
    def _timeout(self) -> tuple[float, bool]:
        """(seconds, whether the budget is what limits them)."""
        if self.plan.trial_timeout:
            hang = self.plan.trial_timeout
        elif self.baseline.trials:
            hang = max(HANG_FLOOR_S, HANG_FACTOR * max(t.wall_s for t in self.baseline.trials))
        else:
            hang = self.budget.remaining()  # the first trial: only the budget bounds it
        left = self.budget.remaining()
        return (left, True) if left <= hang else (hang, False)

    def _run(self, standing: Standing) -> TrialResult | None:
        """One more trial of ``standing``, if the budget allows it (None when it does not)."""
        if not self.budget.allows(keep_trials=self._kept_back()):
            return None
        attempt = len(standing.trials) + 1
        label = f"{standing.key} #{attempt}"
        self._show(label)
        result = None
        for _ in range(2):  # the second pass only after torch's exit race
            timeout, cut = self._timeout()
            result = self.runner(self.setup, standing.candidate, self.trials, attempt, timeout, cut)
            self.trials += 1
            self.budget.record(result.wall_s)
            if not (result.exit_race and self.budget.allows()):
                break
            self._say(f"  {label}: torch's exit race at interpreter exit; running it once more")
        assert result is not None
        standing.trials.append(result)
        self._say(self._result_line(label, result))
        return result

    def _result_line(self, label: str, result: TrialResult) -> str:
        if not result.ok:
            return f"  {label}: {result.error} ({result.wall_s:.0f} s)"
        assert result.step_s is not None
        base = self.baseline.median
        ratio = f", {base / result.step_s:.2f}x the baseline" if base and self.baseline.trials else ""
        return f"  {label}: median step {result.step_s * 1000:.1f} ms{ratio} ({result.wall_s:.0f} s)"

    def _show(self, label: str) -> None:
        if self.progress is not None:
            self.progress.update(self.trials, max(self.planned, self.trials), label)

    def _say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.line(text)

    def _mark_untried(self, standings: Sequence[Standing]) -> None:
        for s in standings:
            if not s.trials:
                s.status, s.reason = BUDGET, f"not tried: the budget ({clock_text(self.budget.seconds)}) ran out"

    # -- the schedule ----------------------------------------------------------------------------
    def run(self) -> Outcome:
        first = self._run(self.baseline)
        if first is None or not first.ok:
            why = first.error if first is not None else "no time for a single trial"
            return self._outcome(fatal=f"the baseline trial failed: {why}")
        self.baseline.status = OK
        candidates, self.skipped = space.build(self.facts, first.figures, self.plan.max_level)
        self.standings = [Standing(c) for c in candidates]
        self.planned = planned_trials(len(self.standings), self.plan.repeats)
        self._run(self.baseline)
        for s in self.standings:  # round 1
            if self._run(s) is None:
                break
            ranking.judge(s, self.baseline, self.plan.tolerances, self._losses_usable())
        self._mark_untried(self.standings)
        self._try_combined()
        for _ in range(2, self.plan.repeats + 1):
            if not self._repeat_round():
                break
        self._judge_all()
        return self._confirmed(self._outcome())

    def _standing_for(self, candidate: Candidate) -> Standing:
        """The search's standing of ``candidate``'s settings, or a new one shown in the table."""
        if not candidate.env:
            return self.baseline
        for s in self.standings:
            if s.candidate.env == candidate.env or dict(s.candidate.env) == dict(candidate.env):
                return s
        made = Standing(candidate)
        self.standings.append(made)
        return made

    def _judge(self, standing: Standing) -> None:
        ranking.judge(standing, self.baseline, self.plan.tolerances, self._losses_usable())

    def _confirmed(self, outcome: Outcome) -> Outcome:
        """The search's leader ablated and confirmed; the verdict becomes what the blocks showed."""
        leader = outcome.verdict.winner
        if leader is None:
            return outcome
        self.confirming = True
        self.planned = self.trials + confirm.trials_needed(leader.candidate)
        checked = confirm.Confirm(self._run, self._standing_for, self.baseline, self._judge).run(leader)
        self._judge_all()
        verdict = Verdict(checked.candidate, checked.text if checked.candidate is not None else
                          f"{checked.text}: keep the job as it is")
        if self.progress is not None:
            self.progress.close()
        return Outcome(self.baseline, self.standings, self.skipped, self.facts, ranking.noise(self.baseline),
                       ranking.reproducible(self.baseline, self.plan.tolerances), verdict,
                       self.budget.elapsed(), self.budget.seconds, self.trials, "", outcome.verdict, checked)

    def _losses_usable(self) -> bool:
        return ranking.reproducible(self.baseline, self.plan.tolerances).ok

    def _judge_all(self) -> None:
        usable = self._losses_usable()
        for s in self.standings:
            if s.trials:
                ranking.judge(s, self.baseline, self.plan.tolerances, usable)

    def _try_combined(self) -> None:
        self._judge_all()
        level_noise = ranking.noise(self.baseline)
        base = self.baseline.median
        if base is None:
            return

        def best(groups: tuple[str, ...]) -> Standing | None:
            live = [s for s in ranking.leaders(self.standings) if s.candidate.group in groups]
            top = live[0] if live else None
            return top if top is not None and (top.speedup(self.baseline) or 0) > 1 + level_noise else None

        features = best((space.LEVELS, space.OPTIONS, space.GPU))
        workers = best((space.WORKERS,))
        if features is None or workers is None:
            return
        combined = Standing(space.combine(features.candidate, workers.candidate))
        if any(s.candidate.env == combined.candidate.env for s in self.standings):
            return
        self.standings.append(combined)
        self.planned += 1
        if self._run(combined) is not None:
            ranking.judge(combined, self.baseline, self.plan.tolerances, self._losses_usable())
        else:
            self._mark_untried([combined])

    def _repeat_round(self) -> bool:
        """Drop the clearly slower, run the baseline and the leaders again; False when nothing ran."""
        self._judge_all()
        ranking.halve(self.standings, ranking.noise(self.baseline))
        live = [s for s in ranking.leaders(self.standings) if len(s.good) < self.plan.repeats]
        if not live:
            return False
        self.planned = max(self.planned, self.trials + 1 + len(live))
        if self._run(self.baseline) is None:
            return False
        for s in live:
            if self._run(s) is None:
                return False
            ranking.judge(s, self.baseline, self.plan.tolerances, self._losses_usable())
        return True

    def _outcome(self, fatal: str = "") -> Outcome:
        level_noise = ranking.noise(self.baseline)
        verdict = (Verdict(None, fatal) if fatal
                   else ranking.choose(self.standings, self.baseline, level_noise))
        for s in self.standings:
            if s.status == NOT_TRIED and not s.reason:
                s.reason = "not tried"
        if self.progress is not None:
            self.progress.close()
        return Outcome(self.baseline, self.standings, self.skipped, self.facts, level_noise,
                       ranking.reproducible(self.baseline, self.plan.tolerances), verdict,
                       self.budget.elapsed(), self.budget.seconds, self.trials, fatal)

