"""Recommendations as claims: what this job does, why that costs it, which knob changes it, by how much.

Each claim is made from a model of the step, not from a figure crossing a line: the step is compute
``C`` (the main process's own work) plus the part of the data wait ``W`` that loading did not hide.
A DataLoader with ``N`` workers delivers ``N`` batches per worker batch time; the workers and the
main process share the CPUs the job may use with whatever else runs there. A claim names:

* ``kind``: the cause, one of :data:`KINDS` (what the planted-fault suite scores);
* ``setting``: the knob (the job's own, and loongkit's where one does it without a code change);
* ``cause``: the mechanism seen in this job; ``evidence``: the figures; ``expected``: the predicted
  effect and its basis.

A claim is made only when the predicted gain clears :data:`MIN_GAIN` by a margin; where the figures
sit inside the margin (a CPU budget just met, a gain that may be noise) the finding goes to
``unclear`` with what would decide it, so identical runs do not flip between two verdicts. A
loongkit setting is named only when it is declared, relevant here, not already on, and has work to
do in this job (a data kernel whose transform is in the pipeline, LOONGKIT_PYTORCH for a dataset
that holds a record list).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loongkit_core.feature import FeatureRef
from loongkit_monitor.analysis import StepFigures, cpus, mib, ms, pct
from loongkit_monitor.plugin import CONFIG_GUARDS, DATALOADER_WORKERS, DISTORTION, IMNORMALIZE, NUMA_AFFINITY, PYTORCH

KINDS = ("workers", "per_sample_cost", "data_kernels", "persistent_workers", "build_loader_once",
         "dedicated_cpus", "threads", "memory_main", "memory_workers", "gpu_idle", "straggler_numa",
         "straggler_data")

DATA_BOUND = 0.10  # data wait share below which loading is not worth a claim
MIN_GAIN = 1.10  # predicted step speed-up a claim needs
MARGIN = 0.15  # relative band around a decision's boundary where the verdict is "unclear"
CPU_WAIT = 0.25  # share of its time the training thread waited for a CPU before contention is named
OTHERS = 0.25  # CPUs other processes keep busy on the job's CPUs before they are named
EPOCH_START = 0.25  # share of all data wait spent starting epochs
GROWTH = 48 << 20  # bytes a worker's private memory (or RSS) grows over the warm steps before it is named
MAIN_GROWTH = 32 << 20  # same for the main process's RSS (and 5 % of it)
FIT_R2 = 0.9  # a memory slope counts when the line explains this much of the samples' variance
GPU_IDLE = 0.30
MAX_WORKERS = 32
IO_PER_CPU = 4  # waiting (I/O-bound) workers per CPU at most
HANDOFF_S = 1e-3  # the main process's cost of taking one batch from a worker (queue, unpickling)


@dataclass(frozen=True)
class FeatureView:
    """What the job does with one loongkit feature."""

    env: str
    enabled: bool
    relevant: bool  # declared, its requirements met, and its target imported (or it has none)
    config: Mapping[str, Any] = field(default_factory=dict)  # its Summary configuration (dry-run findings)


@dataclass(frozen=True)
class Slope:
    """A least-squares line through (seconds, bytes) samples."""

    per_s: float
    r2: float
    span_s: float
    samples: int
    start: float  # the fitted value at the first sample
    late_per_s: float  # the slope of the second half alone (growth that levels off is warm-up)


def fit(points: Sequence[tuple[float, float]]) -> Slope | None:
    """The line through ``points`` (at least 6 over 2 s or more), or None."""
    if len(points) < 6:
        return None
    t0 = points[0][0]
    xs = [t - t0 for t, _ in points]
    ys = [float(v) for _, v in points]
    span = xs[-1]
    if span < 2.0:
        return None

    def line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float, float]:
        mx, my = sum(x) / len(x), sum(y) / len(y)
        sxx = sum((a - mx) ** 2 for a in x)
        syy = sum((b - my) ** 2 for b in y)
        sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
        if sxx <= 0:
            return 0.0, my, 0.0
        slope = sxy / sxx
        r2 = (sxy * sxy) / (sxx * syy) if syy > 0 else 0.0
        return slope, my - slope * mx, r2

    slope, intercept, r2 = line(xs, ys)
    half = len(xs) // 2
    late, _, _ = line(xs[half:], ys[half:])
    return Slope(slope, r2, span, len(xs), intercept, late)


@dataclass
class Facts:
    figures: StepFigures
    num_workers: int | None = None  # of the training DataLoader (None: no DataLoader seen)
    persistent: bool = False
    context: str = ""
    epochs: int = 0
    loaders_built: int = 1  # alike loaders the job built (one per epoch: several)
    epoch_start_wait_s: float = 0.0
    total_wait_s: float = 0.0  # every wait of the training loader (epoch starts included)
    batches_per_step: float = 1.0
    batch_size: int | None = None
    dataset: Any = None  # loongkit_monitor.dataset.DatasetView
    worker_slots: int = 0
    workers_cpu: float | None = None
    workers_cpu_wait: float | None = None  # share of a worker's time waiting for a CPU (schedstat)
    main_cpu_wait: float | None = None  # same for the main process's training thread
    worker_growth: float | None = None  # private memory (or RSS) growth per worker over the warm steps, bytes
    worker_growth_kind: str = "private memory"
    worker_rss: float | None = None
    window_s: float = 0.0  # seconds of the warm window the CPU and memory figures cover
    main_cpu: float | None = None
    main_rss: float | None = None
    main_slope: Slope | None = None  # of the main process's RSS over the warm steps
    blocks_per_s: float | None = None  # the interpreter's allocated blocks, growth per second
    memory_limit: int | None = None
    memory_limit_note: str = ""
    others_cpu: float | None = None  # CPUs other processes kept busy on the job's CPUs
    neighbours: Sequence[tuple[str, int, float]] = ()  # visible ones: (name, pid, CPUs)
    allowed: float = 1.0
    allowed_note: str = ""
    local_ranks: int = 1
    torch_threads: int | None = None
    gpu_idle: float | None = None
    features: Mapping[FeatureRef, FeatureView] = field(default_factory=dict)
    options: Mapping[str, str] = field(default_factory=dict)  # LOONGKIT_* option variables as set
    flagged: Sequence[Mapping[str, Any]] = ()
    numa: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)  # rank -> cpu_nodes, gpu_node


@dataclass
class Advice:
    recommendations: list[dict[str, Any]] = field(default_factory=list)
    unclear: list[str] = field(default_factory=list)

    def claim(self, kind: str, setting: str, cause: str, evidence: str, expected: str,
              count: int | None = None) -> None:
        """``count``: the number the setting names (a worker count), for a reader that applies it (tune)."""
        assert kind in KINDS, kind
        rec: dict[str, Any] = {"kind": kind, "setting": setting, "cause": cause, "evidence": evidence,
                               "expected": expected}
        if count is not None:
            rec["count"] = count
        self.recommendations.append(rec)


def _available(facts: Facts, ref: FeatureRef) -> FeatureView | None:
    """The feature when naming it makes sense: declared, relevant here, not on already."""
    view = facts.features.get(ref)
    return view if view is not None and view.relevant and not view.enabled else None


def _workers_setting(facts: Facts, count: int) -> str | None:
    """The job's knob for ``count`` workers and loongkit's (no code change) when installed; None when
    the job already runs that count through loongkit's."""
    knob = f"DataLoader(num_workers={count})"
    view = facts.features.get(DATALOADER_WORKERS)
    if view is None:
        return knob
    current = facts.options.get("LOONGKIT_DATALOADER_WORKERS_COUNT", "").strip()
    if view.enabled:
        return None if current == str(count) else f"LOONGKIT_DATALOADER_WORKERS_COUNT={count}"
    return f"{knob}, or with no code change LOONGKIT_DATALOADER_WORKERS=1 LOONGKIT_DATALOADER_WORKERS_COUNT={count}"


