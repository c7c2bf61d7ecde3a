"""What every CPU benchmark here shares: a median wall time and the ``BENCH`` line ``loongkit bench`` parses.

A helper, not a benchmark (``loongkit bench`` skips ``_``-prefixed files); the scripts import it as a
sibling (``python benchmarks/<name>.py`` puts this folder first on ``sys.path``). Medians, not means:
a 2-core machine shared with other work has long one-sided tails.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_time(fn: Callable[[], Any], reps: int, warmup: int = 0) -> float:
    """Median seconds of ``reps`` calls of ``fn``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_line(name: str, baseline: float, ours: float, digits: int = 6, ratio_digits: int = 2) -> None:
    """``BENCH <name> baseline=<s> ours=<s> ratio=<baseline/ours>``, flushed (the table reads it live);
    ``digits=0`` for byte counts."""
    ratio = baseline / ours if ours else float("inf")
    print(f"BENCH {name} baseline={baseline:.{digits}f} ours={ours:.{digits}f} ratio={ratio:.{ratio_digits}f}",
          flush=True)
