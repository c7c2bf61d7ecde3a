"""LOONGKIT_MONITOR: find the training steps with no code change, measure them, report at exit.

Where it hooks (each on its target's import, undone by ``ctx.patcher``):

* ``torch.optim.optimizer``: a global optimizer-step post hook (every ``torch.optim.Optimizer``
  subclass, fused and foreach ones, registry-built ones: torch wraps each class's ``step`` and calls
  the global hooks). The first optimizer that steps marks the steps; another one takes over only
  when it steps three times while the first does not (a replaced optimizer, not a GAN's second).
* ``mmengine.runner`` / ``mmcv.runner`` (1.x): the runner's ``call_hook``. ``after_train_iter``
  marks the step (an mmengine/mmcv iteration, also with gradient accumulation), and the optimizer
  hook stands down; ``before/after_val_epoch`` and ``..._test_epoch`` pause the clock, so validation
  inside training belongs to no step. ``transformers.trainer``: ``Trainer.evaluate`` pauses too
  (HF Trainer and Accelerate steps are optimizer steps).
* ``torch.utils.data.dataloader``: ``_BaseDataLoaderIter.__next__`` and ``DataLoader.__iter__``
  time the main process's wait for data; the workers report their own use (``dataworkers``).
* ``torch.autograd``, ``torch.distributed``, ``torch.nn.parallel.distributed``: time spent in
  backward, in the blocking collectives the job calls and in DDP's buffer broadcast (synchronising
  calls: what a rank waiting for a straggler waits in).

Level 1, observe-only: nothing the job computes changes. ``LOONGKIT_MONITOR_MAX_STEPS=N`` ends the
job after step N with ``SystemExit(0)`` (atexit handlers and the Summary run).
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from loongkit_core.context import ActivationContext, Environment, NotApplicable
from loongkit_core.feature import FeatureRef
from loongkit_core.kit import FeatureImpl
from loongkit_monitor import analysis, dataworkers, gather, procstat
from loongkit_monitor.recorder import StepRecorder

OPTIMIZER = "torch.optim.optimizer"
DATALOADER = "torch.utils.data.dataloader"
AUTOGRAD = "torch.autograd"
DISTRIBUTED = "torch.distributed"
DDP = "torch.nn.parallel.distributed"
MMENGINE = "mmengine.runner"
MMCV = "mmcv.runner"
TRANSFORMERS = "transformers.trainer"
TARGETS = (OPTIMIZER, DATALOADER, AUTOGRAD, DISTRIBUTED, DDP, MMENGINE, MMCV, TRANSFORMERS)

# torch.distributed functions a rank blocks in while it waits for the others (the job calls them)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "gather_object", "scatter", "all_to_all", "all_to_all_single")
LOOP_STEP_START = "before_train_iter"
LOOP_STEP_END = "after_train_iter"
PAUSE = frozenset({"before_val_epoch", "before_test_epoch"})
RESUME = frozenset({"after_val_epoch", "after_test_epoch"})
WATCHED = frozenset({LOOP_STEP_START, LOOP_STEP_END}) | PAUSE | RESUME

SAMPLE_INTERVAL = 0.25  # seconds between the main process's usage samples (at step boundaries)
EARLY_SAMPLES = 12  # every one of the first boundaries is sampled (the warm-up ends among them)
MAX_SAMPLES = 4096
SCAN_AT = (2, EARLY_SAMPLES)  # boundaries at which every process's CPU time is read (before the warm steps)
SWITCH_AFTER = 3  # steps of another optimizer, with none of the first, before it marks the steps


DEFAULTS: dict[str, float | int] = {"interval": 0.0, "max_steps": 0}  # what the options model defaults to


def option(config: Any, name: str) -> Any:
    """An option from the validated model (``loongkit_monitor.options``) or the defaults dict."""
    if isinstance(config, Mapping):
        return config.get(name, DEFAULTS[name])
    return getattr(config, name, DEFAULTS[name])


class Monitor:
    """One process's monitor: the hooks' state and its report at exit."""

    def __init__(self, ctx: ActivationContext, options: Any, process: Any,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.ctx = ctx
        self.process = process
        self.interval = float(option(options, "interval"))
        self.max_steps = int(option(options, "max_steps"))
        self.rec = StepRecorder(clock)
        self.live = False  # switched on through ctx.patcher.assign: the default deactivate switches it off
        self.source = ""  # what marks the steps
        self.loop = ""  # set once a training loop marks them
        self.optimizer_id: int | None = None
        self.others = 0
        self.samples: list[tuple[int, procstat.Usage]] = []
        self.cpus = procstat.affinity()  # the CPUs whose busy time is sampled (who else runs there)
        self.scans: list[tuple[float, dict[int, procstat.ProcessCpu]]] = []  # every process, twice early on
        self.next_sample = 0.0
        self.next_progress = clock() + self.interval if self.interval else float("inf")
        self.progress_from = 0  # index into rec.walls of the first step since the last progress line
        self.progress_steps = 0
        self.gpu: Any = None
        self.gpu_checked = False
        self.distributed = False
        self.stopped = False
        self.sync_depth = 0
        self.sampler: dataworkers.WorkerSampler | None = None
        self.hooks: dict[str, str] = {}  # what each target got, or why not
        self.notes: list[str] = []
        self.gatherer: gather.Gatherer | None = None
        self.report: dict[str, Any] | None = None

    # -- step boundaries -----------------------------------------------------------------------
    def boundary(self) -> None:
        rec = self.rec
        now = rec.clock()
        rec.step(now)
        self.ctx.count()
        if now >= self.next_sample or rec.steps <= EARLY_SAMPLES:
            self.sample(now)
        if now >= self.next_progress:
            self.progress(now)

    def optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.loop or not self.live:
            return
        key = id(optimizer)
        if key != self.optimizer_id:
            if self.optimizer_id is not None:
                self.others += 1
                if self.others < SWITCH_AFTER:
                    return
                self.notes.append(f"steps marked by {type(optimizer).__name__}.step from step {self.rec.steps + 1}")
            self.optimizer_id = key
            self.source = f"optimizer {type(optimizer).__name__}.step"
        self.others = 0
        self.boundary()
        if self.limit_reached():
            self.stop()

    def loop_iteration(self, label: str, start: bool = True) -> None:
        """A training loop's iteration begins (``start``) or ends: from now on the loop marks the steps."""
        if not self.live:
            return
        if not self.loop:
            self.loop = label
            self.source = f"{label} iterations"
        if start:
            self.rec.start()

    def limit_reached(self) -> bool:
        return bool(self.max_steps) and self.rec.steps >= self.max_steps and not self.stopped

    def stop(self) -> None:
        self.stopped = True
        self.ctx.log.info("LOONGKIT_MONITOR_MAX_STEPS reached: ending the job", steps=self.rec.steps)
        raise SystemExit(0)

    # -- samples and progress ------------------------------------------------------------------
    def sample(self, now: float) -> None:
        self.next_sample = now + SAMPLE_INTERVAL
        try:
            self.samples.append((self.rec.steps, procstat.sample(cpus=self.cpus)))
            if self.rec.steps in SCAN_AT:
                self.scans.append((time.time(), procstat.processes()))
            if len(self.samples) > MAX_SAMPLES:  # keep the early ones (warm-up ends there), thin the rest
                self.samples = self.samples[:EARLY_SAMPLES] + self.samples[EARLY_SAMPLES::2]
            if not self.gpu_checked:
                self._check_gpu()
            if self.gpu is not None:
                self.gpu.events.poll()
                if self.gpu.nvml is not None:
                    self.gpu.nvml.sample(self.rec.steps - 1)
            if not self.distributed:
                self._check_distributed()
        except Exception as exc:  # a sample is never worth the step
            self.notes.append(f"sampling failed: {exc!r}")
            self.next_sample = float("inf")

    def _check_gpu(self) -> None:
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_initialized():
            return
        self.gpu_checked = True
        from loongkit_monitor import gpu

        self.gpu = gpu.GpuMonitor(cuda, cuda.current_device(), gpu.load_nvml())

    def _check_distributed(self) -> None:
        dist = sys.modules.get("torch.distributed")
        try:
            if dist is None or not dist.is_available() or not dist.is_initialized():
                return
            if dist.get_world_size() <= 1:
                return
        except Exception:
            return
        self.distributed = True
        if self.gatherer is not None:
            self.gatherer.capture_store()

    def progress(self, now: float) -> None:
        self.next_progress = now + self.interval
        rec = self.rec
        walls = rec.walls[self.progress_from:]
        waits = rec.waits[self.progress_from:]
        steps = rec.steps - self.progress_steps
        self.progress_from, self.progress_steps = len(rec.walls), rec.steps
        if not walls:
            return
        median = statistics.median(walls)
        share = sum(waits) / sum(walls) if sum(walls) > 0 else 0.0
        rss = self.samples[-1][1].rss if self.samples else procstat.rss_bytes()
        line = (f"[loongkit monitor] step {rec.steps} | {analysis.ms(median)} per step (median of the last "
                f"{steps}) | data wait {analysis.pct(share)} | {steps / max(1e-9, sum(walls)):.1f} steps/s | "
                f"RSS {analysis.mib(rss)}")
        from loongkit_core import log

        log.write_block(line)  # the log, whatever its level: the user asked for these lines
        to_stdout = _log_kind() != "stdout"  # else write_block already printed it
        if to_stdout and _role(self.process) == "main" and getattr(self.process, "local_rank", None) in (None, 0):
            try:
                print(line, flush=True)
            except (OSError, ValueError):
                pass

    # -- DataLoader workers --------------------------------------------------------------------
    def worker_started(self, worker_id: int) -> None:
        if not self.live or self.sampler is not None:
            return
        from loongkit_core import activity

        handoff = activity.job_directory()
        if handoff is None:
            return
        self.sampler = dataworkers.WorkerSampler(handoff[0], handoff[1], worker_id)
        self.sampler.start()

    def worker_stopping(self, worker_id: int) -> None:
        sampler, self.sampler = self.sampler, None
        if sampler is not None:
            sampler.stop()

    # -- the report ----------------------------------------------------------------------------
    def finish(self) -> None:
        """At exit: this rank's figures, the other ranks' (rank 0), recommendations, into the record."""
        if not self.live:
            return
        from loongkit_monitor import report

        self.report = report.build(self)
        self.ctx.detail("monitor", self.report)
        if not self.report["steps"]:
            self.ctx.waiting("no steps seen (no optimizer step, mmengine or mmcv training iteration)")