def _speedup(before: float, after: float) -> str:
    return f"{before / after:.2f}x" if after > 0 else "n/a"


# --------------------------------------------------------------------------------------------------
# The CPU picture


@dataclass(frozen=True)
class Cpu:
    job: float  # CPUs the job (main + workers) kept busy
    others: float  # CPUs other processes kept busy on the job's CPUs
    free: float


def cpu_picture(facts: Facts) -> Cpu:
    job = (facts.main_cpu or 0.0) + (facts.workers_cpu or 0.0)
    others = max(0.0, facts.others_cpu or 0.0)
    if facts.local_ranks > 1:  # sibling ranks on the same CPUs are the job's too (about as busy as this one)
        others = max(0.0, others - (facts.local_ranks - 1) * job)
    return Cpu(job, others, max(0.0, facts.allowed - job - others))


def _neighbours(facts: Facts) -> str:
    shown = [f"{name} (pid {pid}, {cpus(used)} CPUs)" for name, pid, used in facts.neighbours[:3]]
    return f"; busiest seen: {', '.join(shown)}" if shown else " (not visible from this container)"


# --------------------------------------------------------------------------------------------------
# Rules


def _loading(facts: Facts, cpu: Cpu, out: Advice) -> None:
    """The data wait: more workers when loading could be hidden and the CPUs allow, else what costs."""
    fig = facts.figures
    share, step = fig.data_wait_share, fig.median_s
    if share is None or step is None or facts.num_workers is None or share < DATA_BOUND or step <= 0:
        return
    if _epoch_share(facts) >= EPOCH_START:
        return  # the wait is in starting epochs: _epoch_starts says so
    n = facts.num_workers
    wait = share * step
    compute = max(step - wait, 1e-6)
    main_cpu = facts.main_cpu or 0.0
    head = f"data wait {pct(share)} of the {ms(step)} step"
    if facts.gpu_idle is not None:
        head += f" (GPU idle {pct(facts.gpu_idle)})"
    capacity = facts.allowed - cpu.others
    if n == 0:
        # The main process loads each batch itself: the wait is the loading time. CPU-bound loading
        # keeps the main process busy through it (its CPU seconds per step exceed the compute's).
        load_cpu = min(wait, max(0.0, main_cpu * step - compute))
        work = max(main_cpu * step, compute + load_cpu)  # CPU seconds per step, model and loading
        count = max(1, math.ceil(wait / compute * 1.15))
        if load_cpu > 0.3 * wait:  # CPU-using loading: never more busy workers than CPUs
            count = min(count, max(1, math.floor(capacity + 0.25)))
        count = min(count, _io_cap(facts, 0, capacity))
        # each batch then crosses a queue and is unpickled by the main process: HANDOFF_S of its step
        after = max(compute, wait / count, work / max(capacity, 1e-6)) + HANDOFF_S * facts.batches_per_step
        basis = (f"loading takes {ms(wait)} per step in the main process ({ms(load_cpu)} of it on a CPU), "
                 f"compute {ms(compute)}; {cpus(capacity)} CPUs allowed and free of other processes")
        _more_workers(facts, out, count, step, after, head + " with num_workers=0", basis,
                      "the main process loads every batch itself (num_workers=0): loading and compute take turns")
        return
    used = facts.workers_cpu
    if used is None:
        return
    bps = max(facts.batches_per_step, 1e-6)
    worker_batch = n * step / bps  # a worker's wall time per batch while the loop waits on them
    per_worker = used / max(facts.worker_slots or n, 1)
    work = (main_cpu + used) * step  # CPU seconds per step, model and loading
    floor = work / max(capacity, 1e-6)  # the step if the job kept every CPU it may use busy
    loading = (f"{n} worker{'s' if n != 1 else ''} take {ms(worker_batch)} per batch each "
               f"({ms(used * step / bps / max(facts.batch_size or 1, 1))} CPU per sample), "
               f"{cpus(used)} CPUs busy ({cpus(per_worker)} per worker)")
    basis = f"{loading}; compute {ms(compute)} per step; {cpus(capacity)} CPUs allowed and free of other processes"
    best = max(compute, floor)
    if step / best < MIN_GAIN * (1 + MARGIN / 2) and floor >= (1 - MARGIN) * step:
        # The CPUs are what the job waits for: more workers only share them.
        if cpu.others >= OTHERS:
            return  # others hold part of them: _contention names them
        if any(r["kind"] == "threads" for r in out.recommendations):
            return  # the model's own extra threads spin on the CPUs: their cut comes first
        kernels = [view.env for ref, name in ((DISTORTION, "PhotoMetricDistortion"), (IMNORMALIZE, "Normalize"))
                   if (view := _available(facts, ref)) is not None and _in_pipeline(facts, name)]
        cost = (f"{head}; {basis}: the model and loading need {ms(work)} of CPU per step, "
                f"{cpus(work / step)} CPUs at this pace")
        if kernels:
            out.claim("data_kernels", " / ".join(f"{env}=1" for env in kernels),
                      "the workers are CPU-bound in transforms loongkit has kernels for", cost,
                      "the transforms' CPU time cut by their kernels (docs/benchmarks.md: data_kernels)")
            return
        where = (f"the dataset's __getitem__ / transforms ({facts.dataset.kind})" if facts.dataset is not None
                 else "the dataset's per-sample work")
        out.claim("per_sample_cost", f"{where}, or more CPUs for the job",
                  "the job is CPU-bound in loading: every CPU it may use is busy, more workers would only share them",
                  cost, f"the step shrinks with the per-sample CPU time, down to compute ({ms(compute)})")
        return
    # Part of every wait is the main process taking the batch (queue, unpickling): no worker count hides it.
    handoff = min(wait, HANDOFF_S * bps)
    if wait - handoff < DATA_BOUND * step:
        return
    best = max(best, compute + handoff)
    count = max(n + 1, math.ceil(worker_batch / max(best, 1e-6) * 1.15))
    if per_worker >= 0.3:  # CPU-using workers: never more busy workers than CPUs
        count = min(count, max(n, math.floor(capacity + 0.25)))
    count = min(count, _io_cap(facts, n, capacity))
    if count <= n:
        return
    after = max(best, worker_batch / count * bps + handoff)
    why = ("the workers mostly wait (I/O or sleep), more of them overlap it" if per_worker < 0.5
           else "CPUs are left for more workers")
    _more_workers(facts, out, count, step, after, head, basis, f"{n} workers cannot keep up with the model: {why}")


