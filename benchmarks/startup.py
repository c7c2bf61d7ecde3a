"""Start-up cost of loading loongkit: paired runs of bare `python -c pass` vs the same under the prelude.

Cases (each a median over paired runs, baseline and ours interleaved so machine noise hits both):
  startup_nofeature      prelude on PYTHONPATH, no LOONGKIT_* variable      (goal: < 5 ms, < 1 MB)
  startup_loglevel_only  prelude, only LOONGKIT_LOGLEVEL set (still the fast path)
  startup_all3           prelude, LOONGKIT_ALL=3, torch not imported        (target: <= 100 ms)
Time is wall-clock of the whole interpreter; memory is peak RSS (ru_maxrss of the child).

    python benchmarks/startup.py [--quick] [--check-ms 20]

--check-ms N exits non-zero when the no-feature overhead exceeds N ms (CI guard against a heavy
import sneaking into the fast path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from loongkit_core.prelude import PATH as PRELUDE


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOONGKIT_")}
    env.pop("PYTHONPATH", None)
    return env


def _run(env: dict[str, str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of one `python -c pass` with ``env``."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", "pass"], env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"child failed with {proc.returncode}")
    return elapsed, usage.ru_maxrss * 1024


Samples = tuple[list[float], list[int], list[float], list[int]]


def measure(extra: dict[str, str] | None, prelude: bool, runs: int) -> Samples:
    base_env = _clean_env()
    ours_env = dict(base_env)
    if prelude:
        ours_env["PYTHONPATH"] = PRELUDE
    ours_env.update(extra or {})
    bt, bm, ot, om = [], [], [], []
    for _ in range(2):  # warm the page cache and .pyc files
        _run(base_env)
        _run(ours_env)
    for _ in range(runs):
        t, m = _run(base_env)
        bt.append(t)
        bm.append(m)
        t, m = _run(ours_env)
        ot.append(t)
        om.append(m)
    return bt, bm, ot, om


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer runs (under a minute)")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--check-ms", type=float, default=None, help="fail if no-feature overhead exceeds this")
    args = parser.parse_args()
    runs = args.runs or (15 if args.quick else 60)
    logdir = tempfile.mkdtemp(prefix="loongkit-bench-logs-")
    cases = {
        "startup_nofeature": {},
        "startup_loglevel_only": {"LOONGKIT_LOGLEVEL": "debug"},
        "startup_all3": {"LOONGKIT_ALL": "3", "LOONGKIT_LOGDIR": logdir},
    }
    overhead_ms = {}
    for name, extra in cases.items():
        bt, bm, ot, om = measure(extra, True, runs)
        b, o = statistics.median(bt), statistics.median(ot)
        deltas = sorted(x - y for x, y in zip(ot, bt, strict=True))
        overhead_ms[name] = statistics.median(deltas) * 1000
        print(f"BENCH {name} baseline={b:.4f} ours={o:.4f} ratio={b / o:.3f}")
        mb, mo = statistics.median(bm), statistics.median(om)
        print(f"BENCH {name}_rss baseline={mb:.0f} ours={mo:.0f} ratio={mb / mo:.3f}")
        print(f"# {name}: +{overhead_ms[name]:.2f} ms (median of paired differences), "
              f"+{(mo - mb) / 2**20:.2f} MiB peak RSS, {runs} paired runs")
    if args.check_ms is not None and overhead_ms["startup_nofeature"] > args.check_ms:
        print(f"FAIL: no-feature start-up overhead {overhead_ms['startup_nofeature']:.2f} ms > {args.check_ms} ms")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
