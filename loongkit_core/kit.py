"""The plugin authoring kit: declare features and implement them one class each.

A plugin module needs three things::

    from loongkit_core.feature import Category
    from loongkit_core.kit import PluginSpec

    plugin = PluginSpec("precision", distribution="loongkit-precision", category=Category.PRECISION)
    plugin.feature("allow_tf32", level=1, description="TF32 for FP32 matmul and convolution on CUDA",
                   requires=("torch>=2.0",), targets=("torch",), impl="loongkit_precision.tf32:AllowTF32")

and an entry point ``precision = "loongkit_precision.plugin:plugin"`` in the group ``loongkit``.
``impl`` is imported only when the feature is enabled, so declaring stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from loongkit_core.hookspecs import CORE_API_VERSION, hookimpl

if TYPE_CHECKING:
    from loongkit_core.context import ActivationContext, Environment
    from loongkit_core.feature import Category, Feature, FeatureRecord, FeatureRef, PolicyDecision
    from loongkit_core.hardware import Hardware
    from loongkit_core.settings import LoongkitSettings


def options_set(environ: Mapping[str, str], names: Sequence[str]) -> bool:
    """Whether ``configure`` has an option to validate: one of ``names`` (LOONGKIT_* variables, matched
    case-insensitively like :func:`loongkit_core.settings.load_settings`) is set and not empty, or a
    conformance check is recording which settings models ``configure`` loads. When False, a feature may
    skip its options model, and with it importing pydantic-settings."""
    import sys

    settings = sys.modules.get("loongkit_core.settings")  # recording needs it imported: cheap to ask
    if settings is not None and settings._loaded.get() is not None:
        return True
    wanted = {name.upper() for name in names}
    return any(key.upper() in wanted and value.strip() for key, value in environ.items())


class FeatureImpl:
    """One feature's behaviour. Subclass it and override what the feature needs.

    ``options`` is a :class:`loongkit_core.settings.LoongkitSettings` subclass for the feature's
    extra variables; its validated instance becomes ``ctx.config`` and is shown in the Summary as a
    dict (``ctx.set_config`` replaces what is shown).
    """

    options: ClassVar[type[LoongkitSettings] | None] = None
    # The options model as "module:Class", imported only when one of the feature's option variables
    # (``Feature.options``) is set or a policy sets option defaults; otherwise ``configure`` returns
    # ``options_unset`` (a copy of a dict) without importing pydantic-settings (the largest import a
    # booting process could pay: docs/benchmarks.md, start-up).
    lazy_options: ClassVar[str | None] = None
    options_unset: ClassVar[object] = None

    def __init__(self, feature: Feature) -> None:
        self.feature = feature

    def detect(self, env: Environment) -> str | None:
        """None when applicable here; else the reason it is not."""
        return None

    def configure(self, env: Environment, policy: PolicyDecision | None) -> tuple[object, list[str]]:
        model = self.options
        if model is None and self.lazy_options is not None:
            defaulted = policy is not None and bool(policy.option_defaults)
            if not defaulted and not options_set(env.environ, self.feature.options):
                unset = self.options_unset
                return (dict(unset) if isinstance(unset, dict) else unset), []
            import importlib

            module, _, name = self.lazy_options.partition(":")
            model = getattr(importlib.import_module(module), name)
        if model is None:
            return None, []
        from loongkit_core.settings import load_settings

        defaults = policy.option_defaults if policy is not None else None
        return load_settings(model, defaults=defaults, environ=env.environ)

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        raise NotImplementedError(f"{type(self).__name__}.activate")

    def deactivate(self, ctx: ActivationContext) -> None:
        ctx.patcher.undo()


class PluginSpec:
    """A pluggy plugin object that serves a set of features, each backed by a FeatureImpl."""

    LOONGKIT_CORE_API = (1, 1)  # the hookspec versions this kit implements (min, max)

    def __init__(self, name: str, distribution: str = "", category: Category | None = None) -> None:
        self.name = name
        self.distribution = distribution
        self.category = category  # the default of this plugin's declarations
        self._features: dict[str, Feature] = {}
        self._impl_paths: dict[str, str] = {}
        self._impls: dict[str, FeatureImpl] = {}
        self._policies: list[Callable[[Hardware, Sequence[Feature]], Mapping[str, PolicyDecision]]] = []
        self._cli: list[Callable[[Any], None]] = []
        self._summary: list[Callable[[Sequence[FeatureRecord]], Sequence[str]]] = []
        self._launch_env: list[Callable[[Sequence[FeatureRecord], Mapping[str, str]], Mapping[str, str]]] = []
        self._references: dict[tuple[str, str], FeatureRef] = {}
        assert self.LOONGKIT_CORE_API[0] <= CORE_API_VERSION <= self.LOONGKIT_CORE_API[1]

    # -- declaring ---------------------------------------------------------------------------
    def add(self, feature: Feature, impl: str | None = None) -> None:
        """Declare ``feature``; ``impl`` is "module:Class" of its FeatureImpl (None: not implemented)."""
        if feature.name in self._features:
            raise ValueError(f"feature {feature.name!r} declared twice by plugin {self.name!r}")
        if impl is None and feature.implemented:
            raise ValueError(f"feature {feature.name!r} has no implementation; declare implemented=False")
        self._features[feature.name] = feature
        if impl is not None:
            self._impl_paths[feature.name] = impl

    def policy(self, fn: Callable[[Hardware, Sequence[Feature]], Mapping[str, PolicyDecision]]) -> Callable:
        """Decorator: register a hardware policy function."""
        self._policies.append(fn)
        return fn

    def cli(self, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        """Decorator: register a function that adds subcommands to ``loongkit``."""
        self._cli.append(fn)
        return fn

    def summary(self, fn: Callable[[Sequence[FeatureRecord]], Sequence[str]]) -> Callable:
        """Decorator: register a function returning extra Summary lines."""
        self._summary.append(fn)
        return fn

    def launch_env(self, fn: Callable[[Sequence[FeatureRecord], Mapping[str, str]], Mapping[str, str]]) -> Callable:
        """Decorator: register a function returning variables for ``loongkit-run`` to set before exec."""
        self._launch_env.append(fn)
        return fn

    def impl(self, feature: Feature) -> FeatureImpl:
        """The feature's implementation object (imported on first use)."""
        found = self._impls.get(feature.name)
        if found is None:
            path = self._impl_paths[feature.name]
            module_name, _, attr = path.partition(":")
            cls = getattr(importlib.import_module(module_name), attr)
            found = self._impls[feature.name] = cls(feature)
        return found

    def feature(self, name: str, /, *, impl: str | None = None, **declaration: Any) -> Feature:
        """Declare feature ``name`` with keywords, or get the declared one with the name alone.

        ``plugin.feature("fused_adamw", level=1, description="...", requires=("torch>=2.4.0",),
        targets=("torch.optim",), impl="my_plugin.optim:FusedAdamW")``: the keywords are
        :class:`Feature`'s, with ``env`` defaulting to ``LOONGKIT_<NAME>``, ``category`` to the
        plugin's, ``implemented`` to whether ``impl`` ("module:Class" of its FeatureImpl) is given.
        The version shown is the distribution's (its metadata, read where the entry point is
        found), and an impl reads its targets from the declaration (``self.feature.targets``, or the
        ``target`` its activation is given), never from a second copy.

        ``plugin.feature("fused_adamw")`` returns the declaration (KeyError if this plugin declares
        none such), e.g. for ``ActivationContext.standalone(plugin.feature("x"))`` in tests.
        """
        if impl is None and not declaration:
            return self._features[name]
        from loongkit_core.feature import Feature  # the declaring module imports it anyway

        declaration.setdefault("env", f"LOONGKIT_{name.upper()}")
        declaration.setdefault("implemented", impl is not None)
        if "category" not in declaration:
            if self.category is None:
                raise ValueError(f"feature {name!r}: no category= and plugin {self.name!r} has no default")
            declaration["category"] = self.category
        feature = Feature(name=name, **declaration)
        self.add(feature, impl=impl)
        return feature

    def refer(self, plugin: str, name: str) -> FeatureRef:
        """A checked handle on feature ``name`` of ``plugin`` (its entry-point name, e.g. ``"data"``).

        Use it wherever this plugin reads or names another plugin's feature: the core checks it at
        boot (:func:`loongkit_core.hookspecs.loongkit_feature_references`), and
        :func:`loongkit_core.testing.conformance.plugin_problems` checks it against the installed
        plugin's declarations. ``handle.find(records)`` gives the feature's record in a process.
        """
        from loongkit_core.feature import FeatureRef

        ref = self._references.setdefault((plugin, name), FeatureRef(plugin, name))
        return ref

    @property
    def references(self) -> list[FeatureRef]:
        """The handles :meth:`refer` gave out, in order."""
        return list(self._references.values())

    @property
    def features(self) -> list[Feature]:
        """Every feature this plugin declares, in declaration order."""
        return list(self._features.values())

    def owns(self, feature: Feature) -> bool:
        return feature.name in self._impl_paths and self._features.get(feature.name) is not None

    # -- hooks -------------------------------------------------------------------------------
    @hookimpl
    def loongkit_declare_features(self) -> list[Feature]:
        return list(self._features.values())

    @hookimpl
    def loongkit_feature_references(self) -> list[FeatureRef]:
        return self.references

    @hookimpl
    def loongkit_hardware_policy(self, hardware: Hardware, features: Sequence[Feature]) -> dict:
        decisions: dict[str, PolicyDecision] = {}
        for fn in self._policies:
            decisions.update(fn(hardware, features) or {})
        return decisions

    @hookimpl
    def loongkit_detect(self, feature: Feature, env: Environment) -> str | None:
        return self.impl(feature).detect(env) if self.owns(feature) else None

    @hookimpl
    def loongkit_configure(self, feature: Feature, env: Environment,
                           policy: PolicyDecision | None) -> tuple[object, list[str]] | None:
        if not self.owns(feature):
            return None
        impl = self.impl(feature)
        config, warnings = impl.configure(env, policy)
        return config, warnings

    @hookimpl
    def loongkit_activate(self, feature: Feature, target: str | None, ctx: ActivationContext) -> None:
        if self.owns(feature):
            self.impl(feature).activate(ctx, target)

    @hookimpl
    def loongkit_deactivate(self, feature: Feature, ctx: ActivationContext) -> None:
        if self.owns(feature):
            self.impl(feature).deactivate(ctx)

    @hookimpl
    def loongkit_summary(self, records: Sequence[FeatureRecord]) -> list[str]:
        lines: list[str] = []
        for fn in self._summary:
            lines.extend(fn(records) or ())
        return lines

    @hookimpl
    def loongkit_launch_environment(self, records: Sequence[FeatureRecord],
                                    environ: Mapping[str, str]) -> dict[str, str]:
        extra: dict[str, str] = {}
        for fn in self._launch_env:
            extra.update(fn(records, environ) or {})
        return extra

    @hookimpl
    def loongkit_add_cli(self, subparsers: Any) -> None:
        for fn in self._cli:
            fn(subparsers)