def workers_memory_holds(n: int, worker_rss: float | None, main_rss: float | None,
                         limit: float | None) -> int | None:
    """The most workers (``n`` running now) that half the memory left can hold; None when a figure is
    unknown. Shared with tune, which must not try a count the memory cannot hold."""
    if not (worker_rss and worker_rss > 0 and main_rss and limit):
        return None
    left = limit - main_rss - n * worker_rss
    return n + max(0, int(0.5 * left / worker_rss))


def _io_cap(facts: Facts, n: int, capacity: float) -> int:
    """At most IO_PER_CPU waiting workers per CPU, and no more than half the memory left can hold."""
    cap = min(MAX_WORKERS, max(n + 1, math.ceil(IO_PER_CPU * capacity)))
    held = workers_memory_holds(n, facts.worker_rss, facts.main_rss, facts.memory_limit)
    if held is not None:
        cap = min(cap, held)
    return max(cap, 1)


def _more_workers(facts: Facts, out: Advice, count: int, step: float, after: float, head: str, basis: str,
                  cause: str) -> None:
    gain = step / after if after > 0 else 0.0
    if gain < MIN_GAIN * (1 - MARGIN / 2):
        return
    if gain < MIN_GAIN * (1 + MARGIN / 2):
        out.unclear.append(f"{head}: {count} workers would gain about {gain:.2f}x, inside the noise band ({basis})")
        return
    setting = _workers_setting(facts, count)
    if setting is None:
        return
    out.claim("workers", setting, cause, f"{head}; {basis}",
              f"about {gain:.2f}x ({ms(step)} -> {ms(after)} per step)", count=count)


