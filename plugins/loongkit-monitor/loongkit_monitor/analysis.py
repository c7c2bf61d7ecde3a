"""From what was recorded to figures, stragglers and recommendations (pure functions, no I/O).

Warm-up: the first tenth of the timed steps (at least one when there are two or more, at most ten)
is dropped; it holds worker start-up, allocator warm-up and lazy initialisation.

Shares are ratios of sums over the warm steps (``sum(data wait) / sum(step wall)``), so a rare long
step weighs what it cost. A rank's *own time* is its step minus the time it spent in synchronising
calls (backward, blocking collectives, DDP's buffer broadcast): under DDP every rank's step lasts as
long as the slowest rank's, and the others wait inside those calls, so own time is what tells a
straggler apart. Without a process group, own time is the step.

Every recommendation carries the figures that triggered it (``evidence``), and none is made for a
setting the job already has (an enabled loongkit feature, persistent workers already on, ...).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Thresholds (documented in docs/features/monitor.md)
DATA_BOUND = 0.15  # data wait share of the step from which a job counts as data-bound
WORKER_BUSY = 0.85  # a worker keeping this much of a CPU busy is CPU-bound
SPARE_CPUS = 0.75  # CPUs left idle from which more workers can run
EPOCH_START = 0.25  # share of all data wait spent starting epochs (workers restarted)
GROWTH = 64 << 20  # bytes a worker's memory grows over the run before it is reported
STRAGGLER = 0.10  # own time above the other ranks' median, as a share of the step
GPU_IDLE = 0.30
CPU_WAIT = 0.25  # share of its time a process spent runnable but waiting for a CPU
OVERSUBSCRIBED = 0.95  # busy CPUs / allowed CPUs


def warm_count(timed: int) -> int:
    """Timed steps dropped as warm-up."""
    if timed < 2:
        return 0
    return min(10, max(1, timed // 10))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (``q`` in 0..1) of non-empty ``values``."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def pct(share: float) -> str:
    return f"{share * 100:.0f} %"


def ms(seconds: float) -> str:
    """84.2 ms; 37.82 s from ten seconds up."""
    return f"{seconds * 1000:.1f} ms" if abs(seconds) < 10 else f"{seconds:.2f} s"


def mib(n: float) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def cpus(n: float) -> str:
    return f"{n:.1f}"


@dataclass
class StepFigures:
    steps: int  # step boundaries seen
    timed: int
    warm_steps: int
    warm_from: int  # 0-based number of the first warm step
    median_s: float | None = None
    p90_s: float | None = None
    wall_s: float = 0.0  # sum of the warm steps
    data_wait_s: float = 0.0
    sync_s: float = 0.0
    data_wait_share: float | None = None
    sync_share: float | None = None
    data_wait_median_s: float | None = None
    own_median_s: float | None = None


def step_figures(steps: int, walls: Sequence[float], waits: Sequence[float], syncs: Sequence[float],
                 first_timed: int, distributed: bool) -> StepFigures:
    """Figures of the warm steps; ``first_timed`` is the 1-based boundary that ended ``walls[0]``."""
    timed = len(walls)
    drop = warm_count(timed)
    fig = StepFigures(steps=steps, timed=timed, warm_steps=timed - drop,
                      warm_from=max(0, first_timed - 1) + drop)
    w, d, s = list(walls[drop:]), list(waits[drop:]), list(syncs[drop:])
    if not w:
        return fig
    fig.median_s = statistics.median(w)
    fig.p90_s = percentile(w, 0.9)
    fig.wall_s = sum(w)
    fig.data_wait_s = sum(d)
    fig.sync_s = sum(s)
    if fig.wall_s > 0:
        fig.data_wait_share = min(1.0, fig.data_wait_s / fig.wall_s)
        fig.sync_share = min(1.0, fig.sync_s / fig.wall_s)
    fig.data_wait_median_s = statistics.median(d)
    fig.own_median_s = statistics.median([a - b for a, b in zip(w, s, strict=True)]) if distributed else fig.median_s
    return fig


# --------------------------------------------------------------------------------------------------
# Stragglers


def stragglers(ranks: Mapping[int, Mapping[str, Any]]) -> tuple[dict[int, float], list[dict[str, Any]]]:
    """A score per rank (own time above the other ranks' median, as a share of the median step) and
    the ranks flagged (score >= STRAGGLER) with their evidence."""
    own = {r: float(d["own_median_s"]) for r, d in ranks.items() if d.get("own_median_s") is not None}
    steps = [float(d["step_median_s"]) for d in ranks.values() if d.get("step_median_s")]
    if len(own) < 2 or not steps:
        return {}, []
    step = statistics.median(steps)
    scores: dict[int, float] = {}
    flagged: list[dict[str, Any]] = []
    for rank in sorted(own):
        others = statistics.median([v for r, v in own.items() if r != rank])
        score = (own[rank] - others) / step if step > 0 else 0.0
        scores[rank] = score
        if score < STRAGGLER:
            continue
        evidence = (f"rank {rank} spends {ms(own[rank] - others)} more per step outside synchronisation than "
                    f"the median of the other ranks ({ms(own[rank])} vs {ms(others)}; "
                    f"{pct(score)} of the {ms(step)} step)")
        waits = {r: ranks[r].get("data_wait_median_s") for r in own}
        mine = waits.get(rank)
        rest = [v for r, v in waits.items() if r != rank and v is not None]
        extra_wait = None
        if mine is not None and rest:
            extra_wait = mine - statistics.median(rest)
            evidence += f"; its data wait {ms(mine)} vs {ms(statistics.median(rest))}"
        flagged.append({"rank": rank, "slower_by": round(score, 4), "evidence": evidence,
                        "extra_data_wait_s": extra_wait, "lag_s": own[rank] - others})
    return scores, flagged


# --------------------------------------------------------------------------------------------------
# Recommendations


@dataclass(frozen=True)
class FeatureView:
    """What the job does with one loongkit feature."""

    env: str
    enabled: bool
    relevant: bool  # declared, its requirements met, and its target imported (or it has none)


@dataclass
class Facts:
    figures: StepFigures
    num_workers: int | None = None  # of the training DataLoader (None: no DataLoader seen)
    persistent: bool = False
    context: str = ""
    epochs: int = 0
    epoch_start_wait_s: float = 0.0
    total_wait_s: float = 0.0  # every wait of the training loader (epoch starts included)
    worker_slots: int = 0
    workers_cpu: float | None = None
    workers_cpu_wait: float | None = None  # share of a worker's time waiting for a CPU (schedstat)
    main_cpu_wait: float | None = None  # same for the main process's training thread
    worker_growth: float | None = None  # private memory (or RSS) growth per worker, bytes
    worker_growth_kind: str = "private memory"
    main_cpu: float | None = None
    allowed: float = 1.0
    allowed_note: str = ""
    torch_threads: int | None = None
    gpu_idle: float | None = None
    features: Mapping[str, FeatureView] = field(default_factory=dict)
    options: Mapping[str, str] = field(default_factory=dict)  # LOONGKIT_* option variables as set
    flagged: Sequence[Mapping[str, Any]] = ()
    numa: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)  # rank -> cpu_nodes, gpu_node


def _feature(facts: Facts, name: str) -> FeatureView | None:
    view = facts.features.get(name)
    return view if view is not None and view.relevant and not view.enabled else None


def _workers_setting(facts: Facts, count: int, extra: str = "") -> str | None:
    """The job's knob for ``count`` workers, and loongkit's (no code change) when it is installed;
    None when the job already runs with that count through loongkit's."""
    knob = f"DataLoader(num_workers={count}){extra}"
    view = facts.features.get("dataloader_workers")
    if view is None:
        return knob
    current = facts.options.get("LOONGKIT_DATALOADER_WORKERS_COUNT", "").strip()
    if view.enabled:
        return None if current == str(count) else f"LOONGKIT_DATALOADER_WORKERS_COUNT={count}{extra}"
    return f"{knob}, or with no code change LOONGKIT_DATALOADER_WORKERS=1 LOONGKIT_DATALOADER_WORKERS_COUNT={count}"


def _data_bound(facts: Facts, out: list[dict[str, str]]) -> None:
    fig = facts.figures
    share = fig.data_wait_share
    if share is None or share < DATA_BOUND or facts.num_workers is None:
        return
    head = f"data wait {pct(share)} of the step"
    if facts.gpu_idle is not None:
        head += f" (GPU idle {pct(facts.gpu_idle)})"
    main = facts.main_cpu or 0.0
    if facts.num_workers == 0:
        if facts.allowed >= 2:
            setting = _workers_setting(facts, max(1, min(8, int(facts.allowed - 1))))
            if setting is not None:
                out.append({"setting": setting,
                            "evidence": f"{head} with num_workers=0: the main process loads every batch itself "
                                        f"while {cpus(facts.allowed)} CPUs are allowed"})
        return
    used = facts.workers_cpu
    slots = facts.worker_slots or facts.num_workers
    if used is None or slots <= 0:
        return
    spare = facts.allowed - main - used
    per_worker = used / slots
    saturation = (f"{slots} worker{'s' if slots != 1 else ''} use {cpus(used)} of {cpus(facts.allowed)} "
                  f"allowed CPUs (main process {cpus(main)})")
    starved = facts.workers_cpu_wait is not None and facts.workers_cpu_wait >= CPU_WAIT
    job_busy = main + used
    if starved and job_busy < OVERSUBSCRIBED * facts.allowed:
        out.append({"setting": "dedicated CPUs for the job (its container's CPU request or cpuset)",
                    "evidence": f"{head}, {saturation}, yet each worker waited for a CPU "
                                f"{pct(facts.workers_cpu_wait or 0.0)} of the time: other processes run on "
                                f"the job's CPUs"})
    elif (per_worker >= WORKER_BUSY and spare < SPARE_CPUS) or starved:
        kernels = [v.env for v in (_feature(facts, "distortion"), _feature(facts, "imnormalize")) if v]
        if kernels:
            out.append({"setting": " / ".join(f"{env}=1" for env in kernels), "evidence": f"{head}, {saturation}"})
        else:
            out.append({"setting": "the job's per-sample transforms (cheaper) or more CPUs for the job",
                        "evidence": f"{head}, {saturation}: the workers are CPU-bound and no CPU is left"})
    elif per_worker >= WORKER_BUSY:
        setting = _workers_setting(facts, slots + max(1, int(spare + 0.25)))
        if setting is not None:
            out.append({"setting": setting, "evidence": f"{head}, {saturation}: {cpus(spare)} CPUs idle"})
    else:
        setting = _workers_setting(facts, slots * 2, " (or a larger prefetch_factor)")
        if setting is not None:
            out.append({"setting": setting,
                        "evidence": f"{head}, {saturation}: the workers are mostly waiting (I/O or sleep), "
                                    f"not computing"})


def _main_starved(facts: Facts, out: list[dict[str, str]]) -> None:
    """A step that is not data-bound but whose training thread waits for a CPU other processes hold."""
    wait, share = facts.main_cpu_wait, facts.figures.data_wait_share
    if wait is None or wait < CPU_WAIT or (share is not None and share >= DATA_BOUND):
        return
    job_busy = (facts.main_cpu or 0.0) + (facts.workers_cpu or 0.0)
    if job_busy >= OVERSUBSCRIBED * facts.allowed:
        return  # the job's own threads: _oversubscribed says so
    out.append({"setting": "dedicated CPUs for the job (its container's CPU request or cpuset)",
                "evidence": f"the training thread waited for a CPU {pct(wait)} of the time while the job kept "
                            f"{cpus(job_busy)} of {cpus(facts.allowed)} allowed CPUs busy: other processes run "
                            f"on the job's CPUs"})


def _epoch_restarts(facts: Facts, out: list[dict[str, str]]) -> None:
    share = facts.figures.data_wait_share
    if (facts.persistent or not facts.num_workers or facts.epochs < 2 or share is None or share < 0.05
            or facts.total_wait_s <= 0):
        return
    start_share = facts.epoch_start_wait_s / facts.total_wait_s
    if start_share < EPOCH_START:
        return
    per_epoch = facts.epoch_start_wait_s / facts.epochs
    out.append({"setting": "DataLoader(persistent_workers=True)",
                "evidence": f"{facts.num_workers} workers start again at each of {facts.epochs} epochs: "
                            f"{per_epoch:.2f} s per epoch start, {pct(start_share)} of all data wait "
                            f"(data wait {pct(share)} of the step)"})


def _memory_growth(facts: Facts, out: list[dict[str, str]]) -> None:
    growth = facts.worker_growth
    if growth is None or growth < GROWTH or facts.context != "fork":
        return
    evidence = (f"each fork worker's {facts.worker_growth_kind} grew {mib(growth)} on average over "
                f"{facts.figures.steps} steps (copy-on-write of the dataset's Python objects)")
    view = _feature(facts, "pytorch_memory")
    if view is not None:
        out.append({"setting": f"{view.env}=1", "evidence": evidence})
    elif not (facts.features.get("pytorch_memory") and facts.features["pytorch_memory"].enabled):
        out.append({"setting": "the dataset's per-sample records as numpy arrays (not lists of dicts)",
                    "evidence": evidence})


def _oversubscribed(facts: Facts, out: list[dict[str, str]]) -> None:
    if facts.main_cpu is None or facts.torch_threads is None:
        return
    busy = facts.main_cpu + (facts.workers_cpu or 0.0)
    slots = facts.worker_slots
    if busy < OVERSUBSCRIBED * facts.allowed or facts.torch_threads + slots <= facts.allowed:
        return
    evidence = (f"main process {cpus(facts.main_cpu)} + workers {cpus(facts.workers_cpu or 0.0)} CPUs busy of "
                f"{cpus(facts.allowed)} allowed, with {facts.torch_threads} torch intra-op threads beside "
                f"{slots} workers")
    guards = facts.features.get("config_guards")
    if guards is not None and not guards.enabled:
        out.append({"setting": "LOONGKIT_CONFIG_GUARDS=1 LOONGKIT_CONFIG_GUARDS_APPLY_FIX=1", "evidence": evidence})
    elif guards is not None and facts.options.get("LOONGKIT_CONFIG_GUARDS_APPLY_FIX", "").strip().lower() not in (
            "1", "on", "yes"):
        out.append({"setting": "LOONGKIT_CONFIG_GUARDS_APPLY_FIX=1", "evidence": evidence})


def _gpu_idle(facts: Facts, out: list[dict[str, str]]) -> None:
    idle, share = facts.gpu_idle, facts.figures.data_wait_share
    if idle is None or idle < GPU_IDLE or (share is not None and share >= DATA_BOUND):
        return
    out.append({"setting": "the job's batch size, or torch.compile / CUDA graphs for its model",
                "evidence": f"GPU idle {pct(idle)} of the step while data wait is {pct(share or 0.0)}: "
                            f"the CPU side of the step keeps the GPU waiting"})


def _straggler_advice(facts: Facts, out: list[dict[str, str]]) -> None:
    for flag in facts.flagged:
        rank = int(flag["rank"])
        slower = pct(float(flag["slower_by"]))
        numa = facts.numa.get(rank, {})
        gpu_node, nodes = numa.get("gpu_node"), list(numa.get("cpu_nodes") or [])
        view = facts.features.get("numa_affinity")
        if gpu_node is not None and nodes and gpu_node not in nodes and not (view and view.enabled):
            where = ",".join(map(str, nodes))
            out.append({"setting": "LOONGKIT_NUMA_AFFINITY=1",
                        "evidence": f"rank {rank} is {slower} slower than the median of the other ranks and runs "
                                    f"on NUMA node {where} while its GPU is on node {gpu_node}"})
            continue
        extra, lag = flag.get("extra_data_wait_s"), flag.get("lag_s")
        if extra is not None and lag and extra >= 0.5 * lag:
            out.append({"setting": f"rank {rank}'s DataLoader (num_workers) or its data shard",
                        "evidence": f"rank {rank} is {slower} slower than the median of the other ranks and "
                                    f"waits {ms(extra)} more per step for data"})


def recommendations(facts: Facts) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    if facts.figures.warm_steps <= 0:
        return out
    for rule in (_data_bound, _main_starved, _epoch_restarts, _memory_growth, _oversubscribed, _gpu_idle,
                 _straggler_advice):
        rule(facts, out)
    return out
