"""Figures, straggler scores and recommendations: each recommendation appears with the figures that
triggered it, never below its threshold, and never for a setting the job already follows."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from loongkit_monitor import analysis
from loongkit_monitor.analysis import Facts, FeatureView


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


# --------------------------------------------------------------------------------------------------
def figures(share: float, steps: int = 100) -> analysis.StepFigures:
    walls = [0.1] * steps
    return analysis.step_figures(steps, walls, [0.1 * share] * steps, [0.0] * steps, 1, False)


def facts(share: float = 0.41, **kw: object) -> Facts:
    base = Facts(figures=figures(share), num_workers=4, worker_slots=4, workers_cpu=3.9, main_cpu=0.05,
                 allowed=4.0, context="fork", persistent=True, torch_threads=1,
                 features={"distortion": FeatureView("LOONGKIT_DISTORTION", False, True),
                           "imnormalize": FeatureView("LOONGKIT_IMNORMALIZE", False, True)})
    return replace(base, **kw)  # type: ignore[arg-type]


def numbers(text: str) -> list[str]:
    return re.findall(r"\d+(?:\.\d+)?", text)


def test_data_bound_with_saturated_workers_names_the_data_kernels_with_the_figures() -> None:
    recs = analysis.recommendations(facts())
    assert recs == [{"setting": "LOONGKIT_DISTORTION=1 / LOONGKIT_IMNORMALIZE=1",
                     "evidence": "data wait 41 % of the step, 4 workers use 3.9 of 4.0 allowed CPUs "
                                 "(main process 0.1)"}]


def test_no_recommendation_below_the_threshold() -> None:
    assert analysis.recommendations(facts(share=0.10)) == []


def test_kernels_already_enabled_or_irrelevant_are_not_recommended() -> None:
    on = {"distortion": FeatureView("LOONGKIT_DISTORTION", True, True),
          "imnormalize": FeatureView("LOONGKIT_IMNORMALIZE", False, False)}  # enabled / no mmcv in this job
    recs = analysis.recommendations(facts(features=on))
    assert [r["setting"] for r in recs] == ["the job's per-sample transforms (cheaper) or more CPUs for the job"]
    assert "4 workers use 3.9 of 4.0 allowed CPUs" in recs[0]["evidence"]


def test_spare_cpus_recommend_more_workers_and_loongkits_knob() -> None:
    views = {"dataloader_workers": FeatureView("LOONGKIT_DATALOADER_WORKERS", False, True)}
    recs = analysis.recommendations(facts(num_workers=2, worker_slots=2, workers_cpu=1.9, main_cpu=0.1, allowed=8.0,
                                          features=views))
    assert recs[0]["setting"] == ("DataLoader(num_workers=8), or with no code change LOONGKIT_DATALOADER_WORKERS=1 "
                                  "LOONGKIT_DATALOADER_WORKERS_COUNT=8")
    assert "2 workers use 1.9 of 8.0 allowed CPUs (main process 0.1): 6.0 CPUs idle" in recs[0]["evidence"]
    # the job already runs that count through loongkit: nothing to say
    on = {"dataloader_workers": FeatureView("LOONGKIT_DATALOADER_WORKERS", True, True)}
    followed = facts(num_workers=2, worker_slots=2, workers_cpu=1.9, allowed=8.0, features=on,
                     options={"LOONGKIT_DATALOADER_WORKERS_COUNT": "8"})
    assert analysis.recommendations(followed) == []


def test_no_workers_recommends_workers_only_with_cpus_to_run_them() -> None:
    recs = analysis.recommendations(facts(num_workers=0, worker_slots=0, workers_cpu=None, allowed=4.0))
    assert recs[0]["setting"] == "DataLoader(num_workers=3)"
    assert recs[0]["evidence"].startswith("data wait 41 % of the step with num_workers=0")
    assert analysis.recommendations(facts(num_workers=0, worker_slots=0, workers_cpu=None, allowed=1.0)) == []


def test_workers_starved_by_other_processes() -> None:
    recs = analysis.recommendations(facts(workers_cpu=0.8, workers_cpu_wait=0.6, allowed=4.0))
    assert recs[0]["setting"].startswith("dedicated CPUs for the job")
    assert "each worker waited for a CPU 60 % of the time" in recs[0]["evidence"]


def test_idle_workers_waiting_on_io() -> None:
    recs = analysis.recommendations(facts(workers_cpu=0.4))
    assert recs[0]["setting"] == "DataLoader(num_workers=8) (or a larger prefetch_factor)"
    assert "4 workers use 0.4 of 4.0 allowed CPUs" in recs[0]["evidence"]


def test_epoch_restarts_recommend_persistent_workers_unless_already_persistent() -> None:
    restarting = facts(workers_cpu=0.4, persistent=False, epochs=5, epoch_start_wait_s=9.0, total_wait_s=12.0)
    settings = [r["setting"] for r in analysis.recommendations(restarting)]
    assert "DataLoader(persistent_workers=True)" in settings
    evidence = next(r["evidence"] for r in analysis.recommendations(restarting)
                    if r["setting"] == "DataLoader(persistent_workers=True)")
    assert "each of 5 epochs: 1.80 s per epoch start, 75 % of all data wait" in evidence
    persistent = replace(restarting, persistent=True)
    assert "DataLoader(persistent_workers=True)" not in [r["setting"] for r in analysis.recommendations(persistent)]


def test_worker_memory_growth_in_fork_workers() -> None:
    view = {"pytorch_memory": FeatureView("LOONGKIT_PYTORCH", False, True)}
    grown = facts(share=0.0, worker_growth=300 << 20, features=view)
    recs = analysis.recommendations(grown)
    assert recs == [{"setting": "LOONGKIT_PYTORCH=1",
                     "evidence": "each fork worker's private memory grew 300 MiB on average over 100 steps "
                                 "(copy-on-write of the dataset's Python objects)"}]
    assert analysis.recommendations(replace(grown, worker_growth=10 << 20)) == []
    enabled = {"pytorch_memory": FeatureView("LOONGKIT_PYTORCH", True, True)}
    assert analysis.recommendations(replace(grown, features=enabled)) == []
    assert analysis.recommendations(replace(grown, context="spawn")) == []


def test_oversubscribed_cpus_name_the_config_guards() -> None:
    over = facts(share=0.0, main_cpu=2.0, workers_cpu=2.0, torch_threads=4, allowed=4.0,
                 features={"config_guards": FeatureView("LOONGKIT_CONFIG_GUARDS", False, True)})
    recs = analysis.recommendations(over)
    assert recs[0]["setting"] == "LOONGKIT_CONFIG_GUARDS=1 LOONGKIT_CONFIG_GUARDS_APPLY_FIX=1"
    assert "main process 2.0 + workers 2.0 CPUs busy of 4.0 allowed, with 4 torch intra-op threads" in \
        recs[0]["evidence"]
    guarded = replace(over, features={"config_guards": FeatureView("LOONGKIT_CONFIG_GUARDS", True, True)},
                      options={"LOONGKIT_CONFIG_GUARDS_APPLY_FIX": "1"})
    assert analysis.recommendations(guarded) == []


def test_gpu_idle_without_data_wait() -> None:
    recs = analysis.recommendations(facts(share=0.02, gpu_idle=0.45))
    assert recs[0]["evidence"].startswith("GPU idle 45 % of the step while data wait is 2 %")
    assert analysis.recommendations(facts(share=0.02, gpu_idle=0.1)) == []


def test_straggler_on_the_wrong_numa_node_names_numa_affinity() -> None:
    flag = {"rank": 3, "slower_by": 0.18, "evidence": "", "extra_data_wait_s": 0.0, "lag_s": 0.018}
    numa = {3: {"cpu_nodes": [1], "gpu_node": 0}, 0: {"cpu_nodes": [0], "gpu_node": 0}}
    views = {"numa_affinity": FeatureView("LOONGKIT_NUMA_AFFINITY", False, True)}
    recs = analysis.recommendations(facts(share=0.0, flagged=[flag], numa=numa, features=views))
    assert recs == [{"setting": "LOONGKIT_NUMA_AFFINITY=1",
                     "evidence": "rank 3 is 18 % slower than the median of the other ranks and runs on NUMA node 1 "
                                 "while its GPU is on node 0"}]
    on = {"numa_affinity": FeatureView("LOONGKIT_NUMA_AFFINITY", True, True)}
    assert analysis.recommendations(facts(share=0.0, flagged=[flag], numa=numa, features=on)) == []
    same_node = {3: {"cpu_nodes": [0], "gpu_node": 0}}
    assert analysis.recommendations(facts(share=0.0, flagged=[flag], numa=same_node, features=views)) == []


def test_a_straggler_slowed_by_its_data_is_told_so() -> None:
    flag = {"rank": 1, "slower_by": 0.4, "evidence": "", "extra_data_wait_s": 0.03, "lag_s": 0.04}
    recs = analysis.recommendations(facts(share=0.0, flagged=[flag]))
    assert recs == [{"setting": "rank 1's DataLoader (num_workers) or its data shard",
                     "evidence": "rank 1 is 40 % slower than the median of the other ranks and waits 30.0 ms more "
                                 "per step for data"}]


def test_every_recommendation_carries_numbers() -> None:
    cases = [facts(), facts(workers_cpu=0.4), facts(num_workers=0, worker_slots=0, workers_cpu=None)]
    for case in cases:
        for rec in analysis.recommendations(case):
            assert numbers(rec["evidence"]), rec


def test_no_steps_no_recommendations() -> None:
    empty = Facts(figures=analysis.step_figures(0, [], [], [], 0, False), num_workers=0)
    assert analysis.recommendations(empty) == []
