"""The full boot: settings, logging, plugins, feature resolution, arming, and the Summary at exit.

Only reached when the fast path in :mod:`loongkit_core._boot` found a LOONGKIT_* variable that
requests something. Every step that runs plugin code is isolated: a fault becomes a log line, a
Summary row and a Summary "Plugin faults" line, and the user's program goes on (unless
``LOONGKIT_STRICT=1``).

:class:`Runtime` is one object with one public API, assembled from its jobs, each in its own module:

* :mod:`loongkit_core.resolution`: which features are enabled, applicable, configured, armed;
* :mod:`loongkit_core.replay`: a process reusing its job's resolution (:mod:`loongkit_core.resolved`)
  restores it, and confirms each restored feature before its first activation;
* :mod:`loongkit_core.lifecycle`: exit callbacks, the Summary once, at-exit, SIGTERM, after fork;
* :mod:`loongkit_core.activity_gather`: the activity channel of this main's workers and the node view.

Here: the state they share, faults and warnings, the boot, activation (arm, activate, the watchdog,
deactivate), and the process's one runtime (:func:`start`, :func:`current`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import ModuleType

from loongkit_core import activity, importhooks, log, resolved
from loongkit_core import process as process_mod
from loongkit_core.activity_gather import LAUNCHED_ENV, ActivityGather
from loongkit_core.context import ActivationContext, Environment, NotApplicable
from loongkit_core.feature import FeatureRecord, PolicyDecision, State
from loongkit_core.lifecycle import Lifecycle
from loongkit_core.manager import Fault, LoongkitStrictError, PluginManager
from loongkit_core.replay import Replay
from loongkit_core.resolution import Resolution

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at boot (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["LAUNCHED_ENV", "ActivationTimeout", "LoongkitStrictError", "Runtime", "current", "start"]


class ActivationTimeout(Exception):
    pass


class Runtime(Resolution, Replay, Lifecycle, ActivityGather):
    """One process's loongkit: its settings, plugins and feature records."""

    def __init__(self, environ: Mapping[str, str] | None = None, *, arm: bool = True,
                 process: process_mod.ProcessInfo | None = None, resolution: resolved.Data | None = None) -> None:
        self.environ: Mapping[str, str] = os.environ if environ is None else environ
        # ``resolution``: what a full boot of this job resolved (loongkit_core.resolved); boot() then
        # restores it instead of resolving, and the settings are the ones validated there (no pydantic).
        self.resolution = resolution
        self.settings: Any
        if resolution is not None:
            self.settings, self.settings_warnings = resolved.SettingsSnapshot(resolution["settings"]), []
        else:
            from loongkit_core.settings import CoreSettings, load_settings

            self.settings, self.settings_warnings = load_settings(CoreSettings, environ=environ)
        self.warnings: list[str] = []  # every warning of the boot, in order (``loongkit-run --info`` shows them)
        # The boot's warnings and faults in order, as resolved.capture keeps them for a process that
        # reuses this resolution to replay: ("warning", message, context) or ("fault", fault fields).
        self.boot_events: list[tuple[Any, ...]] = []
        self._unconfirmed: set[str] = set()  # restored armed features whose detect/configure run at activation
        # Called once resolved, before anything is armed (start() writes the resolution there).
        self.after_resolve: Callable[[Runtime], None] | None = None
        self.log_faults = True  # False: a probe (loongkit-run) whose command logs the same faults itself
        self.process = process or process_mod.detect()
        self.manager = PluginManager(on_fault=self._on_fault)
        self.records: dict[str, FeatureRecord] = {}
        self.contexts: dict[str, ActivationContext] = {}
        self.policies: dict[str, PolicyDecision] = {}
        self.env = Environment(self.settings, self.process, environ,
                               hardware_loader=resolved.hardware_loader(resolution) if resolution else None)
        self._arm = arm
        self._summary_done = False
        self._booting = True
        self.destination: log.Destination | None = None
        self._exit_callbacks: list[tuple[FeatureRecord, Callable[[], None], int]] = []
        self.targets_seen: list[str] = []  # feature targets imported in this process (a training job's sign)
        self.channel: activity.MainChannel | None = None  # where this main's workers report
        self._fork_baseline: dict[str, int] = {}  # counts inherited at fork (a worker reports the rest)
        self._reporter: activity.WorkerReporter | None = None
        self.optimizer_stepped = False  # an optimizer step ran in this process (a training job's sign)
        self.node_silent: dict[int, str] = {}  # local rank 0: the node's global ranks that sent no report, and why
        # finish() runs once: a second entry (torchrun's SIGTERM arriving during the exit callbacks, or
        # another thread) must not skip what the first is producing (see finish and _on_sigterm)
        self._finish_lock = threading.RLock()
        self._finishing: int | None = None  # the thread inside finish()
        self._pending_signal: int | None = None  # a signal to die of once finish() is done
        self.log: Any = log.get_logger("loongkit.core")

    # -- faults --------------------------------------------------------------------------------
    def _on_fault(self, fault: Fault) -> None:
        if self._booting:
            self.boot_events.append(("fault", (fault.plugin, fault.where, fault.error, fault.traceback,
                                               fault.feature)))
        if self.log_faults:
            self.log.error("plugin fault", plugin=fault.plugin, where=fault.where, feature=fault.feature,
                           error=fault.error, traceback=fault.traceback)
        if fault.feature and fault.feature in self.records:
            record = self.records[fault.feature]
            record.state = State.FAILED
            record.reason = f"{fault.where}: {fault.error}"
        if self.settings.strict:
            raise LoongkitStrictError(f"loongkit plugin {fault.plugin!r} failed in {fault.where}: {fault.error}")

    # -- boot ----------------------------------------------------------------------------------
    def boot(self, configure_logging: bool = True, logdir: str | None = None) -> Runtime:
        """Load plugins and resolve every feature; ``configure_logging=False`` logs errors to stderr (tests);
        ``logdir`` replaces LOONGKIT_LOGDIR (the CLI keeps its stdout for its own output)."""
        start = time.perf_counter()
        if configure_logging:
            destination = self.destination = log.configure(self.settings.loglevel, logdir or self.settings.logdir,
                                                           self.process)
        else:
            destination = log.configure("error", "stderr", self.process)
        self.log = log.get_logger("loongkit.core")
        self.log.info("loongkit boot", role=self.process.role, argv=list(getattr(sys, "orig_argv", sys.argv)),
                      log=destination.kind, resolution=self.resolution["path"] if self.resolution else None)
        if self.resolution is not None:
            self.restore(self.resolution)
        else:
            for warning in self.settings_warnings:
                self._warn(warning)
            disabled = {p.strip() for p in self.settings.disable_plugins.split(",") if p.strip()}
            self.manager.load_entry_points(disabled)
            for name in self.manager.disabled:
                self.log.info(f"plugin {name} disabled by LOONGKIT_DISABLE_PLUGINS")
            self.declare()
            self.check_references()
            self.check_unknown_variables()
            self.resolve()
        self._booting = False  # what follows (activation) is this process's own, not the resolution's
        if self.after_resolve is not None and self.resolution is None:
            self.after_resolve(self)
        if self._arm:
            importhooks.set_error_handler(self._import_hook_error)
            for record in self.records.values():
                if record.state == State.ARMED:
                    self.arm(record)
        self.log.info("loongkit ready", seconds=round(time.perf_counter() - start, 4),
                      enabled=[r.feature.name for r in self.records.values() if r.enabled])
        return self

    def _warn(self, message: str, **context: Any) -> None:
        self.warnings.append(message)
        if self._booting:
            self.boot_events.append(("warning", message, context))
        self.log.warning(message, **context)

    # -- activation ----------------------------------------------------------------------------
    def context(self, record: FeatureRecord) -> ActivationContext:
        ctx = self.contexts.get(record.feature.name)
        if ctx is None:
            ctx = ActivationContext(record, self.env, log.get_logger(f"loongkit.{record.feature.name}"),
                                    importhooks.when_imported, self._register_exit,
                                    lambda: self.records.values())
            self.contexts[record.feature.name] = ctx
        return ctx

    def arm(self, record: FeatureRecord) -> None:
        if not record.feature.targets:
            self.activate(record, None)
            return
        for target in record.feature.targets:
            importhooks.when_imported(target, _Activation(self, record, target))

    def activate(self, record: FeatureRecord, target: str | None) -> None:
        if record.state == State.FAILED or (record.state == State.NOT_APPLICABLE and not self._in_force(record)):
            return
        if not self._confirm(record):
            return
        ctx = self.context(record)
        start = time.perf_counter()
        if record.state != State.NOT_APPLICABLE:  # what the feature said (ctx.not_applicable) stays
            record.reason = ""  # the hook may set one ("no CUDA device") that the Summary shows
        calls_before = record.calls
        try:
            with _watchdog(self.settings.activation_timeout):
                try:
                    self.manager.call_owner(record.feature.plugin, "loongkit_activate", feature=record.feature,
                                            target=target, ctx=ctx)
                finally:
                    record.activation_calls += record.calls - calls_before
        except NotApplicable as exc:
            ctx.patcher.undo()
            record.state, record.reason = State.NOT_APPLICABLE, str(exc) or "not applicable"
            self.log.log(30 if record.explicit else 20, "feature not applicable", feature=record.feature.name,
                         target=target, reason=record.reason)
            return
        except LoongkitStrictError:
            raise
        except (Exception, ActivationTimeout) as exc:
            try:
                ctx.patcher.undo()
            except Exception:
                pass
            self.manager.fault(record.feature.plugin, "loongkit_activate", exc, record.feature.name)
            return
        if target is not None:
            record.applied_targets.append(target)
        # A feature's state follows its verbs: the runtime only moves ARMED to APPLIED. What the hook said
        # (ctx.not_applicable() for a class a registry watch found already registered, ctx.applied()), or
        # said at an earlier target, stays.
        if record.state == State.ARMED:
            record.state = State.APPLIED
        seconds = round(time.perf_counter() - start, 4)
        if record.state == State.APPLIED:
            self.log.info("feature applied", feature=record.feature.name, target=target, seconds=seconds,
                          patches=len(ctx.patcher))
        else:  # in force (its watch stays), with what it said
            self.log.info("feature activated", feature=record.feature.name, target=target,
                          state=record.state.value, reason=record.reason, seconds=seconds, patches=len(ctx.patcher))

    def _in_force(self, record: FeatureRecord) -> bool:
        """Whether a feature that is NOT_APPLICABLE still has something in force from an earlier activation:
        it said so itself (``ctx.not_applicable``) while a hook of its stays installed (a registry watch that
        may find a class that fits, then says ``ctx.applied()``), so its other targets still activate. Not
        so after resolution, ``raise NotApplicable`` (the runtime undid its patcher) or a fault."""
        ctx = self.contexts.get(record.feature.name)
        return ctx is not None and len(ctx.patcher) > 0

    def deactivate(self, name: str) -> None:
        """Undo a feature's patches (tests and ``unpatch`` symmetry)."""
        record = self.records[name]
        ctx = self.contexts.get(name)
        if ctx is None:
            return
        try:
            self.manager.call_owner(record.feature.plugin, "loongkit_deactivate", feature=record.feature, ctx=ctx)
        finally:
            ctx.patcher.undo()
            record.state, record.reason = State.ARMED, "deactivated"
            record.applied_targets.clear()

    def _import_hook_error(self, module: str, callback: Callable[..., Any], exc: BaseException) -> None:
        feature = getattr(callback, "record", None)
        name = feature.feature.name if isinstance(feature, FeatureRecord) else None
        plugin = feature.feature.plugin if isinstance(feature, FeatureRecord) else "<import hook>"
        self.manager.fault(plugin, f"import hook on {module}", exc, name)

