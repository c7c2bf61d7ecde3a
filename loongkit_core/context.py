"""What the core hands to a plugin's hooks: the environment, and an activation context."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from loongkit_core import requirements
from loongkit_core.patcher import Patcher

if TYPE_CHECKING:
    from loongkit_core.feature import Feature, FeatureRecord
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


class ActivationContext:
    """Handed to ``loongkit_activate``: where a feature records what it did and that it ran."""

    def __init__(self, record: FeatureRecord, env: Environment, logger: Any,
                 on_import: Callable[[str, Callable[[Any], None]], None],
                 at_exit: Callable[[FeatureRecord, Callable[[], None]], None] | None = None) -> None:
        self.record = record
        self.env = env
        self.log = logger
        self.patcher = Patcher()
        self._on_import = on_import
        self._at_exit = at_exit

    @classmethod
    def standalone(cls, feature: Feature, state: Any = None, logger: str = "loongkit") -> ActivationContext:
        """A context for calling a feature's ``activate``/``deactivate`` outside a Runtime (tests,
        benchmarks): a fresh record (in ``state`` if given), no Environment, and ``on_import`` calling
        back at once with the module, which the caller has already imported."""
        import sys

        from loongkit_core.feature import FeatureRecord
        from loongkit_core.log import get_logger

        record = FeatureRecord(feature)
        if state is not None:
            record.state = state
        return cls(record, None, get_logger(logger),  # type: ignore[arg-type]
                   lambda module, cb: cb(sys.modules[module]))

    @property
    def feature(self) -> Feature:
        return self.record.feature

    @property
    def config(self) -> object:
        return self.record.config

    def set_config(self, config: object) -> None:
        """Replace what the Summary shows as this feature's configuration."""
        self.record.config = config

    def detail(self, key: str, value: object) -> None:
        """A fact for the JSON summary and the log (e.g. the CPUs a rank was bound to)."""
        self.record.details[key] = value

    def mark_active(self, n: int = 1) -> None:
        """The feature's code ran: the Summary shows '*'."""
        self.record.calls += n

    def counted(self, fn: F) -> F:
        """Wrap ``fn`` so that each call counts as the feature being active (one integer add)."""
        record = self.record

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            record.calls += 1
            return fn(*args, **kwargs)

        wrapper.__loongkit_original__ = fn  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

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