def feature_views(records: Any) -> dict[FeatureRef, Any]:
    """The loongkit features a recommendation may name (checked handles): enabled? relevant here?"""
    from loongkit_core import requirements
    from loongkit_monitor.advice import FeatureView
    from loongkit_monitor.plugin import RECOMMENDABLE

    records = list(records)
    views: dict[FeatureRef, Any] = {}
    for ref in RECOMMENDABLE:
        record = ref.find(records)
        if record is None:
            continue
        feature = record.feature
        relevant = (requirements.check_all(feature.requires) is None
                    and (not feature.targets or any(t in sys.modules for t in feature.targets)))
        config = getattr(record, "config", None)
        config = config if isinstance(config, Mapping) else {}
        views[ref] = FeatureView(feature.env, bool(record.enabled), relevant, dict(config))
    return views


class MonitorFeature(FeatureImpl):
    # Validated (a warning for a bad value) only when a LOONGKIT_MONITOR_* variable is set; else DEFAULTS.
    lazy_options = "loongkit_monitor.options:MonitorOptions"
    options_unset = DEFAULTS

    def __init__(self, feature: Any) -> None:
        super().__init__(feature)
        self.monitor: Monitor | None = None

    def detect(self, env: Environment) -> str | None:
        if not sys.platform.startswith("linux"):
            return f"needs Linux (/proc, getrusage); this is {sys.platform}"
        return None

    # -- activation, one target at a time ------------------------------------------------------
    def _monitor(self, ctx: ActivationContext) -> Monitor:
        if self.monitor is None or not self.monitor.live:
            options = ctx.config if ctx.config is not None else dict(DEFAULTS)
            process = ctx.env.process if ctx.env is not None else _process()
            monitor = Monitor(ctx, options, process)
            ctx.patcher.assign(monitor, "live", True)
            self.monitor = monitor
            if _role(process) != "worker":
                if _role(process) == "main":  # a rank; a subprocess it starts inherits its rank variables
                    rank, local = process.rank or 0, process.local_rank or 0
                    from loongkit_core import activity

                    handoff = activity.job_directory()
                    monitor.gatherer = gather.Gatherer(handoff[0] if handoff else None, rank, local,
                                                       process.world_size or 1, process.local_world_size or 1)
                ctx.at_exit(monitor.finish)
            ctx.waiting("no steps seen yet")
        return self.monitor

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        monitor = self._monitor(ctx)
        module = sys.modules.get(target or "")
        if target == DATALOADER:
            self._hook_dataloader(ctx, monitor, module)  # in workers too: their reports start there
            return
        if _role(monitor.process) == "worker" or module is None:
            return
        hooks: dict[str, Callable[[ActivationContext, Monitor, Any], str]] = {
            OPTIMIZER: self._hook_optimizer, AUTOGRAD: self._hook_autograd, DISTRIBUTED: self._hook_collectives,
            DDP: self._hook_ddp, MMENGINE: self._hook_mmengine, MMCV: self._hook_mmcv,
            TRANSFORMERS: self._hook_transformers}
        hook = hooks.get(target or "")
        if hook is None:
            return
        try:
            monitor.hooks[target or ""] = hook(ctx, monitor, module)
        except NotApplicable:
            raise
        except (AttributeError, TypeError) as exc:  # an interface that differs: that source is lost only
            monitor.hooks[target or ""] = f"not hooked: {exc}"
            ctx.log.warning("monitor cannot hook this module; its steps are not seen", target=target, error=str(exc))
        ctx.detail("hooks", dict(monitor.hooks))

    @staticmethod
    def _hook_optimizer(ctx: ActivationContext, monitor: Monitor, module: Any) -> str:
        register = getattr(module, "register_optimizer_step_post_hook", None)
        if register is None:
            raise NotApplicable(f"{OPTIMIZER} has no register_optimizer_step_post_hook (torch < 2.0?)")
        handle = register(monitor.optimizer_stepped)
        ctx.patcher.defer(handle.remove)
        return "global optimizer step post hook"

    @staticmethod
    def _hook_dataloader(ctx: ActivationContext, monitor: Monitor, module: Any) -> None:
        ctx.on_worker_start(monitor.worker_started)  # both unregistered by the default deactivate
        ctx.on_worker_exit(monitor.worker_stopping)
        if _role(monitor.process) == "worker":
            return
        base = getattr(module, "_BaseDataLoaderIter", None)
        loader = getattr(module, "DataLoader", None)
        if base is None or loader is None or "__next__" not in vars(base) or "__iter__" not in vars(loader):
            monitor.hooks[DATALOADER] = "not hooked: no _BaseDataLoaderIter.__next__ / DataLoader.__iter__"
            ctx.log.warning("monitor cannot time the DataLoader: its interface differs", target=DATALOADER)
            ctx.detail("hooks", dict(monitor.hooks))
            return
        rec = monitor.rec
        clock = time.perf_counter
        original_next = base.__next__
        original_iter = loader.__iter__

        def __next__(it: Any) -> Any:
            first = getattr(it, "_num_yielded", 1) == 0
            gpu = monitor.gpu if rec.paused_at is None else None  # a paused wait belongs to no step
            if gpu is not None:
                gpu.events.wait_started()
            t0 = clock()
            try:
                return original_next(it)
            finally:
                t1 = clock()
                if gpu is not None:
                    gpu.events.wait_ended(rec.steps)
                rec.waited(it, t0, t1, first)

        def __iter__(self: Any) -> Any:
            t0 = clock()
            iterator = None
            try:
                iterator = original_iter(self)
                return iterator
            finally:
                rec.iterated(self, clock() - t0, iterator)

        ctx.patcher.patch(base, "__next__", functools.wraps(original_next)(__next__))
        ctx.patcher.patch(loader, "__iter__", functools.wraps(original_iter)(__iter__))
        monitor.hooks[DATALOADER] = "DataLoader iterator timed"
        ctx.detail("hooks", dict(monitor.hooks))

    @staticmethod
    def _timed(monitor: Monitor, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its time counted as synchronisation (outermost call only)."""
        rec = monitor.rec
        clock = time.perf_counter

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if monitor.sync_depth:
                return fn(*args, **kwargs)
            monitor.sync_depth = 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                monitor.sync_depth = 0
                rec.synced(clock() - t0)

        timed.__loongkit_original__ = fn  # type: ignore[attr-defined]
        return timed

    def _hook_autograd(self, ctx: ActivationContext, monitor: Monitor, module: Any) -> str:
        ctx.patcher.patch(module, "backward", self._timed(monitor, module.backward))
        return "torch.autograd.backward timed"

    def _hook_collectives(self, ctx: ActivationContext, monitor: Monitor, module: Any) -> str:
        done = [name for name in COLLECTIVES if callable(getattr(module, name, None))]
        for name in done:
            ctx.patcher.patch(module, name, self._timed(monitor, getattr(module, name)))
        return f"{len(done)} collectives timed"

    def _hook_ddp(self, ctx: ActivationContext, monitor: Monitor, module: Any) -> str:
        ddp = module.DistributedDataParallel
        if "_sync_buffers" not in vars(ddp):
            return "not hooked: DistributedDataParallel has no _sync_buffers"
        ctx.patcher.patch(ddp, "_sync_buffers", self._timed(monitor, ddp._sync_buffers))
        return "DistributedDataParallel._sync_buffers timed"

    @staticmethod
    def _hook_runner(ctx: ActivationContext, monitor: Monitor, cls: Any, label: str) -> None:
        original = cls.__dict__["call_hook"]
        if not callable(original):
            raise TypeError(f"{cls.__qualname__}.call_hook is not callable")

        @functools.wraps(original)
        def call_hook(runner: Any, fn_name: str, *args: Any, **kwargs: Any) -> Any:
            if fn_name not in WATCHED:
                return original(runner, fn_name, *args, **kwargs)
            if fn_name == LOOP_STEP_START:
                monitor.loop_iteration(label)
            elif fn_name == LOOP_STEP_END and monitor.live:
                monitor.loop_iteration(label, start=False)
                monitor.boundary()
            elif fn_name in PAUSE:
                monitor.rec.pause()
            try:
                return original(runner, fn_name, *args, **kwargs)
            finally:
                if fn_name in RESUME:
                    monitor.rec.resume()
                elif fn_name == LOOP_STEP_END and monitor.limit_reached():
                    monitor.stop()  # after the iteration's hooks (logging, checkpoints) ran

        ctx.patcher.patch(cls, "call_hook", call_hook)

    def _hook_mmengine(self, ctx: ActivationContext, monitor: Monitor, module: Any) -> str:
        runner = module.Runner  # AttributeError: the interface differs
        if "call_hook" not in vars(runner):
            raise AttributeError("mmengine.runner.Runner has no call_hook")
        self._hook_runner(ctx, monitor, runner, "mmengine")
        hooked = ["Runner"]
        flexible = getattr(module, "FlexibleRunner", None)
        if flexible is not None and "call_hook" in vars(flexible):
            self._hook_runner(ctx, monitor, flexible, "mmengine")
            hooked.append("FlexibleRunner")
        return f"{'/'.join(hooked)}.call_hook (train iterations, validation paused)"

    def _hook_mmcv(self, ctx: ActivationContext, monitor: Monitor, module: Any) -> str:
        base = module.BaseRunner  # mmcv 1.x only; mmcv 2.x has no mmcv.runner
        if "call_hook" not in vars(base):
            raise AttributeError("mmcv.runner.BaseRunner has no call_hook")
        self._hook_runner(ctx, monitor, base, "mmcv runner")
        return "BaseRunner.call_hook (train iterations, validation paused)"

    @staticmethod
    def _hook_transformers(ctx: ActivationContext, monitor: Monitor, module: Any) -> str:
        trainer = module.Trainer
        original = trainer.evaluate

        @functools.wraps(original)
        def evaluate(self: Any, *args: Any, **kwargs: Any) -> Any:
            monitor.rec.pause()
            try:
                return original(self, *args, **kwargs)
            finally:
                monitor.rec.resume()

        ctx.patcher.patch(trainer, "evaluate", evaluate)
        return "Trainer.evaluate paused (steps are its optimizer steps)"


def _process() -> Any:
    from loongkit_core import process

    return process.detect()


def _log_kind() -> str | None:
    from loongkit_core import log

    return log.destination_kind()


def _role(process: Any) -> str:
    return str(getattr(process, "role", "main"))