def _in_pipeline(facts: Facts, name: str) -> bool:
    transforms = getattr(facts.dataset, "transforms", ()) or ()
    return any(t == name or t.endswith(name) for t in transforms)


def _epoch_share(facts: Facts) -> float:
    if not facts.num_workers or (facts.persistent and facts.loaders_built <= 1) or facts.total_wait_s <= 0:
        return 0.0
    return facts.epoch_start_wait_s / facts.total_wait_s


def _epoch_starts(facts: Facts, out: Advice) -> None:
    fig = facts.figures
    share = fig.data_wait_share
    starts = max(facts.epochs, facts.loaders_built)
    if share is None or share < DATA_BOUND / 2 or starts < 2:
        return
    start_share = _epoch_share(facts)
    if start_share < EPOCH_START:
        return
    per_epoch = facts.epoch_start_wait_s / starts
    evidence = (f"{per_epoch:.2f} s per epoch start, {pct(start_share)} of all data wait "
                f"(data wait {pct(share)} of the step)")
    saved = facts.epoch_start_wait_s * (starts - 1) / starts
    expected = f"about {saved:.1f} s of the run's {facts.total_wait_s:.1f} s data wait (all epoch starts but the first)"
    if facts.loaders_built >= 2:
        out.claim("build_loader_once", "the DataLoader built once, outside the epoch loop "
                  "(with persistent_workers=True)",
                  f"the job builds a new DataLoader for each epoch ({facts.loaders_built} loaders, one epoch each): "
                  f"{facts.num_workers} workers start again with each", evidence, expected)
    elif not facts.persistent:
        out.claim("persistent_workers", "DataLoader(persistent_workers=True)",
                  f"{facts.num_workers} workers start again at each of {facts.epochs} epochs", evidence, expected)


