"""Overhead of LOONGKIT_MONITOR on a real training job: examples/train_classifier.py, monitor off vs on.

Same process, same model, same data: the example's loop (its Net, Stripes and AdamW, a DataLoader
with 2 workers) runs with the monitor's hooks (optimizer hook, DataLoader timing, backward and
collectives timing) switched on and off between steps, in the order on, off, off, on, ... so that
both variants see the same moments of the machine; each step is timed by the benchmark itself.
The workers' sampler threads run throughout (they start with the workers); their cost is measured
on its own. Two direct measurements complete the picture, since a shared machine's noise is far
larger than the monitor's cost:

* the hooks' CPU time per step, on a loop that does nothing but one fetch, one backward and one
  optimizer step (this thread's CPU time, so that preemption by other processes does not count);
* a worker sampler's CPU time per sample (it samples every two seconds once started).

Prints ``BENCH monitor_overhead_train_classifier baseline=<s> ours=<s> ratio=<baseline/ours>``: the
median CPU seconds of the training thread per step (torch runs one compute thread here, so that the
figure is the job's work and not the other tenants' preemption; the wall-clock medians follow on the
last line), ``BENCH monitor_hooks_per_step ...`` (CPU seconds per step of the bare loop, bare and
hooked), then the costs as shares of the example's step.

    python benchmarks/monitor.py            # 320 steps
    python benchmarks/monitor.py --quick    # 128 steps, batch 16: under a minute
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _timing import bench_line
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from loongkit_monitor import dataworkers  # noqa: E402
from loongkit_monitor.feature import DEFAULTS, EARLY_SAMPLES, SAMPLE_INTERVAL, SCAN_AT, MonitorFeature  # noqa: E402
from loongkit_monitor.plugin import plugin  # noqa: E402
from train_classifier import Net, Stripes  # noqa: E402

from loongkit_core.context import ActivationContext  # noqa: E402

TARGETS = ("torch.optim.optimizer", "torch.utils.data.dataloader", "torch.autograd", "torch.distributed",
           "torch.nn.parallel.distributed")
SKIP = 3  # first steps not timed (workers starting, first kernels)


class Hooks:
    """The monitor's hooks on and off, as the Runtime would apply and undo them."""

    def __init__(self) -> None:
        self.feature = plugin.feature("monitor")
        self.impl = MonitorFeature(self.feature)
        self.ctx: ActivationContext | None = None

    def on(self) -> None:
        self.ctx = ActivationContext.standalone(self.feature, config=dict(DEFAULTS))
        for target in TARGETS:
            self.impl.activate(self.ctx, target)
        # Steady state: a fresh monitor samples each of its first EARLY_SAMPLES steps (once per run,
        # measured on its own in main()); switched on for one step at a time, it would never leave them.
        monitor = self.impl.monitor
        assert monitor is not None
        monitor.rec.steps = EARLY_SAMPLES

    def off(self) -> None:
        if self.ctx is not None:
            self.impl.deactivate(self.ctx)
            self.ctx = None


