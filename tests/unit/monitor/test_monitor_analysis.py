"""Figures and straggler scores (the recommendations made from them: test_monitor_advice.py)."""

from __future__ import annotations

import pytest
from loongkit_monitor import analysis


def test_warm_up_drops_a_tenth_within_bounds() -> None:
    assert [analysis.warm_count(n) for n in (0, 1, 2, 9, 10, 35, 100, 5000)] == [0, 0, 1, 1, 1, 3, 10, 10]


def test_durations_read_as_ms_then_seconds() -> None:
    assert (analysis.ms(0.0842), analysis.ms(37.81595), analysis.pct(0.412), analysis.cpus(3.94)) == \
        ("84.2 ms", "37.82 s", "41 %", "3.9")


def test_percentile_interpolates() -> None:
    assert analysis.percentile([1.0], 0.9) == 1.0
    assert analysis.percentile([float(v) for v in range(1, 11)], 0.9) == pytest.approx(9.1)


def test_step_figures_on_planted_steps() -> None:
    walls = [5.0] + [0.1] * 19  # a slow first step (worker start-up): dropped as warm-up
    waits = [4.0] + [0.04] * 19
    syncs = [0.0] + [0.05] * 19
    fig = analysis.step_figures(21, walls, waits, syncs, first_timed=2, distributed=True)
    assert (fig.steps, fig.timed, fig.warm_steps, fig.warm_from) == (21, 20, 18, 3)
    assert fig.median_s == pytest.approx(0.1) and fig.p90_s == pytest.approx(0.1)
    assert fig.data_wait_share == pytest.approx(0.4)
    assert fig.sync_share == pytest.approx(0.5)
    assert fig.own_median_s == pytest.approx(0.05)  # step minus synchronisation
    alone = analysis.step_figures(21, walls, waits, syncs, first_timed=2, distributed=False)
    assert alone.own_median_s == pytest.approx(0.1)  # no process group: own time is the step


def test_no_timed_step_gives_no_figures() -> None:
    fig = analysis.step_figures(1, [], [], [], first_timed=0, distributed=False)
    assert fig.median_s is None and fig.data_wait_share is None and fig.warm_steps == 0


def rank(own: float, step: float = 0.1, wait: float = 0.001) -> dict[str, float]:
    return {"own_median_s": own, "step_median_s": step, "data_wait_median_s": wait}


def test_the_slowed_rank_is_flagged_and_the_others_are_not() -> None:
    scores, flagged = analysis.stragglers({0: rank(0.02), 1: rank(0.06, wait=0.04), 2: rank(0.021), 3: rank(0.019)})
    assert [f["rank"] for f in flagged] == [1]
    assert scores[1] == pytest.approx((0.06 - 0.02) / 0.1)
    assert all(scores[r] < analysis.STRAGGLER for r in (0, 2, 3))
    assert "rank 1 spends 40.0 ms more per step" in flagged[0]["evidence"]
    assert "its data wait 40.0 ms vs 1.0 ms" in flagged[0]["evidence"]


def test_two_ranks_compare_each_with_the_other() -> None:
    _, flagged = analysis.stragglers({0: rank(0.012), 1: rank(0.052)})
    assert [f["rank"] for f in flagged] == [1]
    _, none = analysis.stragglers({0: rank(0.050), 1: rank(0.052)})
    assert none == []


def test_one_rank_or_no_figures_has_no_stragglers() -> None:
    assert analysis.stragglers({0: rank(0.02)}) == ({}, [])
    assert analysis.stragglers({0: {"own_median_s": None}, 1: {"own_median_s": None}}) == ({}, [])