def _contention(facts: Facts, cpu: Cpu, out: Advice) -> None:
    """The training thread (or the workers) runnable but not running: whose threads hold the CPUs."""
    main_wait = facts.main_cpu_wait or 0.0
    worker_wait = facts.workers_cpu_wait or 0.0
    data_share = facts.figures.data_wait_share or 0.0
    if cpu.others >= OTHERS and cpu.others >= 0.1 * facts.allowed:
        # What the step loses to them: the training thread's wait (or the data wait of starved workers).
        lost = max(main_wait, data_share if worker_wait >= CPU_WAIT else 0.0)
        gain = 1 / max(1e-6, 1 - lost)
        if gain < MIN_GAIN * (1 - MARGIN / 2):
            return
        who = (f"the training thread waited for a CPU {pct(main_wait)} of the time" if lost == main_wait
               else f"the workers waited for a CPU {pct(worker_wait)} of the time with data wait {pct(data_share)}")
        if gain < MIN_GAIN * (1 + MARGIN / 2):
            out.unclear.append(f"{who} while other processes kept {cpus(cpu.others)} of the job's CPUs busy: "
                               f"dedicated CPUs would gain about {gain:.2f}x, inside the noise band")
            return
        out.claim("dedicated_cpus", "dedicated CPUs for the job (its container's CPU request / limit, or a cpuset "
                  "no other process shares)",
                  f"other processes kept {cpus(cpu.others)} of the job's {cpus(facts.allowed)} CPUs busy"
                  f"{_neighbours(facts)}",
                  f"{who}; the job itself kept {cpus(cpu.job)} busy",
                  f"up to {pct(lost)} of the step (the time lost waiting for a CPU)")
        return
    if main_wait < CPU_WAIT:
        return
    who = f"the training thread waited for a CPU {pct(main_wait)} of the time"
    threads = facts.torch_threads or 1
    busy_workers = facts.workers_cpu or 0.0
    # The model can use the CPUs the workers leave; intra-op threads beyond them (and one spare) only
    # preempt each other at every parallel region's barrier.
    room = max(1.0, facts.allowed - busy_workers)
    if threads > room * (1 + MARGIN) + 1:
        count = max(1, round(room))
        guards = facts.features.get(CONFIG_GUARDS)
        findings = list((guards.config or {}).get("findings") or []) if guards is not None else []
        setting = f"torch.set_num_threads({count}) (or OMP_NUM_THREADS={count})"
        if guards is not None and guards.enabled and any("intra-op" in str(f) for f in findings):
            setting += ", or with no code change LOONGKIT_CONFIG_GUARDS_APPLY_FIX=1 (its dry run found them)"
        out.claim("threads", setting,
                  f"the job's own {threads} torch intra-op threads share the {cpus(room)} CPUs its workers leave "
                  f"({cpus(facts.allowed)} allowed): they preempt each other at every parallel region",
                  f"{who}; other processes kept {cpus(cpu.others)} CPUs busy, the workers {cpus(busy_workers)}",
                  f"up to {pct(main_wait)} of the step (the training thread's wait for a CPU)")
    elif threads + busy_workers > facts.allowed * (1 + MARGIN):
        out.unclear.append(f"{who}: {threads} torch threads and workers keeping {cpus(busy_workers)} CPUs busy share "
                           f"{cpus(facts.allowed)} CPUs; fewer threads give the workers more CPU and the model less, "
                           f"which is faster only a trial can tell (loongkit tune)")


