"""The candidate space: built from what applies here, never from a fixed list; ordered by the baseline."""

from __future__ import annotations

import json
from dataclasses import replace

from loongkit_monitor import analysis
from loongkit_monitor.advice import Facts as JobFacts
from loongkit_monitor.advice import advise
from loongkit_monitor.tune import space
from loongkit_monitor.tune.figures import Recommendation, from_details
from tune_helpers import cpu_box, feature, figures


def keys(candidates: list[space.Candidate]) -> list[str]:
    return [c.key for c in candidates]


def test_levels_only_when_they_add_an_applicable_feature() -> None:
    facts = cpu_box()
    made, skipped = space.level_candidates(facts, 3)
    assert keys(made) == ["ALL=1", "ALL=2", "ALL=3"]
    assert made[1].why == "adds LOONGKIT_MALLOC"
    # Without an applicable level-3 feature, ALL=3 is the same trial as ALL=2.
    facts.features["distortion"] = replace(facts.features["distortion"], applies=False, reason="no mmdet")
    made, skipped = space.level_candidates(facts, 3)
    assert keys(made) == ["ALL=1", "ALL=2"]
    assert [(s.label, s.reason) for s in skipped] == [("ALL=3", "enables no applicable feature beyond ALL=2 here")]
    assert keys(space.level_candidates(facts, 1)[0]) == ["ALL=1"]


def test_hardware_policy_off_by_default_is_not_counted_in_a_level() -> None:
    facts = cpu_box()
    facts.features["malloc"] = replace(facts.features["malloc"], enabled_by_all=False)
    made, _ = space.level_candidates(facts, 2)
    assert keys(made) == ["ALL=1"]  # ALL=2 would enable nothing more: the policy keeps malloc off
    options, _ = space.option_candidates(facts, figures(), 2)
    assert "ALL=1 +MALLOC" in keys(options)  # ... but the explicit switch is still a candidate


def test_level_two_options_and_installed_allocators_only() -> None:
    made, skipped = space.option_candidates(cpu_box(), figures(), 3)
    assert keys(made) == ["ALL=1 +MALLOC(jemalloc)"]
    assert made[0].environ == {"LOONGKIT_ALL": "1", "LOONGKIT_MALLOC": "1", "LOONGKIT_MALLOC_ALLOCATOR": "jemalloc"}
    reasons = {s.label: s.reason for s in skipped}
    assert reasons["ALL=1 +MALLOC"] == "the only level-2 feature here: same as ALL=2"
    assert reasons["ALL=1 +MALLOC(tcmalloc)"] == "tcmalloc is not installed"
    assert reasons["ALL=1 +PAGE_CACHE_LIMIT"] == "not applicable: cgroup v1"
    assert reasons["NUMA affinity variants"] == "not applicable: no GPU found"
    assert "does not oversubscribe" in reasons["ALL=1 +CONFIG_GUARDS_APPLY_FIX"]
    assert "ALL=1 +DATALOADER_WORKERS" not in reasons  # tune's own knob is a dimension of its own
    assert space.option_candidates(cpu_box(), figures(), 1) == ([], [space.Skipped("level-2 options",
                                                                                   "--max-level 1")])


def test_two_level_two_features_each_alone() -> None:
    facts = cpu_box()
    facts.features["page_cache_limit"] = feature("page_cache_limit", 2)
    made, _ = space.option_candidates(facts, figures(), 2)
    assert {"ALL=1 +MALLOC", "ALL=1 +PAGE_CACHE_LIMIT"} <= set(keys(made))


def test_numa_variants_follow_the_topology() -> None:
    facts = cpu_box(numa_nodes=2, l3_caches=8, numa_topology="asymmetric (GPUs per NUMA node 0:2, 1:0)",
                    numa_options={"partition_per_llc": True, "separate_by_roles": False}, gpus=2)
    facts.features["numa_affinity"] = feature("numa_affinity", 1, "Resource control")
    made, skipped = space.option_candidates(facts, figures(), 2)
    names = keys(made)
    # The policy turned PARTITION_PER_LLC on here: the variant is turning it off.
    assert "ALL=1 +NUMA_AFFINITY_PARTITION_PER_LLC=0" in names
    assert "ALL=1 +NUMA_AFFINITY_SEPARATE_BY_ROLES=1" in names
    asym = [c for c in made if "ASYMMETRIC" in c.key or "GPULESS" in c.key]
    assert len(asym) == 4
    assert all(c.environ["LOONGKIT_NUMA_AFFINITY_ALLOW_ASYMMETRIC"] == "1" for c in asym)
    # Symmetric, one L3 per node: neither group.
    facts = cpu_box(numa_topology="symmetric (GPUs per NUMA node 0:1)")
    facts.features["numa_affinity"] = feature("numa_affinity", 1, "Resource control")
    made, skipped = space.option_candidates(facts, figures(), 2)
    assert not [c for c in made if "NUMA" in c.key]
    assert {s.label for s in skipped} >= {"PARTITION_PER_LLC / SEPARATE_BY_ROLES", "asymmetric NUMA options"}


