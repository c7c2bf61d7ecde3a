"""The training monitor's figures, read from a trial's JSON Summary (``LOONGKIT_SUMMARY_JSON``).

The monitor's row (``features[*].name == "monitor"``) carries ``details.monitor`` (see
docs/features/monitor.md). Under torchrun, rank 0 writes the template path itself (other ranks get a
``.rank<N>`` suffix), and its figures include a ``ranks`` map; tune reads rank 0's file only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MONITOR = "monitor"


@dataclass(frozen=True)
class Recommendation:
    setting: str
    evidence: str
    kind: str = ""  # the monitor's claim kind (advice.KINDS)
    count: int | None = None  # the count a "workers" claim names


@dataclass(frozen=True)
class Figures:
    """What one trial's monitor measured (rank 0's view)."""

    steps: int
    warm_steps: int
    step_median_s: float | None
    step_p90_s: float | None
    data_wait_share: float | None
    gpu_idle_share: float | None
    workers: int
    worker_cpu_used: float | None
    cpus_allowed: float | None
    stopped_at_max_steps: bool
    recommendations: tuple[Recommendation, ...] = ()
    ranks: int = 1
    step_mean_s: float | None = None  # the warm steps' mean: the job's throughput (a wait for data counts)
    torch_threads: int | None = None  # the main process's intra-op threads at the end
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def usable(self) -> bool:
        """A warm step to rank by."""
        return self.step_s is not None and self.step_s > 0

    @property
    def step_s(self) -> float | None:
        """What tune ranks by: the mean warm step (total time is what a user waits for), the median
        from a monitor that does not give the mean."""
        return self.step_mean_s if self.step_mean_s is not None else self.step_median_s

    @property
    def data_bound(self) -> bool:
        return (self.data_wait_share or 0.0) >= DATA_BOUND_SHARE

    @property
    def workers_saturated(self) -> bool:
        """The data workers keep (nearly) every allowed CPU busy: more workers would only contend."""
        if self.worker_cpu_used is None or not self.cpus_allowed:
            return False
        return self.worker_cpu_used >= 0.9 * self.cpus_allowed


# The share of the step the main process waits for data above which a job counts as data-bound
# (the monitor's own recommendations use their own thresholds; this only orders tune's search).
DATA_BOUND_SHARE = 0.15


def _float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _int(value: object, default: int = 0) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


def _count(value: object) -> int | None:
    n = _int(value, -1)
    return n if n >= 0 else None


def from_details(details: Mapping[str, Any]) -> Figures:
    """Figures from the ``details.monitor`` dict; missing or mistyped keys read as unknown."""
    recs = details.get("recommendations") or []
    recommendations = tuple(
        Recommendation(str(r.get("setting", "")), str(r.get("evidence", "")), str(r.get("kind", "")),
                       _count(r.get("count")))
        for r in recs if isinstance(r, Mapping))
    ranks = details.get("ranks")
    return Figures(
        steps=_int(details.get("steps")),
        warm_steps=_int(details.get("warm_steps")),
        step_median_s=_float(details.get("step_median_s")),
        step_p90_s=_float(details.get("step_p90_s")),
        data_wait_share=_float(details.get("data_wait_share")),
        gpu_idle_share=_float(details.get("gpu_idle_share")),
        workers=_int(details.get("workers")),
        worker_cpu_used=_float(details.get("worker_cpu_used")),
        cpus_allowed=_float(details.get("cpus_allowed")),
        stopped_at_max_steps=bool(details.get("stopped_at_max_steps")),
        recommendations=recommendations,
        ranks=len(ranks) if isinstance(ranks, Mapping) and ranks else 1,
        step_mean_s=_float(details.get("step_mean_s")),
        torch_threads=_int(details.get("torch_threads")) or None,
        raw=dict(details),
    )


def monitor_row(summary: Mapping[str, Any]) -> Mapping[str, Any] | None:
    features = summary.get("features")
    if not isinstance(features, Sequence):
        return None
    return next((r for r in features if isinstance(r, Mapping) and r.get("name") == MONITOR), None)


def from_summary(summary: Mapping[str, Any]) -> tuple[Figures | None, str]:
    """(figures, "") or (None, why there are none)."""
    row = monitor_row(summary)
    if row is None:
        return None, "the Summary has no 'monitor' row (is loongkit-monitor installed?)"
    details = (row.get("details") or {}).get(MONITOR)
    if not isinstance(details, Mapping):
        state = row.get("state", "?")
        reason = row.get("reason") or ""
        return None, f"the monitor recorded no figures (state {state}{': ' + reason if reason else ''})"
    return from_details(details), ""


def active_level(summary: Mapping[str, Any] | None, own: frozenset[str] = frozenset()) -> int | None:
    """The highest level among the features whose code ran in the trial (``active`` in the JSON
    Summary), leaving out tune's own (``own``); 0 when none ran, None without a readable Summary.
    A feature that is enabled but never ran cannot have changed the job's numerics."""
    if summary is None:
        return None
    features = summary.get("features")
    if not isinstance(features, list):
        return None
    levels = [r.get("level") for r in features if isinstance(r, Mapping) and r.get("active") is True
              and r.get("name") != MONITOR and r.get("name") not in own]
    return max((lv for lv in levels if isinstance(lv, int) and not isinstance(lv, bool)), default=0)


def read(path: str | Path) -> tuple[Figures | None, dict[str, Any] | None, str]:
    """(figures, whole summary, why not) from rank 0's Summary file."""
    try:
        summary = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None, None, "no JSON Summary was written (the job ended before loongkit's exit handler ran?)"
    except (OSError, ValueError) as exc:
        return None, None, f"unreadable JSON Summary: {exc}"
    if not isinstance(summary, dict):
        return None, None, "the JSON Summary is not an object"
    figures, why = from_summary(summary)
    return figures, summary, why
