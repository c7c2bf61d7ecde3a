"""The winner proven before it is printed: its parts ablated, then alternating pairs against the baseline.

The search ranks candidates by trials run one after another, while the machine's load drifts, and it
credits a combined setting as a whole. Before tune prints a winner:

1. Ablation (leave one out): a winner made of several parts (``ALL=1 +CONFIG_GUARDS_APPLY_FIX``,
   ``ALL=2 + workers=3``) runs in blocks beside each of its leave-one-out variants and the baseline,
   one trial of each per block, the order rotating from block to block. A part whose removal costs
   no more than the noise (the median over the blocks of the variant's step over the winner's) is
   left out, the one that costs least first, and the ablation goes on with what remains: the simpler
   setting wins a tie, and a part is kept only when the job is measurably slower without it.
2. Confirmation: what remains against the baseline, over the same blocks: every paired ratio
   (baseline step / candidate step within one block) above 1 + the noise (a gain one block in three
   does not show is not one to change a job's settings for), and their median at least MIN_GAIN.
   The gain tune claims is that median, with the range of the pairs as its spread.

A candidate that fails is not printed as the winner: the verdict keeps the job as it is and says what
the pairs showed. Pairs cut short by the budget confirm nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loongkit_monitor.advice import MIN_GAIN as MIN_ADVISED_GAIN
from loongkit_monitor.tune import ranking, space
from loongkit_monitor.tune.ranking import EXCLUDED, Standing
from loongkit_monitor.tune.space import Candidate, Part
from loongkit_monitor.tune.trial import TrialResult

# The gain below which the product advises nothing (the monitor's claims use the same bar): a changed
# setting is a risk on the user's next job and machine, worth taking for a real gain only.
MIN_GAIN = MIN_ADVISED_GAIN
BLOCKS = 3  # trials of each arm per confirmation; two complete blocks at the least
MIN_BLOCKS = 2


def trials_needed(candidate: Candidate) -> int:
    """Trials a confirmation of ``candidate`` takes (its first round of blocks): the budget the search
    keeps back for it."""
    parts = len(candidate.pieces)
    return BLOCKS * (2 + (parts if parts > 1 else 0))


@dataclass
class Confirmation:
    candidate: Standing | None  # what was confirmed (after ablation); None: nothing
    gain: float | None = None  # median of the paired ratios
    low: float | None = None  # their range
    high: float | None = None
    pairs: int = 0
    ablation: list[str] = field(default_factory=list)  # one line per part checked
    text: str = ""

    @property
    def spread(self) -> str:
        if self.gain is None or self.low is None or self.high is None:
            return ""
        return f"{self.low:.2f}-{self.high:.2f}x over {self.pairs} pairs"


class Confirm:
    """Runs the blocks through the search's own trial runner and standings."""

    def __init__(self, run: Callable[[Standing], TrialResult | None], standing_for: Callable[[Candidate], Standing],
                 baseline: Standing, judge: Callable[[Standing], None]) -> None:
        self.run_one, self.standing_for, self.baseline, self.judge = run, standing_for, baseline, judge
        self.ablation: list[str] = []

    def _blocks(self, arms: Sequence[Standing]) -> tuple[dict[int, list[float | None]], int]:
        """One trial of every arm per block, the order rotating; (step per block by arm id, blocks done)."""
        steps: dict[int, list[float | None]] = {id(a): [] for a in arms}
        done = 0
        for b in range(BLOCKS):
            order = [arms[(i + b) % len(arms)] for i in range(len(arms))]
            results: dict[int, float | None] = {}
            for arm in order:
                result = self.run_one(arm)
                if result is None:  # the budget: this block is incomplete
                    return steps, done
                results[id(arm)] = result.step_s if result.ok else None
            for arm in arms:
                steps[id(arm)].append(results[id(arm)])
            done += 1
        return steps, done

    @staticmethod
    def _ratios(num: Sequence[float | None], den: Sequence[float | None]) -> list[float]:
        return [a / b for a, b in zip(num, den, strict=True) if a and b]

    def run(self, winner: Standing) -> Confirmation:
        current = winner
        while True:
            parts = list(current.candidate.pieces)
            variants: list[tuple[Part, Standing]] = []
            if len(parts) > 1:
                variants = [(p, self.standing_for(space.without(current.candidate, p))) for p in parts]
            arms = [current, *(s for _, s in variants), self.baseline]
            steps, done = self._blocks(arms)
            for arm in arms:
                if arm is not self.baseline:
                    self.judge(arm)
            if done < MIN_BLOCKS:
                return Confirmation(None, pairs=done, ablation=self.ablation,
                                    text=f"{current.key} not confirmed: the budget ran out after {done} "
                                         f"block(s) of alternating trials")
            level_noise = ranking.noise(self.baseline)
            if current.status == EXCLUDED:
                return Confirmation(None, pairs=done, ablation=self.ablation,
                                    text=f"{current.key} not confirmed: {current.reason}")
            droppable: list[tuple[float, Part, Standing]] = []
            for part, variant in variants:
                costs = self._ratios(steps[id(variant)], steps[id(current)])  # > 1: slower without the part
                if variant.status == EXCLUDED or len(costs) < MIN_BLOCKS:
                    why = variant.reason if variant.status == EXCLUDED else "too few clean trials without it"
                    self.ablation.append(f"{part.label} kept: {why}")
                    continue
                cost = statistics.median(costs)
                if cost > 1 + level_noise:
                    self.ablation.append(f"{part.label} kept: without it {cost:.2f}x the step "
                                         f"({len(costs)} pairs, noise {level_noise:.1%})")
                else:
                    droppable.append((cost, part, variant))
            if droppable:
                cost, part, variant = min(droppable, key=lambda d: d[0])
                self.ablation.append(f"{part.label} left out: without it {cost:.2f}x the step, inside the noise "
                                     f"({level_noise:.1%}): {variant.key} instead")
                current = variant
                if len(current.candidate.pieces) > 1:
                    continue  # ablate what remains in a new round of blocks
            return self._confirm(current, steps, level_noise)

    def _confirm(self, current: Standing, steps: dict[int, list[float | None]], level_noise: float) -> Confirmation:
        if current.candidate.group == space.BASELINE:
            return Confirmation(None, ablation=self.ablation, text="no part of the winner helps: keep the job as it is")
        gains = self._ratios(steps[id(self.baseline)], steps[id(current)])
        if len(gains) < MIN_BLOCKS:
            return Confirmation(None, pairs=len(gains), ablation=self.ablation,
                                text=f"{current.key} not confirmed: {len(gains)} clean pair(s) with the baseline")
        gain = statistics.median(gains)
        found = Confirmation(current, gain, min(gains), max(gains), len(gains), self.ablation)
        if min(gains) > 1 + level_noise and gain >= MIN_GAIN:
            found.text = (f"{current.key}: {gain:.2f}x the baseline, confirmed in {len(gains)} alternating pairs "
                          f"({found.spread}; noise {level_noise:.1%})")
            return found
        found.candidate = None
        found.text = (f"{current.key} not confirmed: {gain:.2f}x the baseline in {len(gains)} alternating pairs "
                      f"({found.spread}): not every pair faster beyond the noise ({level_noise:.1%}), or "
                      f"less than the {MIN_GAIN:.2f}x a changed setting must give")
        return found
