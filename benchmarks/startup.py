"""Start-up cost of loading loongkit: paired runs of a bare interpreter vs the same under the prelude.

Cases (baseline and ours interleaved so machine noise hits both; overhead = median of the paired
differences; goals from issue 18, for a quiet machine):
  startup_nofeature       prelude on PYTHONPATH, no LOONGKIT_* variable        (goal: <= 2 ms, <= 0.5 MiB)
  startup_loglevel_only   prelude, only LOONGKIT_LOGLEVEL set (still the fast path)
  startup_all1            LOONGKIT_ALL=1, torch not imported, the job's resolution reused
                          (every process after the job's first)                 (goal: <= 60 ms, <= 8 MiB)
  startup_all1_full       the same, resolving in full (LOONGKIT_RESOLVE_ONCE=0: what the job's first
                          process does)                                          (reported)
  startup_all3            LOONGKIT_ALL=3, resolution reused                      (goal: <= 100 ms, <= 12 MiB)
  startup_all3_full       LOONGKIT_ALL=3, resolving in full                      (reported)
  startup_spawn_worker    a spawn/forkserver DataLoader worker's interpreter (``--multiprocessing-fork``
                          in argv) with what its ALL=1 main hands its children   (goal: <= 30 ms)
  startup_import_torch    ``import torch`` with LOONGKIT_ALL=1 (arming, plugins loading and features
                          activating on import; resolution reused) vs bare      (goal: no slower than before)
  startup_import_torch_full  the same, resolving in full                         (reported)
  startup_torchrun_2ranks  ``torchrun --nproc-per-node 2`` of a gloo DDP script, from the agent's start to
                          rank 0's first optimizer step, bare vs ``LOONGKIT_ALL=1 loongkit-run torchrun``
                          (wall time only; each pair a fresh job)                (goal: within 1 s)
Each case prints wall time, CPU time (ru_utime + ru_stime of the child, far less noisy than wall time
on a loaded machine) and peak RSS (the child's VmHWM at its very end: its ru_maxrss would start from
this script's own RSS, which a forked child inherits before it execs), and the load average around it.

    python benchmarks/startup.py [--quick] [--only CASE,...] [--check [--margin 2]] [--check-ms 20]

--check exits non-zero when a case with a goal exceeds it (CPU-time overhead, and peak RSS) times
--margin (CI guard on a loaded machine); --check-ms N only checks the no-feature wall overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from loongkit_core.prelude import PATH as PRELUDE

MiB = 1 << 20

# Reports the child's peak RSS after everything else at exit (loongkit's Summary included: atexit runs
# last what registered first, and the prelude runs this sitecustomize before it boots).
HWM_SITECUSTOMIZE = """
import atexit, sys
def _loongkit_bench_hwm():
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    sys.stderr.write("LOONGKIT_BENCH_VMHWM " + line.split()[1] + "\\n")
    except OSError:
        pass
atexit.register(_loongkit_bench_hwm)
"""


@dataclass
class Case:
    name: str
    extra: dict[str, str]
    code: str = "pass"
    argv: tuple[str, ...] = ()
    goal_ms: float | None = None  # overhead goal (quiet machine)
    goal_mib: float | None = None
    runs: int | None = None  # fewer for the slow torch cases in --quick
    torchrun: bool = False  # a whole torchrun job, timed to its first step (measure_torchrun)


@dataclass
class Result:
    wall: tuple[float, float, float]  # baseline median, ours median, median paired difference (s)
    cpu: tuple[float, float, float]
    rss: tuple[float, float, float]  # bytes


_HWM_DIR = tempfile.mkdtemp(prefix="loongkit-bench-hwm-")
with open(os.path.join(_HWM_DIR, "sitecustomize.py"), "w") as _fh:
    _fh.write(HWM_SITECUSTOMIZE)


def _clean_env() -> dict[str, str]:
    """Both sides: no LOONGKIT_* variables, the peak-RSS reporter as the user's sitecustomize."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOONGKIT_", "_LOONGKIT_"))}
    env["PYTHONPATH"] = _HWM_DIR
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # both sides use the bytecode caches the warm-up writes
    return env


