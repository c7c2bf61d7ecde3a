"""Plugin discovery and isolated hook calls.

pluggy loads entry points without isolation and stops a hook call at the first raising hookimpl;
here every entry point is loaded on its own and every hook is called plugin by plugin, so one broken
plugin only ever touches its own features. Faults are collected as :class:`Fault` records for the
log and the Summary.
"""

from __future__ import annotations

import importlib.metadata
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pluggy

from loongkit_core import hookspecs


@dataclass
class Fault:
    """Something a plugin did wrong: where, what, and the traceback."""

    plugin: str
    where: str  # "load", hook name, or "import hook"
    error: str
    traceback: str = ""
    feature: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"plugin": self.plugin, "where": self.where, "error": self.error, "feature": self.feature}


@dataclass
class LoadedPlugin:
    name: str
    distribution: str
    version: str
    obj: Any


@dataclass
class PluginManager:
    """Wraps a ``pluggy.PluginManager`` of project ``loongkit`` with per-plugin isolation."""

    pm: pluggy.PluginManager = field(default_factory=lambda: pluggy.PluginManager(hookspecs.PROJECT))
    plugins: dict[str, LoadedPlugin] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    on_fault: Callable[[Fault], None] | None = None
    # LOONGKIT_DISABLE_PLUGINS: installed plugins left unloaded (entry-point name -> distribution), and
    # names that matched no installed plugin. Nothing of a disabled plugin is imported.
    disabled: dict[str, str] = field(default_factory=dict)
    disabled_unmatched: list[str] = field(default_factory=list)
    installed: list[str] = field(default_factory=list)  # every entry-point name found, loaded or not

    def __post_init__(self) -> None:
        self.pm.add_hookspecs(hookspecs)

    def fault(self, plugin: str, where: str, exc: BaseException, feature: str | None = None) -> Fault:
        f = Fault(plugin, where, f"{type(exc).__name__}: {exc}",
                  "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), feature)
        self.faults.append(f)
        if self.on_fault is not None:
            self.on_fault(f)
        return f

    # -- discovery -------------------------------------------------------------------------------
    def load_entry_points(self, disabled: set[str] | None = None) -> None:
        """Load every ``loongkit`` entry point; one that fails is a fault, not an error."""
        try:
            eps = importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)
        except Exception as exc:  # broken metadata of some unrelated distribution
            self.fault("<entry points>", "load", exc)
            return
        seen: set[str] = set()
        for ep in sorted(eps, key=lambda e: e.name):
            if ep.name in seen:
                continue
            seen.add(ep.name)
            dist = getattr(ep, "dist", None)
            dist_name = getattr(dist, "name", "") or ""
            version = getattr(dist, "version", "") or ""
            if disabled and ep.name in disabled:
                self.disabled[ep.name] = dist_name
                continue
            try:
                obj = ep.load()
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    raise
                self.fault(ep.name, "load", exc)
                continue
            self.register(ep.name, obj, dist_name, version)
        self.installed = sorted(seen)
        self.disabled_unmatched = sorted((disabled or set()) - seen)

    def register(self, name: str, obj: Any, distribution: str = "", version: str = "") -> bool:
        """Register a plugin object or module; refuse one built for an incompatible core."""
        api = getattr(obj, "LOONGKIT_CORE_API", (1, 1))
        try:
            low, high = api
            compatible = low <= hookspecs.CORE_API_VERSION <= high
        except (TypeError, ValueError):
            compatible = False
        if not compatible:
            self.fault(name, "load", RuntimeError(
                f"built for loongkit core API {api!r}, this core provides {hookspecs.CORE_API_VERSION}"))
            return False
        try:
            self.pm.register(obj, name=name)
        except BaseException as exc:  # pluggy validates hookimpl signatures here
            if isinstance(exc, KeyboardInterrupt):
                raise
            self.fault(name, "load", exc)
            return False
        self.plugins[name] = LoadedPlugin(name, distribution, version, obj)
        return True

    # -- calling -----------------------------------------------------------------------------
    def _impls(self, hook: str, plugin: str | None = None) -> Iterator[tuple[str, Callable[..., Any]]]:
        caller = getattr(self.pm.hook, hook)
        # pluggy calls the last registered first; keep its order (tryfirst/trylast included).
        for impl in reversed(caller.get_hookimpls()):
            if impl.hookwrapper or getattr(impl, "wrapper", False):
                continue
            if plugin is None or impl.plugin_name == plugin:
                yield impl.plugin_name, impl.function

    def call_each(self, hook: str, feature: str | None = None, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call ``hook`` on every plugin, isolated; return ``(plugin, result)`` of the ones that ran."""
        results = []
        for name, fn in self._impls(hook):
            try:
                result = fn(**_accepted(fn, kwargs))
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    raise
                self.fault(name, hook, exc, feature)
                continue
            if result is not None:
                results.append((name, result))
        return results

    def call_owner(self, plugin: str, hook: str, **kwargs: Any) -> Any:
        """Call ``hook`` on one plugin only; exceptions propagate (the caller records them)."""
        result = None
        for _, fn in self._impls(hook, plugin):
            out = fn(**_accepted(fn, kwargs))
            if out is not None and result is None:
                result = out
        return result


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """pluggy passes only the arguments a hookimpl names; do the same."""
    names = getattr(fn, "__code__", None)
    if names is None:
        return kwargs
    argnames = fn.__code__.co_varnames[: fn.__code__.co_argcount + fn.__code__.co_kwonlyargcount]
    return {k: v for k, v in kwargs.items() if k in argnames}
