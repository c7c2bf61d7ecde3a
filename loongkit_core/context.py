"""What the core hands to a plugin's hooks: the environment, and an activation context."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping

from loongkit_core import requirements
from loongkit_core.patcher import Patcher
from loongkit_core.record import Record

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at boot (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    from typing import Any, TypeVar

    from loongkit_core.feature import Feature, FeatureRecord, State
    from loongkit_core.hardware import Hardware
    from loongkit_core.process import ProcessInfo
    from loongkit_core.settings import CoreSettings

    F = TypeVar("F", bound=Callable[..., Any])


class NotApplicable(Exception):
    """Raised by an activation hook when the target is not what the patch expects."""


class Environment:
    """Facts about this process and machine, shared by all features. Cheap, and lazy where not."""

    def __init__(
        self,
        settings: CoreSettings,
        process: ProcessInfo,
        environ: Mapping[str, str] | None = None,
        hardware_loader: Callable[[], Hardware] | None = None,
    ) -> None:
        self.settings = settings
        self.process = process
        self.environ: Mapping[str, str] = os.environ if environ is None else environ
        self._hardware_loader = hardware_loader
        self._hardware: Hardware | None = None

    @property
    def hardware(self) -> Hardware:
        """The detected topology (read once, under ``LOONGKIT_SYSFS_ROOT``)."""
        if self._hardware is None:
            if self._hardware_loader is not None:
                self._hardware = self._hardware_loader()
            else:
                from loongkit_core import hardware

                self._hardware = hardware.detect(self.settings.sysfs_root)
        return self._hardware

    @staticmethod
    def version(module: str) -> str | None:
        """Installed version of the distribution providing ``module`` (metadata only)."""
        found = requirements.installed(module)
        return found.version if found else None


class FeatureStatus(Record):
    """One feature of this process as another feature reads it (:meth:`ActivationContext.features`): its
    declaration, whether it is enabled (and by its own variable), its state and reason when asked, and its
    Summary configuration (what its dry run found, e.g. config_guards' ``findings``). A copy: changing it
    changes nothing (the runtime owns the records)."""

    __slots__ = ("config", "enabled", "explicit", "feature", "reason", "state")
    _fields = ("feature", "enabled", "explicit", "state", "reason", "config")

    def __init__(self, feature: Feature, enabled: bool, explicit: bool, state: State, reason: str,
                 config: object = None) -> None:
        self.feature = feature
        self.enabled = enabled
        self.explicit = explicit
        self.state = state
        self.reason = reason
        self.config = dict(config) if isinstance(config, dict) else config


class Scratch:
    """A feature's per-activation state (:attr:`ActivationContext.scratch`): set any attribute on it.
    ``live`` is True until the activation's undo, which then clears every other attribute: a callback
    that cannot be unregistered (an import hook, a copy of a wrapper) and captured this object does
    nothing once ``live`` is False, and the next activation gets a fresh one."""

    def __init__(self) -> None:
        self.live = True

    def _drop(self) -> None:
        self.__dict__.clear()
        self.live = False

    def __repr__(self) -> str:
        return f"Scratch({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


class _ActivationPatcher(Patcher):
    """The context's patcher: its ``undo`` (the feature's undo, however it is called) also drops the
    context's scratch, after every other change is undone."""

    def __init__(self, ctx: ActivationContext) -> None:
        super().__init__()
        self._ctx = ctx

    def undo(self) -> None:
        try:
            super().undo()
        finally:
            self._ctx._drop_scratch()


