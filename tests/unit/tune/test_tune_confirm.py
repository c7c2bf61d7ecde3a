"""The confirmation's rules on planted step times (no process): ablation, pairs, the budget."""

from __future__ import annotations

from collections.abc import Callable

from loongkit_monitor.tune import confirm, ranking, space
from loongkit_monitor.tune.ranking import OK, Standing, Tolerances
from loongkit_monitor.tune.trial import TrialResult
from tune_helpers import figures

ALL1 = space.Candidate("ALL=1", (("LOONGKIT_ALL", "1"),), space.LEVELS, 1)
WORKERS3 = space.Candidate("workers=3", (("LOONGKIT_DATALOADER_WORKERS", "1"),
                                         ("LOONGKIT_DATALOADER_WORKERS_COUNT", "3")), space.WORKERS, 0)


def trial(step: float) -> TrialResult:
    return TrialResult("x", 1, 0, 1.0, figures(step_median_s=step, step_p90_s=step), [1.0, 0.5])


def setup(steps: dict[str, Callable[[int], float]], budget: int = 99) -> tuple[confirm.Confirm, list[Standing]]:
    """Standings keyed by their settings; ``steps[key](n)`` is the step of its n-th trial."""
    baseline = Standing(space.baseline(), [trial(0.1), trial(0.1)], OK)
    made: list[Standing] = []
    calls = {"n": 0}

    def standing_for(c: space.Candidate) -> Standing:
        if not c.env:
            return baseline
        found = next((s for s in made if dict(s.candidate.env) == dict(c.env)), None)
        if found is None:
            found = Standing(c)
            made.append(found)
        return found

    def run(s: Standing) -> TrialResult | None:
        calls["n"] += 1
        if calls["n"] > budget:
            return None
        result = trial(steps[s.key](len(s.trials)))
        s.trials.append(result)
        return result

    def judge(s: Standing) -> None:
        ranking.judge(s, baseline, Tolerances(), True)

    steps.setdefault("baseline", lambda n: 0.1)
    return confirm.Confirm(run, standing_for, baseline, judge), made


def test_the_part_that_carries_the_gain_is_kept_and_the_other_left_out() -> None:
    both = space.combine(ALL1, WORKERS3)
    check, made = setup({both.key: lambda n: 0.050, "ALL=1": lambda n: 0.099, "workers=3": lambda n: 0.0505})
    leader = Standing(both, [trial(0.05)], OK)
    made.append(leader)
    found = check.run(leader)
    assert found.candidate is not None and found.candidate.key == "workers=3"
    assert found.ablation[0].startswith("workers=3 kept: without it 1.98x the step (3 pairs")
    assert found.ablation[1].startswith("ALL=1 left out: without it 1.01x the step, inside the noise")
    assert found.pairs == 3 and found.gain is not None and abs(found.gain - 0.1 / 0.0505) < 1e-9


def test_one_block_without_the_gain_and_it_is_not_confirmed() -> None:
    check, _ = setup({"ALL=1": lambda n: 0.080 if n != 1 else 0.099})
    found = check.run(Standing(ALL1, [], OK))
    assert found.candidate is None and found.pairs == 3
    assert found.text.startswith("ALL=1 not confirmed: 1.25x the baseline in 3 alternating pairs (1.01-1.25x")


def test_blocks_cut_by_the_budget_confirm_nothing() -> None:
    check, _ = setup({"ALL=1": lambda n: 0.05}, budget=3)  # one block (2 trials) and a half
    found = check.run(Standing(ALL1, [], OK))
    assert found.candidate is None
    assert found.text == "ALL=1 not confirmed: the budget ran out after 1 block(s) of alternating trials"


def test_the_trials_kept_back_follow_the_parts() -> None:
    assert confirm.trials_needed(ALL1) == 6
    assert confirm.trials_needed(space.combine(ALL1, WORKERS3)) == 12
