"""Overhead of LOONGKIT_MONITOR on a real training job: examples/train_classifier.py, monitor off vs on.

Same process, same model, same data: the job's own loop (the example's Net, Stripes and AdamW, with
its DataLoader workers) runs in blocks of steps, alternately bare and with every monitor hook in
place (optimizer hook, DataLoader timing, backward and collectives timing, the workers' samplers
reporting through an activity channel). Each step is timed by the benchmark itself; the first steps
of a block (worker start-up) are not counted. The hooks' own cost per step is also measured
directly, and set against the example's step.

Prints ``BENCH monitor_overhead_train_classifier baseline=<s> ours=<s> ratio=<baseline/ours>``
(median step time, seconds) and ``BENCH monitor_hooks_per_step ...`` (seconds per step of a loop that
does nothing but one fetch, one backward and one optimizer step, bare and hooked: the hooks' cost
with nothing to hide it), then that cost as a share of the example's step.

    python benchmarks/monitor.py            # 8 rounds of 24 steps
    python benchmarks/monitor.py --quick    # 4 rounds of 6 steps, batch 16: under a minute on a quiet machine
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from loongkit_monitor.feature import MonitorFeature, MonitorOptions  # noqa: E402
from loongkit_monitor.plugin import plugin  # noqa: E402
from train_classifier import Net, Stripes  # noqa: E402

from loongkit_core.context import ActivationContext  # noqa: E402

TARGETS = ("torch.optim.optimizer", "torch.utils.data.dataloader", "torch.autograd", "torch.distributed",
           "torch.nn.parallel.distributed")
SKIP = 2  # steps of each block not timed (its DataLoader workers start)


class Hooks:
    """The monitor's hooks on and off, as the Runtime would apply and undo them."""

    def __init__(self) -> None:
        self.feature = plugin.feature("monitor")
        self.impl = MonitorFeature(self.feature)
        self.ctx: ActivationContext | None = None

    def on(self) -> None:
        self.ctx = ActivationContext.standalone(self.feature, config=MonitorOptions())
        for target in TARGETS:
            self.impl.activate(self.ctx, target)

    def off(self) -> None:
        if self.ctx is not None:
            self.impl.deactivate(self.ctx)
            self.ctx = None


def train_block(model: Any, opt: Any, dataset: Any, steps: int, batch: int, workers: int) -> list[float]:
    times = []
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers)
    start = time.perf_counter()
    for i, (images, labels) in enumerate(loader):
        loss = F.cross_entropy(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        now = time.perf_counter()
        if i >= SKIP:
            times.append(now - start)
        start = now
        if i + 1 >= steps + SKIP:
            break
    return times


def per_step_cost(hooks: Hooks, rounds: int, steps: int) -> tuple[float, float]:
    """The hooks' work per training step (one fetch, one backward, one optimizer step), timed on a
    loop that does nothing else: bare and hooked CPU seconds of this thread per step (CPU time, so that
    the other processes of a shared machine, which preempt it, do not count)."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps (under a minute)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    rounds, steps, batch = (4, 6, 16) if args.quick else (8, 24, args.batch_size)
    torch.manual_seed(0)
    channel = tempfile.mkdtemp(prefix="loongkit-bench-monitor-")
    os.environ["_LOONGKIT_ACTIVITY"] = f"{channel}:{os.getpid()}"  # the workers' samplers report here
    hooks = Hooks()
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    dataset = Stripes((steps + SKIP) * batch)
    train_block(model, opt, dataset, 3, batch, args.workers)  # warm-up: allocator, first kernels
    bare: list[float] = []
    monitored: list[float] = []
    for r in range(rounds):  # alternate the order, so that a drift of the machine hits both
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            if on:
                hooks.on()
                monitored.extend(train_block(model, opt, dataset, steps, batch, args.workers))
                hooks.off()
            else:
                bare.extend(train_block(model, opt, dataset, steps, batch, args.workers))
    baseline, ours = statistics.median(bare), statistics.median(monitored)
    print(f"BENCH monitor_overhead_train_classifier baseline={baseline:.6f} ours={ours:.6f} "
          f"ratio={baseline / ours:.3f}", flush=True)
    cost_bare, cost_hooked = per_step_cost(hooks, rounds=8 if args.quick else 16, steps=1000 if args.quick else 3000)
    print(f"BENCH monitor_hooks_per_step baseline={cost_bare:.7f} ours={cost_hooked:.7f} "
          f"ratio={cost_bare / cost_hooked:.3f}", flush=True)
    cost = max(0.0, cost_hooked - cost_bare)
    print(f"monitor hooks: {cost * 1e6:.1f} us CPU per step (a loop of a fetch, a backward and an optimizer step: "
          f"{cost_bare * 1e6:.1f} us bare, {cost_hooked * 1e6:.1f} us hooked) = {cost / baseline * 100:.3f} % of "
          f"train_classifier's {baseline * 1000:.1f} ms step; end to end {(ours / baseline - 1) * 100:+.1f} % "
          f"({len(bare)} steps each, machine noise included)", flush=True)


if __name__ == "__main__":
    main()