def test_guards_fix_only_when_the_job_oversubscribes() -> None:
    made, _ = space.option_candidates(cpu_box(), figures(workers=6, cpus_allowed=4.0), 2)
    fix = [c for c in made if "APPLY_FIX" in c.key]
    assert fix and fix[0].environ["LOONGKIT_CONFIG_GUARDS_APPLY_FIX"] == "1" and fix[0].topic == space.DATA
    # torch.set_num_threads(8) on 4 CPUs with one worker: the job's threads oversubscribe (the suite's
    # threads_oversubscribed job, where the fix made the job 2x faster)
    made, _ = space.option_candidates(cpu_box(), figures(workers=1, cpus_allowed=4.0, torch_threads=8), 2)
    fix = [c for c in made if "APPLY_FIX" in c.key]
    assert fix and fix[0].why == "8 torch threads > 4 CPUs" and fix[0].topic == space.COMPUTE
    _, left = space.option_candidates(cpu_box(), figures(workers=1, cpus_allowed=4.0, torch_threads=4), 2)
    assert any(k.label.endswith("APPLY_FIX") and "4 torch threads, 4 CPUs" in k.reason for k in left)


def test_worker_counts() -> None:
    # Data-bound, CPUs left: more workers first, up to twice the CPUs or the job's own (I/O-bound loading).
    assert space.worker_counts(2, 4, data_bound=True, saturated=False) == [8, 4, 3, 1]
    assert space.worker_counts(2, 4, data_bound=True, saturated=False, most=4) == [4, 3, 1, 0]  # the memory
    assert space.worker_counts(4, 16, data_bound=True, saturated=False) == [32, 16, 15, 8]
    assert space.worker_counts(8, 4, data_bound=True, saturated=False) == [16, 4, 3, 1]  # at most four
    assert space.worker_counts(0, 1, data_bound=True, saturated=False) == [2, 1]  # one CPU per rank, loading waits
    # Saturated CPUs: fewer first.
    assert space.worker_counts(4, 4, data_bound=True, saturated=True) == [3, 2, 1, 0]
    # Not data-bound: nearest first, never above the CPUs.
    assert space.worker_counts(2, 2, data_bound=False, saturated=False) == [1, 0]
    assert space.worker_counts(0, 2, data_bound=False, saturated=False) == [1, 2]


def test_worker_counts_above_the_cpus_only_as_far_as_the_memory_holds_them() -> None:
    waiting = dict(workers=0, data_wait_share=0.6, worker_cpu_used=None, cpus_allowed=2.0)
    roomy = figures(**waiting, raw={"memory_limit_bytes": 64e9, "main_rss_bytes": 1e9})
    tight = figures(**waiting, raw={"memory_limit_bytes": 8e9, "main_rss_bytes": 1e9})  # half of 7 GB: 3 workers
    assert keys(space.worker_candidates(roomy, cpu_box())[0]) == ["workers=4", "workers=2", "workers=1"]
    assert keys(space.worker_candidates(tight, cpu_box())[0]) == ["workers=2", "workers=1"]
    unknown = figures(**waiting)  # no memory figures: the CPUs bound the counts alone
    assert keys(space.worker_candidates(unknown, cpu_box())[0]) == ["workers=4", "workers=2", "workers=1"]


def test_worker_candidates_from_the_baseline() -> None:
    made, _ = space.worker_candidates(figures(workers=2, cpus_allowed=2.0), cpu_box())
    assert keys(made) == ["workers=1", "workers=0"]
    assert made[0].environ == {"LOONGKIT_DATALOADER_WORKERS": "1", "LOONGKIT_DATALOADER_WORKERS_COUNT": "1"}
    assert space.worker_candidates(None, cpu_box()) == ([], [space.Skipped("DataLoader workers",
                                                                           "no baseline figures")])
    # Two ranks sharing a 4-CPU machine: 2 CPUs each.
    made, _ = space.worker_candidates(figures(workers=2, cpus_allowed=4.0, ranks=2), cpu_box())
    assert keys(made) == ["workers=1", "workers=0"]


