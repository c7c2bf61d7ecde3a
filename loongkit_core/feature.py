"""What a plugin declares about a feature, and the states a feature goes through at run time.

A :class:`Feature` is pure data: importing this module imports nothing heavy, so plugins can
declare features without touching torch or any other target library.
"""

from __future__ import annotations

import enum

from loongkit_core.record import Record

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping


class Category(str, enum.Enum):
    """The groups of the product documentation's feature table."""

    DATA = "Data preprocessing"
    RESOURCE = "Resource control"
    OPS = "Operator optimization and model compilation"
    PRECISION = "Precision control"
    OTHER = "Other"


class State(str, enum.Enum):
    """A feature's life: declared -> enabled -> applicable -> armed -> applied -> active.

    Every state but ACTIVE carries a reason in its :class:`FeatureRecord`.
    """

    DISABLED = "disabled"  # not requested by LOONGKIT_X nor LOONGKIT_ALL
    NOT_IMPLEMENTED = "not implemented"  # declared by its plugin, not built yet
    NOT_APPLICABLE = "not applicable"  # versions, hardware or platform rule it out
    ARMED = "armed"  # waiting for its target module to be imported
    APPLIED = "applied"  # patch installed, its code has not run yet
    ACTIVE = "active"  # its code ran at least once in this process
    FAILED = "failed"  # raised while detecting, validating or activating


# Plain classes, not dataclasses: every booting process imports this module (a DataLoader worker, a
# helper under a container-wide PYTHONPATH), and ``dataclasses`` brings ``inspect``, ``ast``, ``dis``
# and ``tokenize`` with it: about half of a reused boot's imports (docs/benchmarks.md, start-up).

_FEATURE_DEFAULTS: dict[str, object] = {
    "requires": (), "targets": (), "options": (), "depends_on": (), "disables": (), "implemented": True,
    "plugin": "", "plugin_version": "",
}
_FEATURE_FIELDS = ("name", "env", "level", "category", "description", *_FEATURE_DEFAULTS)


class Feature(Record):
    """A feature declared by a plugin, always by keyword (``Feature(name=..., env=..., ...)``); frozen.

    ``name`` is the lower-case key used in the Summary (``allow_tf32``); ``env`` the variable
    that switches it (``LOONGKIT_ALLOW_TF32``). ``requires`` lists version requirements of
    installed distributions, written like PEP 440 requirements with module-style names
    (``"torch>=2.6"``, ``"mmcv>=1.7.0,<=1.8.0"``, ``"mmseg>=0.12,<=1.0"``); they are checked
    from distribution metadata, never by importing the library. ``targets`` are the modules
    whose import triggers activation (any of them; activation runs once per target imported);
    empty means "activate at boot". ``options`` names the extra environment variables the
    feature reads (for the did-you-mean check and the docs); their parsing belongs to the
    plugin's configuration hook. A changed copy: :meth:`replace`.
    """

    __slots__ = _FEATURE_FIELDS

    name: str
    env: str
    level: int
    category: Category
    description: str
    requires: tuple[str, ...]
    targets: tuple[str, ...]
    options: tuple[str, ...]
    depends_on: tuple[str, ...]  # features that must be applicable and enabled too
    disables: tuple[str, ...]  # features this one switches off when enabled (seed: SUBCGROUPS)
    implemented: bool
    # Filled in by the core from the entry point: which plugin declared it.
    plugin: str
    plugin_version: str

    def __init__(self, *, name: str, env: str, level: int, category: Category, description: str,
                 requires: tuple[str, ...] = (), targets: tuple[str, ...] = (), options: tuple[str, ...] = (),
                 depends_on: tuple[str, ...] = (), disables: tuple[str, ...] = (), implemented: bool = True,
                 plugin: str = "", plugin_version: str = "") -> None:
        values = (name, env, level, category, description, requires, targets, options, depends_on, disables,
                  implemented, plugin, plugin_version)
        for field_name, value in zip(_FEATURE_FIELDS, values, strict=True):
            object.__setattr__(self, field_name, value)
        if not self.env.startswith("LOONGKIT_"):
            raise ValueError(f"feature {self.name!r}: env {self.env!r} must start with LOONGKIT_")
        if self.level not in (1, 2, 3):
            raise ValueError(f"feature {self.name!r}: level must be 1, 2 or 3, not {self.level!r}")
        if self.name != self.name.lower() or not self.name.replace("_", "").isalnum():
            raise ValueError(f"feature name {self.name!r} must be lower_snake_case")

    def fields(self) -> dict[str, object]:
        """The declaration as keywords (``Feature(**f.fields())`` is an equal feature)."""
        return {n: getattr(self, n) for n in _FEATURE_FIELDS}

    def replace(self, **changes: object) -> Feature:
        """A copy with ``changes`` (validated again), like ``dataclasses.replace``."""
        unknown = set(changes) - set(_FEATURE_FIELDS)
        if unknown:
            raise TypeError(f"Feature has no field(s) {', '.join(sorted(unknown))}")
        return Feature(**{**self.fields(), **changes})  # type: ignore[arg-type]

    def _key(self) -> tuple[object, ...]:
        return tuple(getattr(self, n) for n in _FEATURE_FIELDS)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"cannot assign to field {name!r}: a Feature is frozen (use .replace())")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r}: a Feature is frozen")

    def __hash__(self) -> int:  # frozen: hashable, unlike other records (equality and repr: Record's)
        return hash(self._key())

    def __reduce__(self) -> tuple[object, tuple[dict[str, object]]]:
        return _feature, (self.fields(),)


