"""Lifecycle: the end of a booted process (features' exit callbacks, then the Summary, once), and what
gets it there: the at-exit handler, SIGTERM (torchrun stops ranks with it), and the after-fork handler
that re-labels a forked child (a DataLoader worker) so it never writes its parent's Summary.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading

from loongkit_core import activity, log
from loongkit_core import process as process_mod
from loongkit_core.feature import FeatureRecord, State
from loongkit_core.manager import LoongkitStrictError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at boot (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from loongkit_core.manager import PluginManager


class Lifecycle:
    """Runtime's process lifecycle (a mixin: the state lives on the :class:`~loongkit_core.runtime.Runtime`)."""

    settings: Any
    process: process_mod.ProcessInfo
    manager: PluginManager
    records: dict[str, FeatureRecord]
    destination: log.Destination | None
    channel: activity.MainChannel | None
    node_silent: dict[int, str]
    warnings: list[str]
    log: Any
    _exit_callbacks: list[tuple[FeatureRecord, Callable[[], None], int]]
    _summary_done: bool
    _finish_lock: threading.RLock
    _finishing: int | None
    _pending_signal: int | None
    _fork_baseline: dict[str, int]
    _reporter: activity.WorkerReporter | None

    if TYPE_CHECKING:  # the Runtime's parts (not defined here: the MRO decides)
        def unread_variables(self) -> list[str]: ...

        def disabled_plugins_note(self) -> str: ...

        def is_training_job(self) -> bool: ...

        def gather_activity(self) -> None: ...

        def _open_channel(self) -> None: ...

        def _watch_optimizer_steps(self) -> None: ...

        def _worker_started(self, worker_id: int) -> None: ...

        def _worker_stopping(self, worker_id: int) -> None: ...

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
    def misconfigured(self) -> str:
        """What a training process prints at exit in place of the Summary when it set LOONGKIT_* variables
        and they enabled nothing: the boot's warnings (invalid values, unknown names) and what to set; ""
        when there was nothing to warn about (no variable set: loongkit stays silent)."""
        if not self.warnings:
            return ""
        lines = ["loongkit: no feature was enabled; the LOONGKIT_* settings of this job were not understood:"]
        lines += [f"  - {warning}" for warning in self.warnings]
        lines.append("  Enable features with LOONGKIT_ALL=1, 2 or 3, or LOONGKIT_<FEATURE>=1 "
                     "(`loongkit features` lists them; `loongkit-run --info <cmd>` checks a command).")
        if log.log_path():
            lines.append(f"  Log: {log.log_path()}")
        return "\n".join(lines) + "\n"

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
            text = self.summary_text(extra) if any(r.enabled for r in self.records.values()) else self.misconfigured()
            destination = self.destination
            printed = bool(text) and self.process.prints_summary and self.is_training_job()
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

    def install_exit_handlers(self) -> None:
        if self.process.role == process_mod.MAIN:
            os.environ[process_mod.MAIN_MARKER] = self.process.marker()
        if self.process.writes_summary and any(r.enabled for r in self.records.values()):
            self._open_channel()
            self._watch_optimizer_steps()
        elif self.process.writes_summary and self.warnings:
            # LOONGKIT_* set, nothing enabled: a training process is told why at exit (misconfigured())
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