class ActivationContext:
    """Handed to ``loongkit_activate``: where a feature records what it did and that it ran."""

    def __init__(self, record: FeatureRecord, env: Environment, logger: Any,
                 on_import: Callable[[str, Callable[[Any], None]], None],
                 at_exit: Callable[[FeatureRecord, Callable[[], None]], None] | None = None,
                 features: Callable[[], Iterable[FeatureRecord]] | None = None) -> None:
        self.record = record
        self.env = env
        self.log = logger
        self.patcher: Patcher = _ActivationPatcher(self)
        self._scratch: Scratch | None = None
        self._on_import = on_import
        self._at_exit = at_exit
        self._features = features

    @classmethod
    def standalone(cls, feature: Feature, state: Any = None, logger: str = "loongkit",
                   config: object = None) -> ActivationContext:
        """A context for calling a feature's ``activate``/``deactivate`` outside a Runtime (tests,
        benchmarks): a fresh record (in ``state`` if given, with ``config`` as ``ctx.config``: pass
        the options the feature would have been configured with), no Environment, and ``on_import``
        calling back at once with the module, which the caller has already imported."""
        import sys

        from loongkit_core.feature import FeatureRecord
        from loongkit_core.log import get_logger

        record = FeatureRecord(feature)
        if state is not None:
            record.state = state
        record.config = config
        return cls(record, None, get_logger(logger),  # type: ignore[arg-type]
                   lambda module, cb: cb(sys.modules[module]))

    @property
    def feature(self) -> Feature:
        return self.record.feature

    @property
    def config(self) -> object:
        """The validated options (None for a feature without options, and in a ``standalone`` context
        until ``set_config``; ``FeatureImpl.configure`` gives the parsed value for tests)."""
        return self.record.config

    def set_config(self, config: object) -> None:
        """Replace what the Summary shows as this feature's configuration."""
        self.record.config = config

    def features(self) -> list[FeatureStatus]:
        """Every feature declared in this process, this one included, enabled or not, in declaration
        order, as read-only copies (e.g. for a report that recommends features). A ``standalone`` context
        knows only its own."""
        records = self._features() if self._features is not None else (self.record,)
        return [FeatureStatus(r.feature, r.enabled, r.explicit, r.state, r.reason, r.config) for r in records]

    def detail(self, key: str, value: object) -> None:
        """A fact for the JSON summary and the log (e.g. the CPUs a rank was bound to)."""
        self.record.details[key] = value

    # -- what happened: the runtime owns the record; plugins say it through these verbs ------------
    @property
    def calls(self) -> int:
        """How often the feature's code ran in this process so far."""
        return self.record.calls

    @property
    def state(self) -> State:
        return self.record.state

    def count(self, n: int = 1) -> None:
        """The feature's code ran ``n`` times: the Summary shows '*' and the count (one integer add;
        DataLoader workers' counts reach their main process's Summary)."""
        self.record.calls += n

    mark_active = count  # the earlier name

    def counted(self, fn: F) -> F:
        """Wrap ``fn`` so that each call counts as the feature being active (one integer add)."""
        record = self.record

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            record.calls += 1
            return fn(*args, **kwargs)

        wrapper.__loongkit_original__ = fn  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    def waiting(self, why: str = "") -> None:
        """Applied, and waiting for something before its code can run ("no CUDA device", "page cache
        below the limit"): the Summary shows ``why`` until the feature is active. ``""`` clears it."""
        if self.record.reason != why:
            self.record.reason = why
            if why:
                self.log.info("feature waiting", reason=why)

    def fallback(self, why: str) -> None:
        """A call took the upstream path instead of the feature's (a kernel that did not build, an
        input it does not handle). Counted per reason in the JSON; the reason is shown while the
        feature has not run. Cheap enough for a hot path: logs only when the reason changes."""
        fallbacks = self.record.details.setdefault("fallbacks", {})
        assert isinstance(fallbacks, dict)
        fallbacks[why] = fallbacks.get(why, 0) + 1
        if self.record.reason != why:
            self.record.reason = why
            self.log.info("feature fell back", reason=why)

    def not_applicable(self, why: str) -> None:
        """Found out that a target is not what the feature expects (a class a registry watch finds, already
        registered while ``activate`` runs or registering later, that differs). Undo what was patched for
        it first; ``applied()`` reverts this when a later target fits. Said while ``activate`` runs, it is
        the state the activation ends in (the runtime moves a feature to APPLIED only where nothing else
        was said)."""
        from loongkit_core.feature import State

        self.record.state, self.record.reason = State.NOT_APPLICABLE, why
        self.log.warning("feature not applicable", reason=why)

    def applied(self) -> None:
        """The feature's patch is in force (again), e.g. after ``not_applicable`` for an earlier class."""
        from loongkit_core.feature import State

        if self.record.state != State.APPLIED:
            self.record.state, self.record.reason = State.APPLIED, ""

    def at_exit(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` when the process ends (exit, exception, SIGTERM), before the Summary is
        written, so what it records (``ctx.detail``) shows there. Only in the process that called this;
        an exception is a fault of the feature, never of the exit."""
        if self._at_exit is None:
            import atexit

            atexit.register(callback)
        else:
            self._at_exit(self.record, callback)

    def on_import(self, module: str, callback: Callable[[Any], None]) -> None:
        """Run ``callback(module)`` when ``module`` finishes importing (now, if it already has)."""
        self._on_import(module, callback)

    # -- per activation: what the feature's undo ends ------------------------------------------------
    @property
    def scratch(self) -> Scratch:
        """This activation's scratch space (made on first use): the feature's own per-activation state
        (``ctx.scratch.seen = set()``), instead of attributes of the impl. Dropped at the feature's undo
        (``ctx.patcher.undo()``, the default ``deactivate``): its ``live`` turns False and the next
        activation finds a fresh one. Not a patch: it alone does not keep the feature in force."""
        if self._scratch is None:
            self._scratch = Scratch()
        return self._scratch

    def _drop_scratch(self) -> None:
        scratch, self._scratch = self._scratch, None
        if scratch is not None:
            scratch._drop()

    def on_worker_start(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(worker_id)`` first thing in every torch DataLoader worker (fork, spawn,
        forkserver) until the feature's undo, which unregisters it. An exception it raises is caught:
        the worker goes on. Raises ImportError where ``loongkit_core.workers`` cannot load."""
        from loongkit_core.workers import on_worker_start as register

        register(callback, owner=self.feature.name)
        self.patcher.defer(functools.partial(_forget_worker_callback, callback))

    def on_worker_exit(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(worker_id)`` when a DataLoader worker's loop returns (told to stop; not when
        killed by a signal), until the feature's undo, which unregisters it."""
        from loongkit_core.workers import on_worker_exit as register

        register(callback, owner=self.feature.name)
        self.patcher.defer(functools.partial(_forget_worker_callback, callback))


def _forget_worker_callback(callback: Callable[[int], None]) -> None:
    from loongkit_core.workers import forget

    forget(callback)
