"""Recommendations are claims from a model of the step: each names its cause, its knob and its
expected effect; none is made for a setting the job already has or one with nothing to do here, and
a figure near a decision's boundary gives "unclear", not a verdict that flips between runs.

The jobs here are the ones of issue 31, as figures; the feature views are keyed by the monitor's
real handles and one test builds them from loongkit-data's real declarations."""

from __future__ import annotations

import importlib.metadata
from dataclasses import replace

import pytest
from loongkit_monitor import analysis
from loongkit_monitor.advice import Facts, FeatureView, advise, fit
from loongkit_monitor.dataset import DatasetView
from loongkit_monitor.feature import feature_views
from loongkit_monitor.plugin import CONFIG_GUARDS, DATALOADER_WORKERS, DISTORTION, IMNORMALIZE, PYTORCH

from loongkit_core.feature import FeatureRecord, State
from loongkit_core.hookspecs import ENTRY_POINT_GROUP


def figures(step: float = 0.1, share: float = 0.0, steps: int = 100) -> analysis.StepFigures:
    return analysis.step_figures(steps, [step] * steps, [step * share] * steps, [0.0] * steps, 1, False)


def job(step: float = 0.1, share: float = 0.0, **kw: object) -> Facts:
    base = Facts(figures=figures(step, share), num_workers=2, worker_slots=2, workers_cpu=0.1, main_cpu=1.0,
                 allowed=2.0, context="fork", persistent=True, torch_threads=1, others_cpu=0.0, main_cpu_wait=0.02,
                 workers_cpu_wait=0.01, window_s=20.0, main_rss=500e6, batch_size=32)
    return replace(base, **kw)  # type: ignore[arg-type]


def kinds(facts: Facts) -> list[str]:
    return [r["kind"] for r in advise(facts).recommendations]


def test_a_healthy_job_gets_nothing() -> None:
    out = advise(job())
    assert out.recommendations == [] and out.unclear == []


def test_num_workers_zero_with_numpy_work_per_sample_names_workers_with_the_gain() -> None:
    # 28 ms of numpy per sample x 8 in the main process, 20 ms of compute: data wait ~92 %
    slow = job(step=0.244, share=0.918, num_workers=0, worker_slots=0, workers_cpu=None, main_cpu=1.0)
    recs = advise(slow).recommendations
    assert [r["kind"] for r in recs] == ["workers"]
    assert recs[0]["setting"].startswith("DataLoader(num_workers=2)")  # loading is 92 % of the CPU: both CPUs
    assert "loads every batch itself" in recs[0]["cause"] and "x" in recs[0]["expected"]


def test_threads_beside_busy_workers_are_the_jobs_own_not_other_processes() -> None:
    # torch.set_num_threads(8) beside 2 busy workers on 2 CPUs, nothing else running: the model has the
    # one CPU the workers leave (the suite measured 1 thread 1.71x faster there)
    own = job(torch_threads=8, workers_cpu=1.0, main_cpu=1.0, main_cpu_wait=0.6, others_cpu=0.0)
    recs = advise(own).recommendations
    assert [r["kind"] for r in recs] == ["threads"]
    assert recs[0]["setting"].startswith("torch.set_num_threads(1)")
    assert "other processes kept 0.0 CPUs busy" in recs[0]["evidence"]


def test_a_thread_or_two_over_the_cpus_beside_busy_workers_is_unclear() -> None:
    close = job(torch_threads=2, workers_cpu=1.0, main_cpu=1.0, main_cpu_wait=0.6, others_cpu=0.0)
    out = advise(close)
    assert out.recommendations == []
    assert any("2 torch threads" in u and "only a trial can tell" in u for u in out.unclear)


def test_threads_alone_exceeding_the_cpus_name_set_num_threads() -> None:
    own = job(torch_threads=8, num_workers=0, workers_cpu=None, main_cpu=2.0, main_cpu_wait=0.5)
    recs = advise(own).recommendations
    assert [r["kind"] for r in recs] == ["threads"]
    assert recs[0]["setting"] == "torch.set_num_threads(2) (or OMP_NUM_THREADS=2)"


