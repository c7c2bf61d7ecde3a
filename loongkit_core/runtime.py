"""The full boot: settings, logging, plugins, feature resolution, arming, and the Summary at exit.

Only reached when the fast path in :mod:`loongkit_core._boot` found a LOONGKIT_* variable that
requests something. Every step that runs plugin code is isolated: a fault becomes a log line, a
Summary row and a Summary "Plugin faults" line, and the user's program goes on (unless
``LOONGKIT_STRICT=1``).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import ModuleType

from loongkit_core import activity, importhooks, log, requirements, resolved
from loongkit_core import process as process_mod
from loongkit_core._boot import CORE_VARIABLES, bool_or_none, is_unset
from loongkit_core.context import ActivationContext, Environment, NotApplicable
from loongkit_core.feature import Feature, FeatureRecord, PolicyDecision, State
from loongkit_core.manager import Fault, PluginManager

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~5 ms in every booting process)
if TYPE_CHECKING:
    from typing import Any

# Set by ``loongkit-run`` to its own pid, which the command it execs keeps: "this is the command the user
# put loongkit in front of" (its children and a script's inner Pythons have other pids).
LAUNCHED_ENV = "_LOONGKIT_LAUNCHED"


class LoongkitStrictError(RuntimeError):
    """A plugin or feature fault under ``LOONGKIT_STRICT=1``."""


class ActivationTimeout(Exception):
    pass


class Runtime:
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

    def restore(self, data: resolved.Data) -> None:
        """What the full boot that wrote ``data`` resolved, replayed here: its entry points (plugins load
        on demand), records, policies, and its warnings and faults in their order (logged again; under
        LOONGKIT_STRICT=1 the first fault raises, as it did there)."""
        self.manager.restore(data["entry_points"], data["disabled"], data["disabled_unmatched"], data["installed"])
        for name in self.manager.disabled:
            self.log.info(f"plugin {name} disabled by LOONGKIT_DISABLE_PLUGINS")
        self.records = resolved.records(data)
        self.policies = resolved.policies(data)
        for event in data["events"]:
            if event[0] == "warning":
                self._warn(event[1], **event[2])
            else:
                fault = resolved.fault(event[1])
                self.manager.faults.append(fault)
                self._on_fault(fault)
        for record in self.records.values():
            if record.reason.startswith("off by hardware policy: "):
                self.log.info("feature off by hardware policy", feature=record.feature.name, policy=record.policy)
        self._log_resolved()
        self._unconfirmed = {name for name, r in self.records.items() if r.state == State.ARMED}

    def _confirm(self, record: FeatureRecord) -> bool:
        """Before the first activation of a feature restored from a resolution: load its plugin, then run
        its ``detect`` and ``configure`` here (implementations keep what these find for ``activate``).
        False when it does not apply after all (or its plugin fails): the record says why."""
        name = record.feature.name
        if name not in self._unconfirmed:
            return True
        self._unconfirmed.discard(name)
        if not self.manager.ensure(record.feature.plugin):
            if record.state != State.FAILED:
                record.state, record.reason = State.FAILED, f"plugin {record.feature.plugin} did not load"
            return False
        reason = self._owner_call(record, "loongkit_detect", feature=record.feature, env=self.env)
        if record.state == State.FAILED:
            return False
        if reason:
            record.state, record.reason = State.NOT_APPLICABLE, str(reason)
            self.log.log(30 if record.explicit else 20, "feature not applicable", feature=name, reason=record.reason)
            return False
        result = self._owner_call(record, "loongkit_configure", feature=record.feature, env=self.env,
                                  policy=self.policies.get(name))
        if record.state == State.FAILED:
            return False
        if result is not None:
            config, warnings = result
            record.config = config
            for warning in warnings:  # the resolution's own were replayed at boot
                if warning not in self.warnings:
                    self._warn(warning, feature=name)
        return True

    def declare(self) -> None:
        """Collect every plugin's features; a name declared twice keeps the first plugin's (by name)."""
        order = {name: i for i, name in enumerate(self.manager.plugins)}
        declared = self.manager.call_each("loongkit_declare_features")
        for plugin, features in sorted(declared, key=lambda item: order.get(item[0], len(order))):
            loaded = self.manager.plugins.get(plugin)
            for feature in features:
                if not isinstance(feature, Feature):
                    self.manager.fault(plugin, "loongkit_declare_features",
                                       TypeError(f"declared {feature!r}, not a Feature"))
                    continue
                if feature.name in self.records:
                    other = self.records[feature.name].feature.plugin
                    self.manager.fault(plugin, "loongkit_declare_features", ValueError(
                        f"feature {feature.name!r} is already declared by plugin {other!r}; ignored"))
                    continue
                feature = _with_plugin(feature, plugin, loaded.version if loaded else "")
                self.records[feature.name] = FeatureRecord(feature)

    def known_variables(self) -> set[str]:
        known = set(CORE_VARIABLES)
        for record in self.records.values():
            known.add(record.feature.env)
            known.update(record.feature.options)
        return known

    def unread_variables(self) -> list[str]:
        """LOONGKIT_* variables set (not empty) that neither the core nor a loaded plugin reads."""
        known = self.known_variables()
        return [name for name in sorted(self.environ)
                if name.startswith("LOONGKIT_") and name not in known and not is_unset(self.environ[name])]

    def disabled_plugins_note(self) -> str:
        return "; ".join(f"plugin {name} disabled by LOONGKIT_DISABLE_PLUGINS" for name in self.manager.disabled)

    def check_unknown_variables(self) -> list[str]:
        """A LOONGKIT_* variable nobody reads gets a did-you-mean warning. With a plugin disabled, its
        variables cannot be told from typos (entry-point metadata does not list them, and a disabled
        plugin is not imported), so they are named as read by no loaded plugin, with no guess."""
        known = sorted(self.known_variables())
        unread = self.unread_variables()
        warnings = []
        if self.manager.disabled:
            if unread:
                warnings.append(f"read by no loaded plugin: {', '.join(unread)} ({self.disabled_plugins_note()})")
        elif unread:
            import difflib

            for name in unread:
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
                hint = f"; did you mean {close[0]}?" if close else ""
                warnings.append(f"unknown variable {name}{hint}")
        for name in self.manager.disabled_unmatched:
            warnings.append(f"LOONGKIT_DISABLE_PLUGINS names {name}: no such plugin "
                            f"(installed: {', '.join(self.manager.installed) or 'none'})")
        for warning in warnings:
            self._warn(warning)
        return warnings

    def _warn(self, message: str, **context: Any) -> None:
        self.warnings.append(message)
        if self._booting:
            self.boot_events.append(("warning", message, context))
        self.log.warning(message, **context)

    def resolve(self) -> None:
        """Decide for every feature: enabled? applicable? configured? then armed."""
        features = [r.feature for r in self.records.values()]
        if any(self._requested(r.feature) for r in self.records.values()):
            for plugin, decisions in self.manager.call_each(
                "loongkit_hardware_policy", hardware=_LazyHardware(self.env), features=features
            ):
                for name, decision in dict(decisions).items():
                    if isinstance(decision, PolicyDecision):
                        self.policies[name] = decision
                    else:
                        self.manager.fault(plugin, "loongkit_hardware_policy",
                                           TypeError(f"policy for {name!r} is not a PolicyDecision"))
        for record in self.records.values():
            self._resolve_enabled(record)
        for record in self.records.values():
            if record.enabled and record.state == State.DISABLED:
                self._resolve_applicable(record)
        for record in self.records.values():  # switched off by another applicable feature (seed: SUBCGROUPS)
            if record.state != State.ARMED:
                continue
            for other in record.feature.disables:
                target = self.records.get(other)
                if target is not None and target.enabled and target.state != State.NOT_IMPLEMENTED:
                    target.state = State.NOT_APPLICABLE
                    target.reason = f"switched off by {record.feature.env}"
        for record in self.records.values():
            if record.state == State.ARMED:
                missing = [d for d in record.feature.depends_on
                           if d not in self.records or self.records[d].state not in (State.ARMED, State.APPLIED)]
                if missing:
                    needs = ", ".join(self.records[d].feature.env if d in self.records else d for d in missing)
                    record.state = State.NOT_APPLICABLE
                    record.reason = f"needs {needs} enabled and applicable"
        self._log_resolved()

    def _log_resolved(self) -> None:
        for record in self.records.values():
            if record.enabled:
                self.log.log(
                    30 if record.explicit and record.state in (State.NOT_APPLICABLE, State.FAILED) else 20,
                    "feature resolved", feature=record.feature.name, state=record.state.value,
                    explicit=record.explicit, reason=record.reason or None)

    def _requested(self, feature: Feature) -> bool:
        value, _ = bool_or_none(self.environ.get(feature.env))
        return bool(value) or (value is None and self.settings.all >= feature.level)

    def _resolve_enabled(self, record: FeatureRecord) -> None:
        feature = record.feature
        value, invalid = bool_or_none(self.environ.get(feature.env))
        if invalid:
            self._warn(f"{feature.env}={self.environ.get(feature.env)!r} is invalid "
                       "(not one of 1/on/yes/0/off/no); using the default (unset)")
        policy = self.policies.get(feature.name)
        if policy is not None:
            record.policy = policy.reason
        if value is True:
            record.enabled, record.explicit = True, True
        elif value is False:
            record.enabled = False
        elif self.settings.all >= feature.level:
            if policy is not None and policy.enabled_by_default is False:
                record.enabled = False
                record.reason = f"off by hardware policy: {policy.reason}"
                self.log.info("feature off by hardware policy", feature=feature.name, policy=policy.reason)
            else:
                record.enabled = True
        record.state = State.DISABLED

    def _resolve_applicable(self, record: FeatureRecord) -> None:
        feature = record.feature
        if not feature.implemented:
            record.state, record.reason = State.NOT_IMPLEMENTED, "declared by its plugin, not built yet"
            return
        reason = requirements.check_all(feature.requires)
        if reason is None:
            reason = self._owner_call(record, "loongkit_detect", feature=feature, env=self.env)
            if record.state == State.FAILED:
                return
        if reason:
            record.state, record.reason = State.NOT_APPLICABLE, str(reason)
            return
        result = self._owner_call(record, "loongkit_configure", feature=feature, env=self.env,
                                  policy=self.policies.get(feature.name))
        if record.state == State.FAILED:
            return
        if result is not None:
            config, warnings = result
            record.config = config
            for warning in warnings:
                self._warn(warning, feature=feature.name)
        record.state = State.ARMED

    def _owner_call(self, record: FeatureRecord, hook: str, **kwargs: Any) -> Any:
        try:
            return self.manager.call_owner(record.feature.plugin, hook, **kwargs)
        except LoongkitStrictError:
            raise
        except Exception as exc:
            self.manager.fault(record.feature.plugin, hook, exc, record.feature.name)
            return None

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

    def _register_exit(self, record: FeatureRecord, callback: Callable[[], None]) -> None:
        self._exit_callbacks.append((record, callback, os.getpid()))

    def run_exit_callbacks(self) -> None:
        """Features' clean-up, newest first, in the process that registered each; isolated."""
        while self._exit_callbacks:
            record, callback, pid = self._exit_callbacks.pop()
            if pid != os.getpid():
                continue
            try:
                callback()
            except Exception as exc:
                try:
                    self.manager.fault(record.feature.plugin, "exit callback", exc, record.feature.name)
                except LoongkitStrictError:
                    pass  # too late to fail the run; it is in the log and the Summary

    # -- summary -------------------------------------------------------------------------------
    def summary_text(self, extra: list[str] | None = None, full: bool = False) -> str:
        """The Summary as printed on stdout (lines within summary.LINE_WIDTH), or ``full``: nothing
        shortened, for a log file."""
        extra = self.summary_extra() if extra is None else extra
        from loongkit_core import summary as summary_mod  # at exit only (workers never render one)

        return summary_mod.render(list(self.records.values()), self.manager.faults, extra, log.log_path(),
                                  line_width=None if full else summary_mod.LINE_WIDTH)

    def summary_extra(self) -> list[str]:
        """The lines under the table: hardware-policy notes, disabled plugins, plugins' own sections."""
        extra: list[str] = []
        policy_off: dict[str, list[str]] = {}
        for record in self.records.values():
            if not record.enabled and record.reason.startswith("off by hardware policy: "):
                policy_off.setdefault(record.reason.split(": ", 1)[1], []).append(record.feature.name)
        for reason, names in policy_off.items():  # LOONGKIT_ALL would have enabled them: say why not
            extra.append(f"Off by hardware policy: {', '.join(names)} ({reason})")
        if self.manager.disabled:  # why a requested feature may be missing above
            unread = self.unread_variables()
            extra.append(self.disabled_plugins_note() + (f"; read by no loaded plugin: {', '.join(unread)}"
                                                         if unread else ""))
        reasons: dict[str, list[int]] = {}
        for rank, why in sorted(self.node_silent.items()):
            reasons.setdefault(why, []).append(rank)
        for why, ranks in reasons.items():
            extra.append(f"No activity report from rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: "
                         f"{why}; {'their' if len(ranks) > 1 else 'its'} calls are missing above")
        for _, lines in self.manager.call_each("loongkit_summary", records=list(self.records.values())):
            extra.extend(str(line) for line in lines)
        return extra

    def finish(self) -> None:
        """Run features' exit callbacks, then print and log the Summary once, from the process that
        booted (never from a forked child). Re-entry from a signal handler in the same thread returns at
        once (the running call completes, and the signal is delivered after it); another thread waits
        for the running call."""
        if self._finishing == threading.get_ident():
            return
        with self._finish_lock:  # reentrant: a handler interrupting before _finishing is set runs it all
            self._finishing = threading.get_ident()
            try:
                self._finish()
            finally:
                self._finishing = None
        pending, self._pending_signal = self._pending_signal, None
        if pending is not None:
            self._die_of(pending)

    def _finish(self) -> None:
        self.run_exit_callbacks()
        if self._summary_done or os.getpid() != self.process.pid or not self.process.writes_summary:
            return
        self._summary_done = True
        try:
            for record in self.records.values():
                if record.state == State.ARMED and not record.reason:
                    record.reason = "target not imported: " + ", ".join(record.feature.targets)
            self.gather_activity()
            extra = self.summary_extra()
            text = self.summary_text(extra)
            destination = self.destination
            printed = self.process.prints_summary and self.is_training_job()
            if printed:
                try:
                    sys.stdout.write(text)
                    sys.stdout.flush()
                except (OSError, ValueError):
                    pass
            if destination is None or destination.kind != "stdout" or not printed:
                # a log file keeps every detail; a log on stdout/stderr is a terminal: the short form
                log.write_block(self.summary_text(extra, full=True) if log.log_path() else text)
            if self.settings.summary_json:
                from loongkit_core import summary as summary_mod

                path = summary_mod.json_path(self.settings.summary_json, self.process)
                payload = summary_mod.to_json(list(self.records.values()), self.manager.faults, self.process,
                                              log.log_path(), extra)
                try:
                    summary_mod.write_json(path, payload)
                except OSError as exc:
                    self.log.warning("cannot write LOONGKIT_SUMMARY_JSON", path=path, error=str(exc))
        except Exception as exc:  # the Summary must never change the user's exit
            self.log.error("summary failed", error=repr(exc))
        finally:
            if self.channel is not None:
                try:
                    self.channel.close()
                except Exception as exc:
                    self.log.info("cannot leave the activity channel", error=repr(exc))
            log.shutdown()

    # -- activity across processes ---------------------------------------------------------------
    def is_training_job(self) -> bool:
        """Whether this process prints its Summary on stdout: an optimizer stepped, the program called a
        patched function, features ran in its DataLoader workers (or, for local rank 0, in the node's
        ranks), or it is the very command
        ``loongkit-run`` started and it imported a feature's target. Other processes under a
        container-wide ``PYTHONPATH`` (``pip``, helper scripts, ``NGPU=$(python -c "import torch; ...")``,
        the prelude-path recipe) keep their stdout clean: their Summary goes to their log only."""
        # Calls made while activating are no sign: some features act on import in every process
        # (CONFIG_GUARDS checks the CPU budget when torch loads). Calls the program made later are.
        if self.optimizer_stepped or any(r.calls > r.activation_calls or r.worker_calls or r.node
                                         for r in self.records.values()):
            return True
        launched = os.environ.get(LAUNCHED_ENV) == str(self.process.pid)
        return launched and bool(self.targets_seen)

    def _watch_optimizer_steps(self) -> None:
        """One-shot: the first optimizer step marks this process as training, then the hook removes
        itself (nothing left on the step path)."""
        def on_optim(module: ModuleType) -> None:
            register = getattr(module, "register_optimizer_step_post_hook", None)
            if register is None:
                return
            handle: list[Any] = []

            def stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
                self.optimizer_stepped = True
                if handle:
                    handle.pop().remove()

            handle.append(register(stepped))

        importhooks.when_imported("torch.optim.optimizer", on_optim)

    def records_have_node_view(self) -> bool:
        return any(r.node is not None for r in self.records.values())

    def gather_activity(self) -> None:
        """Fold this main process's workers' reports into its records; under torchrun, publish them
        for local rank 0, which collects the node's view. Never raises."""
        channel = self.channel
        if channel is None or os.getpid() != channel.pid:
            return
        try:
            for name, totals in channel.worker_totals().items():
                record = self.records.get(name)
                if record is not None:
                    record.worker_calls, record.workers = totals.worker_calls, totals.workers
            own = activity.merged(self.records.values())
            channel.publish_rank(own, self.process.rank)
            if channel.local_world_size > 1 and channel.local_rank == 0:
                view = channel.node_view()
                for record in self.records.values():  # by global rank: node 1 of 2x2 shows ranks 2,3
                    if record.enabled:
                        record.node = {rank: totals.get(record.feature.name, activity.Totals()).to_json()
                                       for rank, totals in sorted(view.ranks.items())}
                if view.silent:
                    self.log.warning("no activity report from ranks", ranks=view.silent)
                    self.node_silent = dict(view.silent)
        except Exception as exc:
            self.log.warning("cannot gather activity from other processes", error=repr(exc))

    def _open_channel(self) -> None:
        channel = activity.MainChannel.open(self.process.pid, self.process.local_rank,
                                            self.process.local_world_size, rank=self.process.rank)
        if channel is None:
            self.log.info("no directory for DataLoader workers' activity reports; the Summary counts this "
                          "process only")
            return
        self.channel = channel
        os.environ[activity.ENV] = channel.handoff()

    def _worker_started(self, worker_id: int) -> None:
        handoff = activity.parse_handoff(os.environ.get(activity.ENV))
        if handoff is None or self._reporter is not None:
            return
        records = self.records
        reporter = activity.WorkerReporter(
            handoff[0], handoff[1], worker_id,
            lambda: {name: r.calls for name, r in records.items() if r.calls}, self._fork_baseline)
        self._reporter = reporter
        reporter.start()

    def _worker_stopping(self, worker_id: int) -> None:
        if self._reporter is not None:
            self._reporter.stop()

    def install_exit_handlers(self) -> None:
        if self.process.role == process_mod.MAIN:
            os.environ[process_mod.MAIN_MARKER] = self.process.marker()
        if self.process.writes_summary and any(r.enabled for r in self.records.values()):
            self._open_channel()
            self._watch_optimizer_steps()
        if any(r.enabled for r in self.records.values()):
            from loongkit_core import workers

            workers.on_worker_start(self._worker_started, owner="<core>")
            workers.on_worker_exit(self._worker_stopping, owner="<core>")
        atexit.register(self.finish)
        try:
            os.register_at_fork(after_in_child=self._after_fork)
        except AttributeError:
            pass
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, self._on_sigterm)
        except (ValueError, OSError):
            pass

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # torchrun stops ranks with SIGTERM (all of them, once one failed): write the Summary without
        # waiting long for peers' reports, then die of the signal as before. Arriving during finish()
        # (the exit path of a rank whose collective failed), it lets that call complete first.
        activity.mark_stopping()
        if self._finishing == threading.get_ident():
            self._pending_signal = signum
            return
        self.finish()
        self._die_of(signum)

    @staticmethod
    def _die_of(signum: int) -> None:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _after_fork(self) -> None:
        if self.channel is not None:
            self.channel.forget()
        self._fork_baseline = {name: r.calls for name, r in self.records.items() if r.calls}
        self._reporter = None  # a worker forked from a worker reports on its own
        process_mod.mark_forked_child(self.process)
        try:
            log.after_fork(self.process)
        except Exception:
            pass


class _Activation:
    """The import-hook callback for one feature and target (keeps the record for fault reports)."""

    def __init__(self, runtime: Runtime, record: FeatureRecord, target: str) -> None:
        self.runtime, self.record, self.target = runtime, record, target

    def __call__(self, module: ModuleType) -> None:
        if self.target not in self.runtime.targets_seen:
            self.runtime.targets_seen.append(self.target)
        self.runtime.activate(self.record, self.target)


class _LazyHardware:
    """Hands plugins the hardware without reading sysfs unless a policy actually looks."""

    def __init__(self, env: Environment) -> None:
        self._env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env.hardware, name)


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


def _with_plugin(feature: Feature, plugin: str, version: str) -> Feature:
    return feature.replace(plugin=plugin, plugin_version=feature.plugin_version or version)


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