def _feature(fields: dict[str, object]) -> Feature:
    return Feature(**fields)  # type: ignore[arg-type]


class FeatureRef(Record):
    """A handle on another plugin's feature: ``plugin`` (its entry-point name) and ``name``.

    A plugin that reads or recommends a feature it does not declare says so with one of these
    (:meth:`loongkit_core.kit.PluginSpec.refer`). The core checks every handle against the
    declarations at boot: a name the referenced plugin does not declare is a fault of the plugin
    holding the handle (a typo would otherwise disable whatever reads it, silently). A referenced
    plugin that is not installed leaves the handle unresolved, which is not a fault.
    """

    __slots__ = ("name", "plugin")
    _fields = ("plugin", "name")

    plugin: str
    name: str

    def __init__(self, plugin: str, name: str) -> None:
        self.plugin = plugin
        self.name = name

    def __hash__(self) -> int:
        return hash((self.plugin, self.name))

    def find(self, records: Iterable[FeatureRecord]) -> FeatureRecord | None:
        """The referenced feature's record among ``records`` (declared by that plugin), or None."""
        return next((r for r in records if r.feature.name == self.name and r.feature.plugin == self.plugin), None)

    def problem(self, declared: Mapping[str, Iterable[str]]) -> str | None:
        """Why this handle does not resolve against ``declared`` (plugin -> its feature names), or
        None: it resolves, or its plugin is not among them (not installed)."""
        names = declared.get(self.plugin)
        if names is None:
            return None
        names = sorted(names)
        if self.name in names:
            return None
        import difflib

        close = difflib.get_close_matches(self.name, names, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return (f"refers to feature {self.name!r} of plugin {self.plugin!r}, which declares no such "
                f"feature{hint}; it declares {', '.join(names) or 'none'}")


class PolicyDecision(Record):
    """A hardware policy's say on one feature (seed: 'Hardware-aware default optimization policies').

    ``enabled_by_default`` replaces "on under LOONGKIT_ALL" (an explicit LOONGKIT_X still wins);
    ``option_defaults`` replaces defaults of the feature's options (explicit variables still win).
    """

    __slots__ = ("enabled_by_default", "option_defaults", "reason")
    _fields = ("reason", "enabled_by_default", "option_defaults")

    def __init__(self, reason: str, enabled_by_default: bool | None = None,
                 option_defaults: dict[str, object] | None = None) -> None:
        self.reason = reason
        self.enabled_by_default = enabled_by_default
        self.option_defaults: dict[str, object] = {} if option_defaults is None else option_defaults


_RECORD_FIELDS = ("feature", "state", "reason", "explicit", "enabled", "config", "calls", "activation_calls",
                  "worker_calls", "workers", "node", "applied_targets", "policy", "details")


class FeatureRecord(Record):
    """The run-time record of one declared feature; what the Summary prints."""

    __slots__ = _RECORD_FIELDS

    def __init__(self, feature: Feature, state: State = State.DISABLED, reason: str = "", explicit: bool = False,
                 enabled: bool = False, config: object = None, calls: int = 0, activation_calls: int = 0,
                 worker_calls: int = 0, workers: int = 0, node: dict[int, dict[str, int]] | None = None,
                 applied_targets: list[str] | None = None, policy: str = "",
                 details: dict[str, object] | None = None) -> None:
        self.feature = feature
        self.state = state
        self.reason = reason
        self.explicit = explicit  # enabled by its own variable rather than LOONGKIT_ALL
        self.enabled = enabled
        self.config = config  # what the Summary shows in its "Configurations" column
        self.calls = calls  # times its code ran in this process (the Summary's '*')
        self.activation_calls = activation_calls  # of ``calls``, those made inside the activation hook itself
        self.worker_calls = worker_calls  # times it ran in this process's DataLoader workers (reported at exit)
        self.workers = workers  # how many distinct DataLoader workers ran it
        self.node = node  # local rank 0 under torchrun: the node's global ranks -> totals
        self.applied_targets: list[str] = [] if applied_targets is None else applied_targets
        self.policy = policy  # the hardware policy that changed its defaults, if any
        # free-form facts for the JSON summary
        self.details: dict[str, object] = {} if details is None else details

    @property
    def active(self) -> bool:
        """Its code ran in this process or in one of its DataLoader workers (or, in local rank 0's
        node view, in any local rank)."""
        if self.calls > 0 or self.worker_calls > 0:
            return True
        return bool(self.node) and any(t["calls"] or t["worker_calls"] for t in self.node.values())

    def to_json(self) -> dict[str, object]:
        f = self.feature
        return {
            "name": f.name,
            "env": f.env,
            "plugin": f.plugin,
            "level": f.level,
            "enabled": self.enabled,
            "explicit": self.explicit,
            "state": (State.ACTIVE if self.active and self.state == State.APPLIED else self.state).value,
            "active": self.active,
            "calls": self.calls,
            "worker_calls": self.worker_calls,
            "workers": self.workers,
            "reason": self.reason,
            "config": _jsonable(self.config),
            "targets": list(self.applied_targets),
            "policy": self.policy,
            "details": {k: _jsonable(v) for k, v in self.details.items()},
            **({"node": {str(k): v for k, v in self.node.items()}} if self.node is not None else {}),
        }


def _jsonable(value: object) -> object:
    dump = getattr(value, "model_dump", None)  # option models (pydantic) show as their fields
    if callable(dump):
        value = dump()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return repr(value)
