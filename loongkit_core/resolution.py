"""Resolution: which of the declared features are enabled, applicable, configured, then armed.

The part of :class:`~loongkit_core.runtime.Runtime` a full boot runs once per job (a process that
reuses the job's resolution replays it instead, :mod:`loongkit_core.replay`): collect the plugins'
declarations, warn about LOONGKIT_* variables nobody reads, ask the hardware policies, then decide
each feature: enabled (its variable, ``LOONGKIT_ALL`` and the policy), not implemented, not
applicable (requirements, the plugin's ``detect``, ``disables`` of another applicable feature,
``depends_on``), configured (the plugin's ``configure``), armed.
"""

from __future__ import annotations

from loongkit_core import requirements
from loongkit_core._boot import CORE_VARIABLES, bool_or_none, is_unset
from loongkit_core.feature import Feature, FeatureRecord, PolicyDecision, State
from loongkit_core.manager import LoongkitStrictError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at boot (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

    from loongkit_core.context import Environment
    from loongkit_core.manager import PluginManager


class Resolution:
    """Runtime's resolution (a mixin: the state lives on the :class:`~loongkit_core.runtime.Runtime`)."""

    environ: Mapping[str, str]
    settings: Any
    manager: PluginManager
    records: dict[str, FeatureRecord]
    policies: dict[str, PolicyDecision]
    env: Environment
    log: Any

    if TYPE_CHECKING:  # the Runtime's own and the other parts' (not defined here: the MRO decides)
        def _warn(self, message: str, **context: Any) -> None: ...

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

    def check_references(self) -> None:
        """Every plugin's handles on other plugins' features (``loongkit_feature_references``) must
        name a feature the referenced plugin declares; one that does not is its holder's fault."""
        declared: dict[str, list[str]] = {name: [] for name in self.manager.plugins}
        for record in self.records.values():
            declared.setdefault(record.feature.plugin, []).append(record.feature.name)
        for plugin, refs in self.manager.call_each("loongkit_feature_references"):
            for ref in refs or ():
                problem = ref.problem(declared) if hasattr(ref, "problem") else f"{ref!r} is not a FeatureRef"
                if problem is not None:
                    self.manager.fault(plugin, "loongkit_feature_references", ValueError(problem))

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


class _LazyHardware:
    """Hands plugins the hardware without reading sysfs unless a policy actually looks."""

    def __init__(self, env: Environment) -> None:
        self._env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env.hardware, name)


def _with_plugin(feature: Feature, plugin: str, version: str) -> Feature:
    return feature.replace(plugin=plugin, plugin_version=feature.plugin_version or version)