def _run(env: dict[str, str], code: str, argv: tuple[str, ...]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, peak RSS bytes) of one interpreter running ``code``."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    code_ = os.waitstatus_to_exitcode(status)
    if code_ != 0:
        raise SystemExit(f"child failed with {code_}: {code!r} {argv}\n{err.decode(errors='replace')}")
    hwm = [line.split()[1] for line in err.decode(errors="replace").splitlines()
           if line.startswith("LOONGKIT_BENCH_VMHWM ")]
    rss = int(hwm[-1]) * 1024 if hwm else usage.ru_maxrss * 1024
    return elapsed, usage.ru_utime + usage.ru_stime, rss


def handoff(extra: dict[str, str]) -> dict[str, str]:
    """What a main process booted with ``extra`` hands its children (the _LOONGKIT_* variables)."""
    env = {**_clean_env(), **extra}
    env["PYTHONPATH"] = os.pathsep.join([PRELUDE, _HWM_DIR])
    code = "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('_LOONGKIT_')}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def measure(case: Case, runs: int) -> Result:
    base_env = _clean_env()
    ours_env = {**base_env, "PYTHONPATH": os.pathsep.join([PRELUDE, _HWM_DIR]), **case.extra}
    for _ in range(2):  # warm the page cache and .pyc files (and write the resolution)
        _run(base_env, case.code, case.argv)
        _run(ours_env, case.code, case.argv)
    base: list[tuple[float, float, int]] = []
    ours: list[tuple[float, float, int]] = []
    for _ in range(runs):
        base.append(_run(base_env, case.code, case.argv))
        ours.append(_run(ours_env, case.code, case.argv))

    def stat(i: int) -> tuple[float, float, float]:
        return (statistics.median(b[i] for b in base), statistics.median(o[i] for o in ours),
                statistics.median(o[i] - b[i] for o, b in zip(ours, base, strict=True)))

    return Result(stat(0), stat(1), stat(2))


# One torchrun rank: its first optimizer step (DDP over gloo: both ranks are in it) ends the measured span.
TORCHRUN_SCRIPT = """
import time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(4, 8)).sum().backward()
opt.step()
if dist.get_rank() == 0:
    print("LOONGKIT_BENCH_FIRST_STEP", repr(time.time()), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun_once(ours: bool, extra: dict[str, str], script: str) -> float:
    """Seconds from starting the agent to rank 0's first step, for one fresh 2-rank job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOONGKIT_", "_LOONGKIT_"))}
    env.pop("PYTHONPATH", None)
    env["OMP_NUM_THREADS"] = "1"
    bindir = os.path.dirname(sys.executable)
    command = [os.path.join(bindir, "torchrun"), "--nproc-per-node", "2", "--master-port", str(_free_port()), script]
    if ours:
        env.update(extra)
        command = [os.path.join(bindir, "loongkit-run"), *command]
    start = time.time()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    stamps = [float(line.split()[1]) for line in proc.stdout.splitlines()
              if line.startswith("LOONGKIT_BENCH_FIRST_STEP ")]
    if proc.returncode != 0 or not stamps:
        raise SystemExit(f"torchrun job failed ({proc.returncode}, ours={ours}):\n{proc.stdout[-2000:]}"
                         f"\n{proc.stderr[-3000:]}")
    return stamps[0] - start


def measure_torchrun(case: Case, runs: int) -> Result:
    """Paired fresh jobs, bare and ours alternating (which goes first alternates too); wall time only
    (the CPU time and peak RSS of an agent and its ranks are not one child's)."""
    script = os.path.join(_HWM_DIR, "torchrun_first_step.py")
    with open(script, "w") as fh:
        fh.write(TORCHRUN_SCRIPT)
    _torchrun_once(False, case.extra, script)  # page cache, .pyc files, the job's resolution
    _torchrun_once(True, case.extra, script)
    base: list[float] = []
    ours: list[float] = []
    for i in range(runs):
        for first in ((False, True) if i % 2 == 0 else (True, False)):
            (ours if first else base).append(_torchrun_once(first, case.extra, script))
    wall = (statistics.median(base), statistics.median(ours),
            statistics.median(o - b for o, b in zip(ours, base, strict=True)))
    return Result(wall, (0.0, 0.0, 0.0), (0.0, 0.0, 0.0))