def test_config_guards_fix_is_named_only_when_its_dry_run_found_the_threads() -> None:
    own = job(torch_threads=8, num_workers=0, workers_cpu=None, main_cpu=2.0, main_cpu_wait=0.5)
    idle = {CONFIG_GUARDS: FeatureView("LOONGKIT_CONFIG_GUARDS", True, True, {"findings": []})}
    assert "APPLY_FIX" not in advise(replace(own, features=idle)).recommendations[0]["setting"]
    found = {CONFIG_GUARDS: FeatureView("LOONGKIT_CONFIG_GUARDS", True, True, {
        "findings": ["torch intra-op threads 8 x 1 local ranks exceed the 2 CPUs: torch.set_num_threads(2)"]})}
    assert "LOONGKIT_CONFIG_GUARDS_APPLY_FIX=1" in advise(replace(own, features=found)).recommendations[0]["setting"]


def test_a_noisy_neighbour_is_named_with_what_runs_there() -> None:
    crowded = job(main_cpu=0.9, main_cpu_wait=0.45, others_cpu=1.0, neighbours=[("stress", 4242, 0.98)])
    recs = advise(crowded).recommendations
    assert [r["kind"] for r in recs] == ["dedicated_cpus"]
    assert "stress (pid 4242, 1.0 CPUs)" in recs[0]["cause"]


def test_a_main_process_leak_is_named_with_the_time_to_the_limit() -> None:
    points = [(t * 0.5, 400e6 + t * 0.5 * 25 * (5 << 20)) for t in range(40)]  # 5 MiB per step at 25 steps/s
    slope = fit(points)
    assert slope is not None and slope.r2 > 0.99
    leak = job(step=0.04, main_slope=slope, main_rss=points[-1][1], memory_limit=8 << 30, memory_limit_note="host",
               blocks_per_s=5000.0)
    recs = advise(leak).recommendations
    assert [r["kind"] for r in recs] == ["memory_main"]
    assert "keeps 5 MiB per step" in recs[0]["cause"] and "Python objects" in recs[0]["cause"]
    assert " h" in recs[0]["evidence"] and "limit" in recs[0]["evidence"]


def test_warm_up_growth_that_levels_off_is_not_a_leak() -> None:
    points = [(t * 0.5, 400e6 + min(t, 8) * (20 << 20)) for t in range(40)]
    leak = job(main_slope=fit(points), main_rss=points[-1][1])
    assert kinds(leak) == []


def test_worker_growth_of_a_tensor_dataset_is_not_blamed_on_records() -> None:
    grown = job(worker_growth=300 << 20, dataset=DatasetView("torch.utils.data.dataset.TensorDataset",
                                                            tensors_only=True),
                features={PYTORCH: FeatureView("LOONGKIT_PYTORCH", False, True)})
    recs = advise(grown).recommendations
    assert [r["kind"] for r in recs] == ["memory_workers"]
    assert "numpy" not in recs[0]["setting"] and "LOONGKIT_PYTORCH" not in recs[0]["setting"]


def test_worker_growth_of_a_record_list_names_loongkit_pytorch_unless_on() -> None:
    records = DatasetView("my.Dataset", "data_list: list of 20,000 dict", 20000)
    grown = job(worker_growth=300 << 20, dataset=records,
                features={PYTORCH: FeatureView("LOONGKIT_PYTORCH", False, True)})
    assert advise(grown).recommendations[0]["setting"] == "LOONGKIT_PYTORCH=1"
    on = replace(grown, features={PYTORCH: FeatureView("LOONGKIT_PYTORCH", True, True)})
    assert kinds(on) == []
    assert "numpy" in advise(replace(grown, features={})).recommendations[0]["setting"]


def test_epoch_restarts_name_persistent_workers_not_the_transforms() -> None:
    # short epochs: the workers' CPU goes to starting again, the per-sample work is indexing
    restarting = job(share=0.6, persistent=False, epochs=15, epoch_start_wait_s=9.0, total_wait_s=11.0,
                     workers_cpu=1.9)
    assert kinds(restarting) == ["persistent_workers"]


