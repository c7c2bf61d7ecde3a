"""What tune asks loongkit (features, doctor, numa plan, malloc-env) and how it reads the monitor's JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from loongkit_monitor.tune import facts, figures

FEATURES = {"features": [
    {"name": "malloc", "env": "LOONGKIT_MALLOC", "level": 2, "category": "Data preprocessing",
     "options": ["LOONGKIT_MALLOC_ALLOCATOR"], "applies_here": "yes", "enabled_now": True},
    {"name": "numa_affinity", "env": "LOONGKIT_NUMA_AFFINITY", "level": 1, "category": "Resource control",
     "options": [], "applies_here": "yes", "enabled_now": True},
    {"name": "distortion", "env": "LOONGKIT_DISTORTION", "level": 3, "category": "Data preprocessing",
     "options": [], "applies_here": "not applicable: mmdet is not installed", "enabled_now": True},
], "faults": [{"plugin": "broken", "error": "ImportError: nope"}]}
DOCTOR = {"gpus": [{"pci": "0000:01:00.0"}, {"pci": "0000:02:00.0"}], "numa_nodes": {"0": "0-7", "1": "8-15"},
          "l3_caches": 4, "allowed_cpus": "0-11,14"}
PLAN = {"topology": "asymmetric (GPUs per NUMA node 0:2, 1:0)", "options": {"partition_per_llc": True}}


class FakeCli:
    def __init__(self) -> None:
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def __call__(self, argv: Sequence[str], environ: Mapping[str, str]) -> tuple[int, str]:
        self.calls.append((list(argv[3:]), dict(environ)))
        args = list(argv[3:])
        if args == ["features", "--json"]:
            return 0, json.dumps(FEATURES)
        if args == ["doctor", "--json"]:
            return 0, json.dumps(DOCTOR)
        if args == ["numa", "plan", "--json"]:
            return 0, json.dumps(PLAN)
        if args == ["malloc-env", "jemalloc"]:
            return 0, "LD_PRELOAD=/usr/lib/libjemalloc.so.2"
        return 1, "tcmalloc is not installed"


def test_gather_asks_loongkit_at_the_max_level() -> None:
    cli = FakeCli()
    found = facts.gather({"PATH": "/bin", "LOONGKIT_SYSFS_ROOT": "/fake"}, 3, runner=cli)
    assert found.features["malloc"].applies and found.features["malloc"].enabled_by_all
    assert not found.features["distortion"].applies
    assert found.features["distortion"].reason == "not applicable: mmdet is not installed"
    assert (found.gpus, found.numa_nodes, found.l3_caches, found.cpus) == (2, 2, 4, 13)
    assert found.asymmetric and found.numa_options == {"partition_per_llc": True}
    assert found.allocators == {"jemalloc": True, "tcmalloc": False}
    assert found.notes == ["plugin fault: broken: ImportError: nope"]
    features_env = cli.calls[0][1]
    assert features_env["LOONGKIT_ALL"] == "3" and features_env["LOONGKIT_SYSFS_ROOT"] == "/fake"
    assert "LOONGKIT_ALL" not in cli.calls[1][1]  # doctor: the trials' own environment


def test_gather_skips_what_does_not_apply_and_notes_failures() -> None:
    def cli(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[int, str]:
        if list(argv[3:]) == ["features", "--json"]:
            return 0, json.dumps({"features": [dict(FEATURES["features"][1], applies_here="not applicable: no GPU")]})
        if list(argv[3:]) == ["numa", "plan", "--json"]:
            raise AssertionError("numa plan asked although NUMA affinity does not apply")
        return 2, "boom\nlast line"

    found = facts.gather({}, 2, runner=cli)
    assert not found.applies("numa_affinity") and found.numa_topology == ""
    assert found.notes == ["`loongkit doctor --json` failed: last line"]
    assert found.allocators == {}


def test_gather_for_real_on_this_machine() -> None:
    found = facts.gather({k: v for k, v in __import__("os").environ.items() if not k.startswith("LOONGKIT_")}, 2)
    assert "config_guards" in found.features and found.features["config_guards"].level == 1
    assert found.cpus >= 1


MONITOR = {"steps": 30, "warm_steps": 25, "step_median_s": 0.12, "step_p90_s": 0.15, "data_wait_share": 0.41,
           "gpu_idle_share": None, "workers": 4, "worker_cpu_used": 3.9, "cpus_allowed": 4.0,
           "rss_growth_bytes_per_worker": None, "stragglers": [],
           "recommendations": [{"setting": "LOONGKIT_DISTORTION", "evidence": "data wait 41 %"}],
           "stopped_at_max_steps": True, "ranks": {"0": {}, "1": {}}}


def test_figures_from_the_summary(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"features": [{"name": "other"},
                                             {"name": "monitor", "details": {"monitor": MONITOR}}]}))
    found, summary, why = figures.read(path)
    assert why == "" and summary is not None and found is not None
    assert found.step_median_s == 0.12 and found.workers == 4 and found.ranks == 2
    assert found.data_bound and found.workers_saturated and found.usable
    assert found.recommendations[0].setting == "LOONGKIT_DISTORTION"


def test_figures_missing_say_why(tmp_path: Path) -> None:
    assert "no JSON Summary" in figures.read(tmp_path / "absent.json")[2]
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"features": []}))
    assert "no 'monitor' row" in figures.read(path)[2]
    path.write_text(json.dumps({"features": [{"name": "monitor", "state": "failed", "reason": "boom", "details": {}}]}))
    assert figures.read(path)[2] == "the monitor recorded no figures (state failed: boom)"
    path.write_text("{not json")
    assert "unreadable" in figures.read(path)[2]
    bad = figures.from_details({"steps": "many", "step_median_s": float("nan"), "workers": True})
    assert (bad.steps, bad.step_median_s, bad.workers, bad.usable) == (0, None, 0, False)


def test_active_level_counts_the_features_whose_code_ran() -> None:
    """Rows as the Summary writes them (FeatureRecord.to_json of the real declarations)."""
    from loongkit_data.plugin import plugin as data_plugin
    from loongkit_monitor.tune.registration import WORKERS_FEATURE
    from loongkit_monitor.tune.space import OWN_FEATURES

    from loongkit_core.feature import FeatureRecord, State

    declared = {f.name: f for f in data_plugin.loongkit_declare_features()}
    ran = FeatureRecord(declared["pytorch"], State.APPLIED, enabled=True, calls=1)
    deep = max((f for f in declared.values() if f.level > declared["pytorch"].level), key=lambda f: f.level)
    armed = FeatureRecord(deep, State.ARMED, enabled=True)  # enabled by the level, its code never ran
    workers = FeatureRecord(WORKERS_FEATURE, State.APPLIED, enabled=True, calls=3)
    summary = {"features": [r.to_json() for r in (ran, armed, workers)]}
    assert figures.active_level(summary, OWN_FEATURES) == declared["pytorch"].level
    assert figures.active_level(summary) == max(declared["pytorch"].level, WORKERS_FEATURE.level)
    assert figures.active_level({"features": [armed.to_json()]}, OWN_FEATURES) == 0
    assert figures.active_level(None) is None and figures.active_level({"features": "?"}) is None


def test_tune_ranks_by_the_mean_warm_step_when_the_monitor_gives_it() -> None:
    """A median hides the steps that wait for data; the mean is what the user's wall time adds up."""
    with_mean = figures.from_details({**MONITOR, "step_median_s": 0.012, "step_mean_s": 0.015, "torch_threads": 8})
    assert with_mean.step_s == 0.015 and with_mean.torch_threads == 8 and with_mean.usable
    without = figures.from_details({**MONITOR, "step_median_s": 0.012})
    assert without.step_s == 0.012 and without.torch_threads is None