class _Activation:
    """The import-hook callback for one feature and target (keeps the record for fault reports)."""

    def __init__(self, runtime: Runtime, record: FeatureRecord, target: str) -> None:
        self.runtime, self.record, self.target = runtime, record, target

    def __call__(self, module: ModuleType) -> None:
        if self.target not in self.runtime.targets_seen:
            self.runtime.targets_seen.append(self.target)
        self.runtime.activate(self.record, self.target)


class _watchdog:
    """Bound a feature's activation with SIGALRM when that is safe (main thread, timer unused).

    A thread cannot be used: activation runs inside the target's import, holding its module lock.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.armed = False

    def _expired(self, signum: int, frame: Any) -> None:
        raise ActivationTimeout(f"activation exceeded LOONGKIT_ACTIVATION_TIMEOUT={self.seconds:g}s")

    def __enter__(self) -> _watchdog:
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
            try:
                if signal.getsignal(signal.SIGALRM) == signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL)[0] == 0:
                    self.previous = signal.signal(signal.SIGALRM, self._expired)
                    signal.setitimer(signal.ITIMER_REAL, self.seconds)
                    self.armed = True
            except (ValueError, OSError):
                self.armed = False
        return self

    def __exit__(self, *exc: object) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)


_runtime: Runtime | None = None


def current() -> Runtime | None:
    return _runtime


def start() -> Runtime | None:
    """Boot once per process (idempotent); never raises unless LOONGKIT_STRICT=1.

    The job's resolution is reused when there is one for this process (loongkit_core.resolved): its
    DataLoader workers, ranks and re-runs then boot without resolving; a full boot writes one."""
    global _runtime
    if _runtime is not None:
        return _runtime
    process = process_mod.detect()
    if process.role in (process_mod.LAUNCHER, process_mod.HELPER):
        # torchrun's agent and helper processes train nothing; binding or patching them would
        # leak into every rank they start.
        runtime = _runtime = Runtime(process=process)
        runtime.records = {}
        return runtime
    reuse = resolved.wanted(os.environ)
    modules = set(sys.modules)
    key = resolved.material(os.environ, process) if reuse else {}
    data = None
    if reuse:
        try:
            data = resolved.load(os.environ, process, key)
        except Exception:  # an unreadable resolution is no resolution
            data = None
    runtime = _runtime = Runtime(process=process, resolution=data)
    written: list[resolved.Data] = []
    if reuse and data is None:
        real = runtime.env.environ
        recorder = runtime.env.environ = resolved.RecordingEnviron(real)

        def keep(rt: Runtime) -> None:  # resolved, nothing armed yet: what the job's other processes reuse
            rt.env.environ = real
            try:
                stored = resolved.store(rt, key, recorder.reads, iter(set(sys.modules) - modules))
            except Exception as exc:  # never the user's problem; the next process resolves in full
                rt.log.info("cannot write the resolution for this job's other processes", error=repr(exc))
                return
            if stored is not None:
                written.append(stored)

        runtime.after_resolve = keep
    try:
        runtime.boot()
    except LoongkitStrictError:
        raise
    except Exception as exc:
        runtime.manager.fault("<core>", "boot", exc)
    used = data if data is not None else (written[0] if written else None)
    if used is not None and process.role != process_mod.WORKER:
        os.environ[resolved.ENV] = resolved.handoff(used)  # this process's DataLoader workers start from it
    runtime.install_exit_handlers()
    return runtime