def test_a_loader_built_per_epoch_is_told_to_build_it_once() -> None:
    rebuilt = job(share=0.6, persistent=False, epochs=15, loaders_built=15, epoch_start_wait_s=9.0,
                  total_wait_s=11.0)
    recs = advise(rebuilt).recommendations
    assert [r["kind"] for r in recs] == ["build_loader_once"]
    assert "15 loaders" in recs[0]["cause"]


def test_more_workers_come_from_the_per_sample_cost_within_the_cpus() -> None:
    # 2 I/O-bound workers (sleeping), data wait 60 %: 6 workers keep up
    io = job(step=0.1, share=0.6, workers_cpu=0.1, allowed=8.0)
    recs = advise(io).recommendations
    assert [r["kind"] for r in recs] == ["workers"] and "num_workers=6" in recs[0]["setting"]
    # CPU-bound workers and no CPU left: no more workers, the per-sample cost is named
    busy = job(step=0.1, share=0.6, workers_cpu=1.0, main_cpu=1.0, allowed=2.0)
    assert kinds(busy) == ["per_sample_cost"]


def test_the_verdict_near_the_cpu_budget_is_the_same_on_both_sides() -> None:
    # tune's own setting, run twice: 0.84 then 0.85 CPU per worker
    first = advise(job(step=0.1, share=0.3, workers_cpu=1.68, main_cpu=0.5, allowed=2.0))
    second = advise(job(step=0.1, share=0.3, workers_cpu=1.70, main_cpu=0.5, allowed=2.0))
    assert [r["kind"] for r in first.recommendations] == [r["kind"] for r in second.recommendations]


def test_data_kernels_only_when_their_transform_is_in_the_pipeline() -> None:
    views = {DISTORTION: FeatureView("LOONGKIT_DISTORTION", False, True),
             IMNORMALIZE: FeatureView("LOONGKIT_IMNORMALIZE", False, True)}
    busy = job(step=0.1, share=0.6, workers_cpu=1.0, main_cpu=1.0, features=views,
               dataset=DatasetView("mmdet.CocoDataset", transforms=("LoadImageFromFile", "PhotoMetricDistortion")))
    recs = advise(busy).recommendations
    assert [(r["kind"], r["setting"]) for r in recs] == [("data_kernels", "LOONGKIT_DISTORTION=1")]
    plain = replace(busy, dataset=DatasetView("my.Dataset"))
    assert kinds(plain) == ["per_sample_cost"]


def test_worker_count_through_loongkit_is_not_repeated() -> None:
    on = {DATALOADER_WORKERS: FeatureView("LOONGKIT_DATALOADER_WORKERS", True, True)}
    io = job(step=0.1, share=0.6, workers_cpu=0.1, allowed=8.0, features=on,
             options={"LOONGKIT_DATALOADER_WORKERS_COUNT": "6"})
    assert kinds(io) == []


def test_no_steps_no_recommendations() -> None:
    empty = Facts(figures=analysis.step_figures(0, [], [], [], 0, False), num_workers=0)
    assert advise(empty).recommendations == []


def test_every_claim_has_cause_evidence_expected_and_a_known_kind() -> None:
    cases = [job(step=0.244, share=0.918, num_workers=0, worker_slots=0, workers_cpu=None),
             job(step=0.1, share=0.6, workers_cpu=0.1, allowed=8.0),
             job(main_cpu_wait=0.45, others_cpu=1.0)]
    for case in cases:
        for rec in advise(case).recommendations:
            assert rec["cause"] and rec["evidence"] and rec["expected"] and rec["setting"], rec


def test_the_views_come_from_loongkit_datas_real_declarations() -> None:
    """The wrong-name bug: a view keyed by the handle exists for LOONGKIT_PYTORCH when loongkit-data is
    installed (built from its declarations, not from names written here)."""
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    if "data" not in eps:
        pytest.skip("loongkit-data is not installed here")
    declared = eps["data"].load().features
    records = [FeatureRecord(f.replace(plugin="data"), State.DISABLED) for f in declared]
    views = feature_views(records)
    assert PYTORCH in views and views[PYTORCH].env == "LOONGKIT_PYTORCH"
    assert DISTORTION in views and IMNORMALIZE in views