def cases(logdir: str) -> list[Case]:
    log = {"LOONGKIT_LOGDIR": logdir}
    full = {"LOONGKIT_RESOLVE_ONCE": "0"}
    all1 = {"LOONGKIT_ALL": "1", **log}
    worker = handoff(all1)
    return [
        Case("startup_nofeature", {}, goal_ms=2, goal_mib=0.5),
        Case("startup_loglevel_only", {"LOONGKIT_LOGLEVEL": "debug"}),
        Case("startup_all1", all1, goal_ms=60, goal_mib=8),
        Case("startup_all1_full", {**all1, **full}),
        Case("startup_all3", {"LOONGKIT_ALL": "3", **log}, goal_ms=100, goal_mib=12),
        Case("startup_all3_full", {"LOONGKIT_ALL": "3", **log, **full}),
        Case("startup_spawn_worker", {**all1, **worker}, argv=("--multiprocessing-fork",), goal_ms=30),
        Case("startup_import_torch", all1, code="import torch", runs=5),
        Case("startup_import_torch_full", {**all1, **full}, code="import torch", runs=5),
        Case("startup_torchrun_2ranks", all1, runs=3, torchrun=True),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer runs (about a minute on 2 idle cores)")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--check", action="store_true", help="fail if a case misses its goal times --margin")
    parser.add_argument("--margin", type=float, default=1.0, help="goal multiplier for --check (loaded machines)")
    parser.add_argument("--check-ms", type=float, default=None, help="fail if no-feature wall overhead exceeds this")
    args = parser.parse_args()
    runs = args.runs or (7 if args.quick else 30)
    logdir = tempfile.mkdtemp(prefix="loongkit-bench-logs-")
    only = {c for c in args.only.split(",") if c}
    failed: list[str] = []
    for case in cases(logdir):
        if only and case.name not in only:
            continue
        load = os.getloadavg()[0]
        n = min(runs, case.runs) if case.runs and args.quick else runs
        if case.torchrun:
            n = min(runs, case.runs or runs) if args.quick else min(runs, 7)
            r = measure_torchrun(case, n)
            print(f"BENCH {case.name} baseline={r.wall[0]:.4f} ours={r.wall[1]:.4f} "
                  f"ratio={r.wall[0] / r.wall[1]:.3f}")
            within = r.wall[2] <= 1.0
            print(f"# {case.name}: +{r.wall[2] * 1000:.0f} ms from the agent's start to the first step (median "
                  f"paired difference, {n} pairs; bare {r.wall[0]:.2f} s); load average {load:.1f} -> "
                  f"{os.getloadavg()[0]:.1f}; goal within 1 s: {'met' if within else 'MISSED'}", flush=True)
            if not within and args.check:
                failed.append(case.name)
            continue
        r = measure(case, n)
        print(f"BENCH {case.name} baseline={r.wall[0]:.4f} ours={r.wall[1]:.4f} ratio={r.wall[0] / r.wall[1]:.3f}")
        print(f"BENCH {case.name}_cpu baseline={r.cpu[0]:.4f} ours={r.cpu[1]:.4f} ratio={r.cpu[0] / r.cpu[1]:.3f}")
        print(f"BENCH {case.name}_rss baseline={r.rss[0]:.0f} ours={r.rss[1]:.0f} ratio={r.rss[0] / r.rss[1]:.3f}")
        goal = ""
        if case.goal_ms is not None:
            cpu_ok = r.cpu[2] * 1000 <= case.goal_ms * args.margin
            rss_ok = case.goal_mib is None or r.rss[2] / MiB <= case.goal_mib * args.margin
            mib = f", <= {case.goal_mib:g} MiB" if case.goal_mib is not None else ""
            goal = (f"; goal <= {case.goal_ms:g} ms{mib}"
                    f"{f' x{args.margin:g}' if args.margin != 1 else ''}: {'met' if cpu_ok and rss_ok else 'MISSED'}"
                    " (CPU time)")
            if not (cpu_ok and rss_ok) and args.check:
                failed.append(case.name)
        print(f"# {case.name}: +{r.wall[2] * 1000:.1f} ms wall, +{r.cpu[2] * 1000:.1f} ms CPU, "
              f"+{r.rss[2] / MiB:.2f} MiB peak RSS (median paired differences, {n} pairs; bare "
              f"{r.wall[0] * 1000:.1f} ms wall, {r.cpu[0] * 1000:.1f} ms CPU); load average "
              f"{load:.1f} -> {os.getloadavg()[0]:.1f}{goal}", flush=True)
        if case.name == "startup_nofeature" and args.check_ms is not None and r.wall[2] * 1000 > args.check_ms:
            failed.append(f"{case.name} (wall > {args.check_ms} ms)")
    if failed:
        print(f"FAIL: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