def _memory(facts: Facts, out: Advice) -> None:
    slope = facts.main_slope
    limit = facts.memory_limit
    workers = facts.num_workers or 0
    if slope is not None and facts.main_rss:
        grown = slope.per_s * slope.span_s
        steady = slope.r2 >= FIT_R2 and slope.late_per_s >= 0.5 * slope.per_s
        if grown >= max(MAIN_GROWTH, 0.05 * facts.main_rss) and steady:
            step = facts.figures.median_s or 0.0
            per_step = slope.per_s * step
            used = facts.main_rss + workers * (facts.worker_rss or 0.0)
            when = ""
            if limit:
                hours = max(0.0, limit - used) / slope.per_s / 3600
                when = (f"; at this rate the {mib(limit)} limit ({facts.memory_limit_note}) is reached in "
                    f"{hours:.1f} h")
            python = (facts.blocks_per_s is not None and facts.blocks_per_s * slope.span_s >= 10_000)
            what = ("Python objects (the interpreter's allocated blocks grow with it)" if python else
                    "memory outside Python objects (tensors or native buffers; the interpreter's blocks stay flat)")
            kept = mib(per_step) if per_step >= 1 << 20 else f"{per_step / 1024:.0f} KiB"
            out.claim("memory_main", "the training loop: what it keeps from each step (a list of losses or "
                      "outputs kept as tensors, a growing cache)",
                      f"the main process keeps {kept} per step: {what}",
                      f"RSS {mib(facts.main_rss)}, +{mib(grown)} over {slope.span_s:.0f} s of warm steps "
                      f"(fit over {slope.samples} samples, R² {slope.r2:.2f}){when}",
                      "a flat RSS; without it the job ends out of memory" + (" at the time above" if when else ""))
    growth = facts.worker_growth
    if growth is None or growth < GROWTH or not workers:
        return
    records = getattr(facts.dataset, "records", None)
    per_s = growth / facts.window_s if facts.window_s > 0 else 0.0
    when = ""
    if limit and per_s > 0:
        used = (facts.main_rss or 0.0) + workers * (facts.worker_rss or 0.0)
        hours = max(0.0, limit - used) / (per_s * workers) / 3600
        when = f"; at this rate the {mib(limit)} limit ({facts.memory_limit_note}) is reached in {hours:.1f} h"
    evidence = (f"each worker's {facts.worker_growth_kind} grew {mib(growth)} over the warm steps "
                f"({workers} workers, {facts.context or '?'} start){when}")
    if records and facts.context == "fork":
        view = _available(facts, PYTORCH)
        cause = (f"copy-on-write: the dataset's {records} are Python objects whose reference counts each "
                 f"fork worker touches, so each worker copies the pages it reads")
        if view is not None:
            out.claim("memory_workers", f"{view.env}=1", cause, evidence, "workers' private memory stays flat")
        elif not (facts.features.get(PYTORCH) and facts.features[PYTORCH].enabled):
            out.claim("memory_workers", f"the dataset's {records.split(':')[0]} as numpy arrays or one serialised "
                      "buffer (not a list of Python objects)", cause, evidence, "workers' private memory stays flat")
        return
    out.claim("memory_workers", "the dataset's __getitem__ / transforms: what they keep per sample in each worker",
              "memory grows in each worker process, not through copy-on-write"
              + (" (the dataset holds no Python record list)" if not records else ""),
              evidence, "a flat worker memory; without it the job ends out of memory")


