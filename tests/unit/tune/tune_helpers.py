"""Facts of made-up machines for tune's tests (what `loongkit features --json` etc. would say)."""

from __future__ import annotations

from loongkit_monitor.tune.facts import Facts, FeatureFact
from loongkit_monitor.tune.figures import Figures

DATA = "Data preprocessing"
OPS = "Operator optimization and model compilation"


def feature(name: str, level: int, category: str = DATA, applies: bool = True, enabled: bool = True,
            reason: str = "") -> FeatureFact:
    return FeatureFact(name=name, env=f"LOONGKIT_{name.upper()}", level=level, category=category,
                       applies=applies, reason=reason or ("" if applies else "not applicable: test"),
                       enabled_by_all=enabled)


def cpu_box(**overrides: object) -> Facts:
    """A CPU-only machine: one level-1, one level-2 (malloc, jemalloc installed), one level-3 feature."""
    facts = Facts(
        features={f.name: f for f in (
            feature("monitor", 1, "Other"),
            feature("pytorch", 1),
            feature("config_guards", 1, "Resource control"),
            feature("numa_affinity", 1, "Resource control", applies=False,
                    reason="not applicable: no GPU found"),
            feature("malloc", 2),
            feature("page_cache_limit", 2, applies=False, reason="not applicable: cgroup v1"),
            feature("dataloader_workers", 2, applies=False, reason="not applicable: count not set"),
            feature("distortion", 3),
            feature("compile_resnet", 1, OPS),
        )},
        gpus=0, numa_nodes=1, l3_caches=1, cpus=4, allocators={"jemalloc": True, "tcmalloc": False})
    for k, v in overrides.items():
        setattr(facts, k, v)
    return facts


def figures(**kw: object) -> Figures:
    base: dict[str, object] = dict(steps=30, warm_steps=25, step_median_s=0.1, step_p90_s=0.11,
                                   data_wait_share=0.05, gpu_idle_share=None, workers=2, worker_cpu_used=1.0,
                                   cpus_allowed=4.0, stopped_at_max_steps=True)
    base.update(kw)
    return Figures(**base)  # type: ignore[arg-type]
