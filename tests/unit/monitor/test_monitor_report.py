"""The Training monitor section's text from a report dict (the layout docs/features/monitor.md shows)."""

from __future__ import annotations

from typing import Any

from loongkit_monitor.report import render


def report(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "rank": 0, "source": "optimizer AdamW.step", "steps": 60, "warm_steps": 54, "step_median_s": 0.0842,
        "step_p90_s": 0.097, "data_wait_share": 0.412, "gpu_idle_share": None,
        "gpu_idle_source": "no CUDA device in use",
        "main_cpu_used": 0.98, "main_rss_bytes": 612 << 20, "main_rss_growth_bytes": 3 << 20, "main_major_faults": 0,
        "main_cpu_wait_share": 0.05,
        "loader": {"num_workers": 4, "context": "fork", "persistent": False},
        "worker_cpu_used": 3.9, "private_growth_bytes_per_worker": 1 << 20, "worker_rss_bytes": 410 << 20,
        "worker_cpu_wait_share": 0.02, "cpus_allowed": 4.0, "cpus_allowed_note": "4 CPUs in the affinity mask",
        "stragglers": [], "recommendations": [{"setting": "LOONGKIT_DISTORTION=1",
                                               "evidence": "data wait 41 % of the step, 4 workers use 3.9 of 4.0 "
                                                           "allowed CPUs (main process 1.0)"}],
        "stopped_at_max_steps": False, "notes": []}
    base.update(kw)
    return base


def test_single_rank_section() -> None:
    lines = render(report())
    assert lines[0] == "Training monitor (rank 0; steps = optimizer AdamW.step)"
    text = "\n".join(lines)
    assert "  steps 60 (54 after warm-up) | step median 84.2 ms, p90 97.0 ms" in text
    assert "  data wait 41 % of the step | GPU idle n/a (no CUDA device in use)" in text
    assert "  main process: 1.0 CPUs busy, RSS 612 MiB (+3 MiB over the warm steps), 0 major page faults, waited " \
           "for a CPU 5 % of the time" in text
    assert "  DataLoader: 4 workers (fork, not persistent): 3.9 CPUs busy, private memory +1 MiB per worker, RSS " \
           "410 MiB per worker, waited for a CPU 2 % of the time" in text
    assert "  CPUs: 4.9 busy of 4.0 allowed (4 CPUs in the affinity mask)" in text
    assert "    * LOONGKIT_DISTORTION=1: data wait 41 % of the step" in text


def test_ranks_and_stragglers() -> None:
    ranks = {"0": {"step_median_s": 0.0585, "own_median_s": 0.0126, "data_wait_median_s": 0.0002},
             "1": {"step_median_s": 0.059, "own_median_s": 0.052, "data_wait_median_s": 0.0002}}
    lines = render(report(ranks=ranks, recommendations=[], stragglers=[
        {"rank": 1, "slower_by": 0.67, "evidence": "rank 1 spends 39.4 ms more per step outside synchronisation"}]))
    text = "\n".join(lines)
    assert "    rank 0: 58.5 ms / 12.6 ms / 0.2 ms\n    rank 1: 59.0 ms / 52.0 ms / 0.2 ms  <- straggler" in text
    assert "  straggler: rank 1 spends 39.4 ms more per step outside synchronisation" in text
    assert "  Recommendations: none (nothing seen in this job that a setting would measurably change)" in text


def test_memory_changes_keep_their_sign_unless_they_round_to_nothing() -> None:
    assert "RSS 612 MiB (-16 MiB over" in "\n".join(render(report(main_rss_growth_bytes=-(16 << 20))))
    assert "RSS 612 MiB (+0 MiB over" in "\n".join(render(report(main_rss_growth_bytes=-1000)))


def test_no_steps_and_no_report() -> None:
    assert render(report(steps=0)) == ["Training monitor: no steps seen (no optimizer step, mmengine or mmcv "
                                       "training iteration ran)"]
    assert render(None)[0].startswith("Training monitor: no report")


def test_no_workers_and_max_steps() -> None:
    text = "\n".join(render(report(loader={"num_workers": 0}, stopped_at_max_steps=True, worker_cpu_used=None)))
    assert "  DataLoader: no workers (the main process loads the batches)" in text
    assert "stopped at LOONGKIT_MONITOR_MAX_STEPS" in text