def test_gpu_candidates_only_with_a_gpu() -> None:
    facts = cpu_box()
    facts.features["allow_tf32"] = feature("allow_tf32", 1, "Precision control")
    made, skipped = space.gpu_candidates(facts, 3)
    assert made == [] and skipped[0].reason == "no GPU here"
    facts.gpus = 1
    made, _ = space.gpu_candidates(facts, 3)
    assert keys(made) == ["ALLOW_TF32 alone", "COMPILE_RESNET alone"]
    assert made[0].environ == {"LOONGKIT_ALLOW_TF32": "1"}


def test_a_data_bound_baseline_tries_the_data_settings_first() -> None:
    facts = cpu_box()
    compute_bound, _ = space.build(facts, figures(data_wait_share=0.02), 3)
    data_bound, _ = space.build(facts, figures(data_wait_share=0.45), 3)
    assert keys(compute_bound)[0] == "ALL=1"
    assert keys(data_bound)[0].startswith("workers=")
    assert keys(data_bound).index("ALL=1 +MALLOC(jemalloc)") < keys(data_bound).index("ALL=1")
    def settings(made: list[space.Candidate]) -> list[str]:
        return sorted(k for k in keys(made) if not k.startswith("workers="))

    assert settings(compute_bound) == settings(data_bound)  # the same settings, another order
    counts = [int(k.split("=")[1]) for k in keys(data_bound) if k.startswith("workers=")]
    assert max(counts) == 2 * 4 > max(int(k.split("=")[1]) for k in keys(compute_bound) if k.startswith("workers="))


def test_recommended_settings_come_first() -> None:
    facts = cpu_box()
    recs = (Recommendation("LOONGKIT_DISTORTION / LOONGKIT_IMNORMALIZE", "data wait 41 %"),)
    made, _ = space.build(facts, figures(data_wait_share=0.02, recommendations=recs), 3)
    assert keys(made)[0] == "ALL=3"  # the only level that turns LOONGKIT_DISTORTION on


def test_combined_candidate() -> None:
    made, _ = space.build(cpu_box(), figures(), 3)
    by_key = {c.key: c for c in made}
    both = space.combine(by_key["ALL=2"], by_key["workers=1"])
    assert both.key == "ALL=2 + workers=1"
    assert both.environ == {"LOONGKIT_ALL": "2", "LOONGKIT_DATALOADER_WORKERS": "1",
                            "LOONGKIT_DATALOADER_WORKERS_COUNT": "1"}
    assert both.level == 2


def test_the_worker_count_the_monitor_advises_is_tried_first_even_beyond_the_cpus() -> None:
    # One worker that mostly sleeps (I/O) on 2 CPUs, data wait 84 %: the real advice names a count from
    # the per-sample cost; the Summary carries it (JSON) and tune's figures read it back.
    steps = 60
    job = JobFacts(figures=analysis.step_figures(steps, [0.05] * steps, [0.042] * steps, [0.0] * steps, 1, False),
                   num_workers=1, worker_slots=1, workers_cpu=0.08, main_cpu=0.3, allowed=2.0, context="fork",
                   persistent=True, torch_threads=1, others_cpu=0.0, main_cpu_wait=0.01, workers_cpu_wait=0.01,
                   window_s=10.0, main_rss=300e6, batch_size=32)
    recs = advise(job).recommendations
    assert [r["kind"] for r in recs] == ["workers"] and recs[0]["count"] > 2, recs
    details = json.loads(json.dumps({"steps": steps, "warm_steps": steps - 5, "step_median_s": 0.05,
                                     "data_wait_share": 0.84, "workers": 1, "worker_cpu_used": 0.08,
                                     "cpus_allowed": 2.0, "recommendations": recs}))
    fig = from_details(details)
    made, _ = space.worker_candidates(fig, cpu_box(cpus=2))
    assert keys(made)[0] == f"workers={recs[0]['count']}" and "the monitor's advice" in made[0].why
    assert len({c.key for c in made}) == len(made)
    # Without the advice the counts stay within twice the CPUs (a fixed list around the job's own count).
    plain, _ = space.worker_candidates(replace(fig, recommendations=()), cpu_box(cpus=2))
    assert max(int(c.key.split("=")[1]) for c in plain) == 4 < recs[0]["count"]