def interleaved(hooks: Hooks, steps: int, batch: int, workers: int) -> dict[str, list[float]]:
    """Step times of the example's loop with the hooks off and on, switched between steps (ABBA):
    wall seconds and this thread's CPU seconds, per variant."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    loader = DataLoader(Stripes((steps + SKIP) * batch), batch_size=batch, shuffle=True, num_workers=workers)
    times: dict[str, list[float]] = {"bare": [], "hooked": [], "bare_cpu": [], "hooked_cpu": []}
    hooks.on()  # the workers start with the monitor on: their samplers run for the whole loop
    iterator = iter(loader)
    hooks.off()
    for i in range(steps + SKIP):
        on = i % 4 in (0, 3)
        hooks.on()  # both variants follow an activation (it disturbs the caches a little)
        if not on:
            hooks.off()
        start, cpu = time.perf_counter(), time.thread_time()
        images, labels = next(iterator)
        loss = F.cross_entropy(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
        if on:
            hooks.off()
        if i >= SKIP:
            key = "hooked" if on else "bare"
            times[key].append(seconds)
            times[f"{key}_cpu"].append(cpu)
    del iterator
    return times


def per_step_cost(hooks: Hooks, rounds: int, steps: int) -> tuple[float, float]:
    """The hooks' work per training step (one fetch, one backward, one optimizer step), timed on a
    loop that does nothing else: bare and hooked CPU seconds of this thread per step."""
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.ones(1, 1)
    data = [x] * steps
    bare, hooked = [], []
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            if on:
                hooks.on()
            loss = model(x).sum()
            t0 = time.thread_time()
            for _batch in DataLoader(data, batch_size=None):
                loss.backward(retain_graph=True)
                opt.step()
            seconds = (time.thread_time() - t0) / steps
            (hooked if on else bare).append(seconds)
            if on:
                hooks.off()
    return min(bare), min(hooked)


def main_sample_cost(samples: int) -> float:
    """CPU seconds of one sample of the main process as the monitor takes it (its usage, the job's CPUs'
    busy time, the interpreter's blocks; EARLY_SAMPLES at its start, then one per SAMPLE_INTERVAL)."""
    from loongkit_monitor import procstat

    cpus = procstat.affinity()
    t0 = time.thread_time()
    for _ in range(samples):
        procstat.sample(cpus=cpus)
    return (time.thread_time() - t0) / samples


def scan_cost(scans: int) -> float:
    """CPU seconds of one read of every process's CPU time (twice per run, at the SCAN_AT boundaries)."""
    from loongkit_monitor import procstat

    t0 = time.thread_time()
    for _ in range(scans):
        procstat.processes()
    return (time.thread_time() - t0) / scans


def sampler_cost(directory: str, samples: int) -> float:
    """CPU seconds of one worker sample (its usage, private memory every second time, the report)."""
    sampler = dataworkers.WorkerSampler(directory, main_pid=os.getpid(), worker_id=0)
    t0 = time.thread_time()
    for _ in range(samples):
        sampler.flush()
    return (time.thread_time() - t0) / samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 steps, batch 16 (under a minute)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    steps, batch = (128, 16) if args.quick else (320, args.batch_size)
    channel = tempfile.mkdtemp(prefix="loongkit-bench-monitor-")
    os.environ["_LOONGKIT_ACTIVITY"] = f"{channel}:{os.getpid()}"  # the workers' samplers report here
    torch.set_num_threads(1)  # one compute thread: its CPU time per step is the job's work, steadily
    hooks = Hooks()
    times = interleaved(hooks, steps, batch, args.workers)
    baseline, ours = statistics.median(times["bare_cpu"]), statistics.median(times["hooked_cpu"])
    wall_bare, wall_hooked = statistics.median(times["bare"]), statistics.median(times["hooked"])
    bench_line("monitor_overhead_train_classifier", baseline, ours, ratio_digits=3)
    cost_bare, cost_hooked = per_step_cost(hooks, rounds=8 if args.quick else 16, steps=1000 if args.quick else 3000)
    bench_line("monitor_hooks_per_step", cost_bare, cost_hooked, 7, 3)
    cost = max(0.0, cost_hooked - cost_bare)
    sample = sampler_cost(channel, 50 if args.quick else 200)
    main_sample = main_sample_cost(200)
    scan = scan_cost(20)
    worker_share = sample / dataworkers.INTERVAL
    print(f"monitor hooks: {cost * 1e6:.1f} us CPU per step (the bare loop {cost_bare * 1e6:.1f} us, hooked "
          f"{cost_hooked * 1e6:.1f} us) = {cost / baseline * 100:.3f} % of train_classifier's {baseline * 1000:.1f} ms "
          f"CPU step; a main-process sample {main_sample * 1e6:.0f} us CPU ({EARLY_SAMPLES} at the start, then at "
          f"most {1 / SAMPLE_INTERVAL:g} a second = {main_sample / SAMPLE_INTERVAL * 100:.3f} % of a CPU); a process "
          f"scan {scan * 1e3:.2f} ms CPU ({len(SCAN_AT)} per run); a worker sample {sample * 1e6:.0f} us CPU every "
          f"{dataworkers.INTERVAL:g} s = "
          f"{worker_share * 100:.3f} % of a CPU per worker", flush=True)
    print(f"the example's step with the hooks: CPU {(ours / baseline - 1) * 100:+.2f} %, wall {wall_bare * 1000:.1f} "
          f"-> {wall_hooked * 1000:.1f} ms ({(wall_hooked / wall_bare - 1) * 100:+.1f} %), "
          f"{len(times['bare'])} + {len(times['hooked'])} steps, the shared machine's noise included", flush=True)


if __name__ == "__main__":
    main()
