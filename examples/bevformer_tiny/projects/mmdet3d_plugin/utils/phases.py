"""Where a training step's time goes: backbone, encoder, decoder, loss, optimizer, data wait.

The profiling mode of the example (``train.py --phases``), in the spirit of upstream's ``run_time``
helper, off unless asked (one attribute test per phase when off). Forward time is measured around
each phase; backward time is split at the phase boundaries by gradient hooks on the tensors that
cross them: the backward of everything after a boundary tensor has finished when that tensor's
gradient is complete (the graph is a chain here: loss -> decoder outputs -> BEV features -> image
features -> backbone). On a CPU every operator is synchronous, so wall time is the operator's time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Backward order: loss first; each boundary tensor's gradient completes the phase after it (the
# value) and starts the next one (NEXT).
BOUNDARY = {"decoder_out": "loss", "bev_embed": "decoder", "img_feats": "encoder"}
NEXT = {"decoder_out": "decoder", "bev_embed": "encoder", "img_feats": "backbone"}
COLUMNS = ("backbone", "encoder", "decoder", "loss", "optimizer", "other", "data wait")
MODEL = COLUMNS[:5]


class Phases:
    def __init__(self) -> None:
        self.enabled = False
        self.steps: list[dict[str, float]] = []
        self._step: dict[str, float] = {}
        self._marks: dict[str, float] = {}
        self.current = "other"  # the phase running now (forward and backward): FLOP attribution

    def start_step(self) -> None:
        self._step = {name: 0.0 for name in COLUMNS}
        self._marks = {}

    def end_step(self, data_wait: float, iteration: float) -> None:
        """``iteration``: the step's time from the batch's arrival; what no phase measured is "other"."""
        self._step["data wait"] = data_wait
        self._step["other"] = max(iteration - sum(self._step[c] for c in MODEL), 0.0)
        self.steps.append(self._step)

    @contextmanager
    def forward(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start, outer = time.perf_counter(), self.current
        self.current = name
        try:
            yield
        finally:
            self.current = outer
            self._step[name] = self._step.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        if self.enabled:
            self._step[name] = self._step.get(name, 0.0) + seconds

    def mark(self, boundary: str, tensor: Any) -> None:
        """Record when ``tensor``'s gradient is complete (the end of the backward after it)."""
        if not (self.enabled and getattr(tensor, "requires_grad", False)):
            return

        def hook(grad: Any, boundary: str = boundary) -> None:
            self._marks[boundary] = time.perf_counter()
            self.current = NEXT[boundary]

        tensor.register_hook(hook)

    def backward(self, run: Any) -> None:
        """Run the backward (``run()``) and split its time at the boundaries marked in the forward."""
        start = time.perf_counter()
        self.current = "loss"
        try:
            run()
        finally:
            self.current = "other"
        end = time.perf_counter()
        previous = start
        for boundary, name in BOUNDARY.items():
            stamp = self._marks.get(boundary)
            if stamp is not None:
                self.add(name, stamp - previous)
                previous = stamp
        self.add("backbone", end - previous)

    def table(self, warmup: int) -> str:
        """Median and mean milliseconds per phase over the steps after ``warmup``."""
        steps = self.steps[warmup:] or self.steps
        if not steps:
            return "phases: no steps recorded\n"
        lines = [f"phases over {len(steps)} steps (after {min(warmup, len(self.steps) - len(steps))} warm-up), "
                 "forward + backward per phase, ms", f"{'phase':<12}{'median':>10}{'mean':>10}{'share':>8}"]
        total = sum(sum(s[c] for c in COLUMNS) for s in steps)
        for col in COLUMNS:
            values = [s[col] for s in steps]
            share = sum(values) / total if total else 0.0
            lines.append(f"{col:<12}{statistics.median(values) * 1e3:>10.1f}{statistics.fmean(values) * 1e3:>10.1f}"
                         f"{share:>8.1%}")
        sums = [sum(s[c] for c in COLUMNS) for s in steps]
        lines.append(f"{'step':<12}{statistics.median(sums) * 1e3:>10.1f}{statistics.fmean(sums) * 1e3:>10.1f}")
        return "\n".join(lines) + "\n"

    def as_dict(self, warmup: int) -> dict[str, Any]:
        steps = self.steps[warmup:] or self.steps
        return {"steps": len(steps), "median_ms": {c: statistics.median([s[c] for s in steps]) * 1e3 for c in COLUMNS},
                "mean_ms": {c: statistics.fmean([s[c] for s in steps]) * 1e3 for c in COLUMNS}}


PHASES = Phases()


def _register_hook() -> None:
    """``PhasesHook`` in mmengine's HOOKS: per-step bookkeeping and the table at the end of training."""
    import json
    import os

    from mmengine.hooks import Hook
    from mmengine.registry import HOOKS

    @HOOKS.register_module()
    class PhasesHook(Hook):
        """Turns the phase timers on; prints their table after training (and writes it as JSON to
        ``json_path`` when given). ``warmup`` first steps are left out of the figures."""

        priority = "VERY_LOW"

        def __init__(self, warmup: int = 5, json_path: str | None = None) -> None:
            self.warmup = warmup
            self.json_path = json_path
            self._last = self._start = self._wait = 0.0

        def before_train(self, runner: Any) -> None:
            PHASES.enabled = True
            self._last = time.perf_counter()

        def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
            self._start = time.perf_counter()
            self._wait = self._start - self._last  # waiting for the DataLoader's next batch
            PHASES.start_step()

        def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
            self._last = time.perf_counter()
            PHASES.end_step(self._wait, self._last - self._start)

        def after_train(self, runner: Any) -> None:
            PHASES.enabled = False
            runner.logger.info("\n" + PHASES.table(self.warmup))
            if self.json_path:
                os.makedirs(os.path.dirname(os.path.abspath(self.json_path)), exist_ok=True)
                with open(self.json_path, "w") as f:
                    json.dump(PHASES.as_dict(self.warmup), f, indent=2)


_register_hook()
