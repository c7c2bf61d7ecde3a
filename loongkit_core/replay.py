"""Replay: a process that reuses its job's resolution (:mod:`loongkit_core.resolved`) restores it.

What the full boot that wrote the resolution decided comes back as it was (entry points, records,
policies), its warnings and faults are logged again in their order, and each feature restored as
armed is confirmed before its first activation: its plugin loads then, and its ``detect`` and
``configure`` run in this process (what they keep on the implementation object is there for
``activate``; a feature that turns out not to apply here says so).
"""

from __future__ import annotations

from loongkit_core import resolved
from loongkit_core.feature import FeatureRecord, State

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at boot (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    from typing import Any

    from loongkit_core.context import Environment
    from loongkit_core.feature import PolicyDecision
    from loongkit_core.manager import Fault, PluginManager


class Replay:
    """Runtime's replay of a stored resolution (a mixin: the state lives on the
    :class:`~loongkit_core.runtime.Runtime`)."""

    manager: PluginManager
    records: dict[str, FeatureRecord]
    policies: dict[str, PolicyDecision]
    warnings: list[str]
    env: Environment
    log: Any
    _unconfirmed: set[str]

    if TYPE_CHECKING:  # the Runtime's own and the other parts' (not defined here: the MRO decides)
        def _warn(self, message: str, **context: Any) -> None: ...

        def _on_fault(self, fault: Fault) -> None: ...

        def _log_resolved(self) -> None: ...

        def _owner_call(self, record: FeatureRecord, hook: str, **kwargs: Any) -> Any: ...

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