def _gpu_idle(facts: Facts, out: Advice) -> None:
    idle, share = facts.gpu_idle, facts.figures.data_wait_share
    if idle is None or idle < GPU_IDLE or (share is not None and share >= DATA_BOUND):
        return
    out.claim("gpu_idle", "the job's batch size, or torch.compile / CUDA graphs for its model",
              "the CPU side of the step (launches, Python) keeps the GPU waiting",
              f"GPU idle {pct(idle)} of the step while data wait is {pct(share or 0.0)}",
              f"up to {pct(idle)} of the step")


def _stragglers(facts: Facts, out: Advice) -> None:
    for flag in facts.flagged:
        rank = int(flag["rank"])
        slower = pct(float(flag["slower_by"]))
        numa = facts.numa.get(rank, {})
        gpu_node, nodes = numa.get("gpu_node"), list(numa.get("cpu_nodes") or [])
        view = facts.features.get(NUMA_AFFINITY)
        if gpu_node is not None and nodes and gpu_node not in nodes and not (view and view.enabled):
            where = ",".join(map(str, nodes))
            out.claim("straggler_numa", "LOONGKIT_NUMA_AFFINITY=1",
                      f"rank {rank} runs on NUMA node {where} while its GPU is on node {gpu_node}",
                      f"rank {rank} is {slower} slower than the median of the other ranks",
                      "every rank waits for the slowest: the step shrinks by its lag")
            continue
        extra, lag = flag.get("extra_data_wait_s"), flag.get("lag_s")
        if extra is not None and lag and extra >= 0.5 * lag:
            out.claim("straggler_data", f"rank {rank}'s DataLoader (num_workers) or its data shard",
                      f"rank {rank} waits {ms(extra)} more per step for data than the others",
                      f"rank {rank} is {slower} slower than the median of the other ranks",
                      "every rank waits for the slowest: the step shrinks by its lag")


def advise(facts: Facts) -> Advice:
    out = Advice()
    if facts.figures.warm_steps <= 0:
        return out
    cpu = cpu_picture(facts)
    _contention(facts, cpu, out)
    _loading(facts, cpu, out)
    _epoch_starts(facts, out)
    _memory(facts, out)
    _gpu_idle(facts, out)
    _stragglers(facts, out)
    return out
