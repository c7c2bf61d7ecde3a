"""The monitor's report: the JSON ``details.monitor`` (its keys: docs/features/monitor.md) and its text.

:func:`build` runs once, at exit, in each main process: its own figures, its workers', then (local
rank 0 / global rank 0) the other ranks' reports, stragglers and recommendations. :func:`render`
turns the dict into the "Training monitor" lines under the Feature Summary.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

from loongkit_monitor import advice, analysis, dataworkers, procstat
from loongkit_monitor.analysis import cpus, mib, ms, pct

if TYPE_CHECKING:
    from loongkit_monitor.feature import Monitor

TITLE = "Training monitor"
# Keys of one rank's figures (what "ranks" repeats per rank)
RANK_KEYS = ("steps", "warm_steps", "step_median_s", "step_p90_s", "data_wait_share", "gpu_idle_share", "workers",
             "worker_cpu_used", "cpus_allowed", "rss_growth_bytes_per_worker", "own_median_s", "data_wait_median_s",
             "host", "numa", "main_cpu_used", "distributed")


def _window(monitor: Monitor, warm_from: int, final: procstat.Usage) -> tuple[procstat.Usage, procstat.Usage] | None:
    """Samples bracketing the warm steps: the first at or after their start, the last at a boundary
    (or the exit's, when the job ended right after its last step)."""
    samples = monitor.samples
    if not samples:
        return None
    start = next((u for b, u in samples if b >= max(1, warm_from)), samples[-1][1])
    end = samples[-1][1]
    last = monitor.rec.last
    if last is not None and monitor.rec.clock() - last < 1.0:
        end = final
    return (start, end) if end.t > start.t else None


def _numa(monitor: Monitor, affinity: frozenset[int]) -> dict[str, Any]:
    env = monitor.ctx.env
    if env is None:
        return {}
    try:
        hw = env.hardware
    except Exception:
        return {}
    nodes = sorted({n for n in (hw.node_of_cpu(c) for c in affinity) if n is not None})
    out: dict[str, Any] = {"cpu_nodes": nodes, "gpu_node": None}
    gpu = monitor.gpu
    if gpu is not None and gpu.pci:
        from loongkit_monitor.gpu import sysfs_pci

        pci = sysfs_pci(gpu.pci)
        for device in hw.gpus:
            if device.pci.lower() == pci:
                out["gpu_node"], out["gpu_pci"] = device.numa_node, device.pci
    return out


def build(monitor: Monitor, records: list[Any] | None = None) -> dict[str, Any]:
    from loongkit_core import activity
    from loongkit_monitor.feature import feature_views

    rec = monitor.rec
    final = procstat.sample(cpus=getattr(monitor, "cpus", None))
    fig = analysis.step_figures(rec.steps, rec.walls, rec.waits, rec.syncs, rec.first_timed, monitor.distributed)
    window = _window(monitor, fig.warm_from, final)
    # Memory is read at the last step boundary: by the exit's sample the job may have freed what its
    # loop kept (its locals are gone), which would hide a leak and bend the fit.
    trained = monitor.samples[-1][1] if monitor.samples else final
    main_cpu = rss_growth_main = main_wait = None
    majflt = minflt = 0
    if window is not None:
        start, end = window
        main_cpu = (end.cpu_s - start.cpu_s) / (end.t - start.t)
        rss_growth_main = trained.rss - start.rss
        majflt, minflt = end.majflt - start.majflt, end.minflt - start.minflt
        if start.run_delay_s is not None and end.run_delay_s is not None:
            main_wait = min(1.0, (end.run_delay_s - start.run_delay_s) / (end.t - start.t))
    loader = rec.main_loader()
    handoff = activity.job_directory()
    reports = dataworkers.read_reports(handoff[0], os.getpid(), remove=True) if handoff else []
    workers = dataworkers.summarise(reports, window[0].t, window[1].t) if window else None
    affinity = procstat.affinity() | (workers.affinity if workers else frozenset())
    process = monitor.process
    allowance = procstat.allowance(affinity, getattr(process, "local_world_size", None) or 1)
    gpu_idle, gpu_source = (monitor.gpu.idle_share(fig.wall_s, fig.warm_from) if monitor.gpu is not None
                            else (None, "no CUDA device in use"))
    own: dict[str, Any] = {
        "rank": getattr(process, "rank", None) or 0,
        "host": getattr(process, "host", ""),
        "source": monitor.source or None,
        "steps": fig.steps,
        "warm_steps": fig.warm_steps,
        "step_median_s": fig.median_s,
        "step_mean_s": fig.wall_s / fig.warm_steps if fig.warm_steps and fig.median_s is not None else None,
        "step_p90_s": fig.p90_s,
        "data_wait_share": fig.data_wait_share,
        "data_wait_median_s": fig.data_wait_median_s,
        "sync_share": fig.sync_share,
        "own_median_s": fig.own_median_s,
        "distributed": monitor.distributed,
        "gpu_idle_share": gpu_idle,
        "gpu_idle_source": gpu_source,
        "workers": loader.num_workers if loader is not None else 0,
        "worker_processes": workers.processes if workers else 0,
        "worker_cpu_used": workers.cpu_used if workers else None,
        "cpus_allowed": allowance.cpus,
        "cpus_allowed_note": allowance.describe() + (f"; {allowance.note}" if allowance.note else ""),
        "rss_growth_bytes_per_worker": workers.rss_growth if workers else None,
        "private_growth_bytes_per_worker": workers.private_growth if workers else None,
        "worker_rss_bytes": workers.rss_mean if workers else None,
        "worker_major_faults": workers.majflt if workers else 0,
        "main_cpu_used": main_cpu,
        "main_cpu_wait_share": main_wait,
        "worker_cpu_wait_share": workers.cpu_wait_share if workers else None,
        "main_rss_bytes": trained.rss,
        "main_rss_growth_bytes": rss_growth_main,
        "main_major_faults": majflt,
        "main_minor_faults": minflt,
        "loader": loader.to_json() if loader is not None else None,
        "numa": _numa(monitor, affinity),
        "paused_s": rec.total_paused_s,
    }
    ranks: dict[int, dict[str, Any]] = {int(own["rank"]): own}
    gatherer = monitor.gatherer
    if gatherer is not None:
        gatherer.publish(own)
        ranks = {int(r): d for r, d in gatherer.collect(own).items()}
    scores, flagged = analysis.stragglers(ranks) if len(ranks) > 1 else ({}, [])
    torch = sys.modules.get("torch")
    threads = None
    if torch is not None and hasattr(torch, "get_num_threads"):
        try:
            threads = int(torch.get_num_threads())
        except Exception:
            threads = None
    facts = _facts(monitor, fig, window, loader, workers, allowance, gpu_idle, threads, flagged, ranks, final,
                   features=feature_views(records if records is not None else monitor.ctx.features()))
    details = dict(own)
    details["stragglers"] = [{"rank": f["rank"], "slower_by": f["slower_by"], "evidence": f["evidence"]}
                             for f in flagged]
    found = advice.advise(facts)
    details["recommendations"] = found.recommendations
    details["unclear"] = found.unclear
    details["others_cpu"] = facts.others_cpu
    details["torch_threads"] = threads
    details["neighbours"] = [{"name": n, "pid": p, "cpus": c} for n, p, c in facts.neighbours]
    if facts.main_slope is not None:
        details["main_rss_slope_bytes_per_s"] = facts.main_slope.per_s
        details["main_rss_slope_r2"] = facts.main_slope.r2
    details["memory_limit_bytes"] = facts.memory_limit
    details["stopped_at_max_steps"] = monitor.stopped
    details["notes"] = list(monitor.notes) + (list(gatherer.notes) if gatherer is not None else [])
    if gatherer is not None and gatherer.silent:  # ranks that sent nothing, and why (rank 0 only)
        details["silent_ranks"] = {r: why for r, why in sorted(gatherer.silent.items())}
    details["hooks"] = dict(monitor.hooks)
    if len(ranks) > 1:
        details["ranks"] = {r: {**{k: d.get(k) for k in RANK_KEYS}, "straggler_score": scores.get(r)}
                            for r, d in sorted(ranks.items())}
    return details


def _memory_limit() -> tuple[int | None, str]:
    """The tightest of the cgroup memory limit and the host's memory, with which it is."""
    from loongkit_core import cgroupfs

    host = cgroupfs.mem_total("/")
    try:
        group = cgroupfs.own_group("/", "memory")
        limit = cgroupfs.memory_limit(group) if group is not None else None
    except Exception:
        limit = None
    if limit is not None and (host is None or limit < host):
        return limit, "cgroup memory limit"
    return host, "host memory"


def _facts(monitor: Monitor, fig: analysis.StepFigures, window: tuple[procstat.Usage, procstat.Usage] | None,
           loader: Any, workers: dataworkers.WorkerFigures | None, allowance: procstat.CpuAllowance,
           gpu_idle: float | None, threads: int | None, flagged: list[dict[str, Any]],
           ranks: dict[int, dict[str, Any]], final: procstat.Usage, features: Any) -> advice.Facts:
    """What the advice rules read, from this process's samples and its workers' reports."""
    main_cpu = main_wait = others = slope = blocks = None
    trained = monitor.samples[-1][1] if monitor.samples else final  # memory at the last step boundary
    span = 0.0
    neighbours: list[tuple[str, int, float]] = []
    if window is not None:
        start, end = window
        span = end.t - start.t
        main_cpu = (end.cpu_s - start.cpu_s) / span
        if start.run_delay_s is not None and end.run_delay_s is not None:
            main_wait = min(1.0, (end.run_delay_s - start.run_delay_s) / span)
        job = main_cpu + (workers.cpu_used if workers and workers.cpu_used is not None else 0.0)
        if start.cpus_busy_s is not None and end.cpus_busy_s is not None:
            others = max(0.0, (end.cpus_busy_s - start.cpus_busy_s) / span - job)
        inside = [u for _, u in monitor.samples if start.t <= u.t <= end.t]
        slope = advice.fit([(u.t, float(u.rss)) for u in inside])  # step boundaries only: not the exit's
        with_blocks = [u for u in inside if u.py_blocks is not None]
        if len(with_blocks) >= 2 and with_blocks[-1].t > with_blocks[0].t:
            blocks = ((with_blocks[-1].py_blocks or 0) - (with_blocks[0].py_blocks or 0)) / (
                with_blocks[-1].t - with_blocks[0].t)
        if monitor.scans:
            before_t, before = next(((t, s) for t, s in reversed(monitor.scans) if t <= start.t), monitor.scans[0])
            after = procstat.processes()
            job_pids = procstat.descendants(os.getpid(), after)
            local = getattr(monitor.process, "local_world_size", None) or 1
            if local > 1:  # sibling ranks (and their workers) are the job's
                job_pids |= procstat.descendants(os.getppid(), after)
            neighbours = procstat.others_busy(before, after, job_pids, monitor.cpus, time.time() - before_t)
    limit, limit_note = _memory_limit()
    growth = workers.private_growth if workers and workers.private_growth is not None else None
    growth_kind = "private memory"
    if growth is None and workers is not None:
        growth, growth_kind = workers.rss_growth, "RSS"
    steps = max(1, monitor.rec.steps)
    return advice.Facts(
        figures=fig, num_workers=loader.num_workers if loader is not None else None,
        persistent=loader.persistent if loader is not None else False,
        context=loader.context if loader is not None else "", epochs=loader.epochs if loader is not None else 0,
        loaders_built=loader.built if loader is not None else 1,
        epoch_start_wait_s=loader.epoch_start_wait_s if loader is not None else 0.0,
        total_wait_s=loader.wait_s + loader.iter_s if loader is not None else 0.0,
        batches_per_step=(loader.batches / steps) if loader is not None and loader.batches else 1.0,
        batch_size=loader.batch_size if loader is not None else None,
        dataset=loader.dataset if loader is not None else None,
        worker_slots=workers.slots if workers else 0, workers_cpu=workers.cpu_used if workers else None,
        workers_cpu_wait=workers.cpu_wait_share if workers else None, main_cpu_wait=main_wait,
        worker_growth=growth, worker_growth_kind=growth_kind, worker_rss=workers.rss_mean if workers else None,
        window_s=span, main_cpu=main_cpu, main_rss=float(trained.rss), main_slope=slope, blocks_per_s=blocks,
        memory_limit=limit, memory_limit_note=limit_note, others_cpu=others, neighbours=neighbours,
        allowed=allowance.cpus, allowed_note=allowance.describe(),
        local_ranks=getattr(monitor.process, "local_world_size", None) or 1, torch_threads=threads,
        gpu_idle=gpu_idle, features=features,
        options={k: v for k, v in os.environ.items() if k.startswith("LOONGKIT_")},
        flagged=flagged, numa={r: d.get("numa") or {} for r, d in ranks.items()})


# --------------------------------------------------------------------------------------------------
# Text


def _signed_mib(n: float) -> str:
    """+3 MiB / -16 MiB; a change that rounds to nothing is +0."""
    return f"{'-' if n < 0 and round(abs(n) / (1 << 20)) else '+'}{mib(abs(n))}"


def _share(value: Any) -> str:
    return "n/a" if value is None else pct(float(value))


def render(details: dict[str, Any] | None) -> list[str]:
    """The Training monitor section (lines, no trailing newline)."""
    if details is None:
        return [f"{TITLE}: no report (the process ended before the monitor's exit hook ran)"]
    steps = int(details.get("steps") or 0)
    if not steps:
        return [f"{TITLE}: no steps seen (no optimizer step, mmengine or mmcv training iteration ran)"]
    rank = details.get("rank", 0)
    head = f"{TITLE} (rank {rank}; steps = {details.get('source') or 'unknown'})"
    lines = [head]
    median, p90 = details.get("step_median_s"), details.get("step_p90_s")
    timing = (f"step median {ms(median)}, p90 {ms(p90)}" if median is not None
              else "too few steps to time")
    stop = ", stopped at LOONGKIT_MONITOR_MAX_STEPS" if details.get("stopped_at_max_steps") else ""
    lines.append(f"  steps {steps:,} ({details.get('warm_steps', 0):,} after warm-up{stop}) | {timing}")
    gpu = details.get("gpu_idle_share")
    gpu_text = f"GPU idle {_share(gpu)} ({details.get('gpu_idle_source')})" if gpu is not None else \
        f"GPU idle n/a ({details.get('gpu_idle_source')})"
    lines.append(f"  data wait {_share(details.get('data_wait_share'))} of the step | {gpu_text}")
    main_cpu = details.get("main_cpu_used")
    growth = details.get("main_rss_growth_bytes")
    lines.append(f"  main process: {cpus(main_cpu) if main_cpu is not None else 'n/a'} CPUs busy, RSS "
                 f"{mib(details.get('main_rss_bytes') or 0)}"
                 + (f" ({_signed_mib(growth)} over the warm steps)" if growth is not None
                    else "")
                 + f", {details.get('main_major_faults', 0):,} major page faults"
                 + (f", waited for a CPU {pct(details['main_cpu_wait_share'])} of the time"
                    if details.get("main_cpu_wait_share") is not None else ""))
    loader = details.get("loader")
    if loader:
        n = int(loader.get("num_workers", 0))
        if n:
            kind = f"{loader.get('context') or '?'}, {'persistent' if loader.get('persistent') else 'not persistent'}"
            used = details.get("worker_cpu_used")
            private = details.get("private_growth_bytes_per_worker")
            rss = details.get("worker_rss_bytes")
            parts = [f"{cpus(used)} CPUs busy" if used is not None else "CPU n/a (no worker report spans the "
                                                                          "warm steps)"]
            if private is not None:
                parts.append(f"private memory {_signed_mib(private)} per worker")
            if rss is not None:
                parts.append(f"RSS {mib(rss)} per worker")
            if details.get("worker_cpu_wait_share") is not None:
                parts.append(f"waited for a CPU {pct(details['worker_cpu_wait_share'])} of the time")
            lines.append(f"  DataLoader: {n} worker{'s' if n != 1 else ''} ({kind}): " + ", ".join(parts))
        else:
            lines.append("  DataLoader: no workers (the main process loads the batches)")
    busy = (main_cpu or 0.0) + (details.get("worker_cpu_used") or 0.0)
    lines.append(f"  CPUs: {cpus(busy)} busy of {cpus(float(details.get('cpus_allowed') or 0))} allowed "
                 f"({details.get('cpus_allowed_note')})")
    ranks = details.get("ranks")
    if ranks:
        lines.append("  ranks (step median / own time outside synchronisation / data wait):")
        flagged = {int(s["rank"]) for s in details.get("stragglers", [])}
        for r, d in sorted(ranks.items(), key=lambda item: int(item[0])):
            def fmt(v: Any) -> str:
                return ms(float(v)) if v is not None else "n/a"
            mark = "  <- straggler" if int(r) in flagged else ""
            lines.append(f"    rank {r}: {fmt(d.get('step_median_s'))} / {fmt(d.get('own_median_s'))} / "
                         f"{fmt(d.get('data_wait_median_s'))}{mark}")
    for s in details.get("stragglers", []):
        lines.append(f"  straggler: {s['evidence']}")
    recs = details.get("recommendations") or []
    if recs:
        lines.append("  Recommendations:")
        for r in recs:
            if "cause" in r:
                lines.extend([f"    * {r['setting']}", f"        why: {r['cause']}", f"        seen: {r['evidence']}",
                              f"        expected: {r['expected']}"])
            else:
                lines.append(f"    * {r['setting']}: {r['evidence']}")
    else:
        lines.append("  Recommendations: none (nothing seen in this job that a setting would measurably change)")
    for text in details.get("unclear") or []:
        lines.append(f"  unclear: {text}")
    others = details.get("others_cpu")
    if others is not None and others >= advice.OTHERS:
        seen = ", ".join(f"{n['name']} ({cpus(n['cpus'])})" for n in details.get("neighbours") or [])
        lines.append(f"  other processes kept {cpus(others)} of the job's CPUs busy" + (f": {seen}" if seen else ""))
    for note in details.get("notes", []):
        lines.append(f"  note: {note}")
    return lines
