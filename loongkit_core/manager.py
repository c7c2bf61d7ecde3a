"""Plugin discovery and isolated hook calls.

pluggy loads entry points without isolation and stops a hook call at the first raising hookimpl;
here every entry point is loaded on its own and every hook is called plugin by plugin, so one broken
plugin only ever touches its own features. Faults are collected as :class:`Fault` records for the
log and the Summary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from loongkit_core.record import Record

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at boot (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    from typing import Any

    import pluggy

# pluggy (with the hook specifications) and importlib.metadata are imported when first needed: a process
# that reuses its job's resolution (loongkit_core.resolved) loads a plugin only when one of its
# features activates, and never scans entry points.
ENTRY_POINT_GROUP = "loongkit"  # hookspecs.ENTRY_POINT_GROUP, without importing pluggy


# Plain classes, not dataclasses: every booting process imports this module, and building dataclasses
# (and importing their module) is a boot cost (docs/benchmarks.md, start-up).


class LoongkitStrictError(RuntimeError):
    """A plugin or feature fault under ``LOONGKIT_STRICT=1`` (raised by the runtime's fault handler;
    also ``loongkit_core.runtime.LoongkitStrictError``)."""


class Fault(Record):
    """Something a plugin did wrong: where, what, and the traceback."""

    __slots__ = ("error", "feature", "plugin", "traceback", "where")
    _fields = ("plugin", "where", "error", "traceback", "feature")
    _repr_fields = ("plugin", "where", "error", "feature")  # the traceback is in the log

    def __init__(self, plugin: str, where: str, error: str, traceback: str = "", feature: str | None = None) -> None:
        self.plugin = plugin
        self.where = where  # "load", hook name, or "import hook"
        self.error = error
        self.traceback = traceback
        self.feature = feature

    def to_json(self) -> dict[str, object]:
        return {"plugin": self.plugin, "where": self.where, "error": self.error, "feature": self.feature}


class LoadedPlugin(Record):
    __slots__ = ("distribution", "name", "obj", "version")
    _fields = ("name", "distribution", "version", "obj")
    _repr_fields = ("name", "distribution", "version")

    def __init__(self, name: str, distribution: str, version: str, obj: Any) -> None:
        self.name, self.distribution, self.version, self.obj = name, distribution, version, obj


class PluginManager:
    """Wraps a ``pluggy.PluginManager`` of project ``loongkit`` with per-plugin isolation."""

    def __init__(self, on_fault: Callable[[Fault], None] | None = None) -> None:
        self.plugins: dict[str, LoadedPlugin] = {}
        self.faults: list[Fault] = []
        self.on_fault = on_fault
        # LOONGKIT_DISABLE_PLUGINS: installed plugins left unloaded (entry-point name -> distribution), and
        # names that matched no installed plugin. Nothing of a disabled plugin is imported.
        self.disabled: dict[str, str] = {}
        self.disabled_unmatched: list[str] = []
        self.installed: list[str] = []  # every entry-point name found, loaded or not
        # Entry points found (name -> (value "module:attr", distribution, version)), loaded or not: what a
        # resolution records, and what :meth:`ensure` loads a plugin from in a process that reused one.
        self.entry_points: dict[str, tuple[str, str, str]] = {}
        self._pm: pluggy.PluginManager | None = None
        self._order: dict[str, int] = {}  # restored: entry-point name -> position in a full boot's order
        self._failed: set[str] = set()  # restored plugins that failed to load (not tried again)

    @property
    def pm(self) -> pluggy.PluginManager:
        """The pluggy manager, created (pluggy imported) at the first registration or hook call."""
        if self._pm is None:
            import pluggy

            from loongkit_core import hookspecs

            self._pm = pluggy.PluginManager(hookspecs.PROJECT)
            self._pm.add_hookspecs(hookspecs)
        return self._pm

    def fault(self, plugin: str, where: str, exc: BaseException, feature: str | None = None) -> Fault:
        import traceback  # it brings textwrap: only when something went wrong

        f = Fault(plugin, where, f"{type(exc).__name__}: {exc}",
                  "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), feature)
        self.faults.append(f)
        if self.on_fault is not None:
            self.on_fault(f)
        return f

    # -- discovery -------------------------------------------------------------------------------
    def load_entry_points(self, disabled: set[str] | None = None) -> None:
        """Load every ``loongkit`` entry point; one that fails is a fault, not an error."""
        import importlib.metadata

        try:
            eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
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
            self.entry_points[ep.name] = (ep.value, dist_name, version)
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

    def restore(self, entry_points: dict[str, tuple[str, str, str]], disabled: dict[str, str],
                disabled_unmatched: list[str], installed: list[str]) -> None:
        """What :meth:`load_entry_points` found in the process whose resolution this one reuses; no plugin
        is imported until :meth:`ensure` asks for it."""
        self.entry_points = dict(entry_points)
        self.disabled = dict(disabled)
        self.disabled_unmatched = list(disabled_unmatched)
        self.installed = list(installed)
        self._order = {name: i for i, name in enumerate(sorted(self.entry_points))}

    def ensure(self, name: str) -> bool:
        """Load and register plugin ``name`` from its recorded entry point if not loaded yet; a plugin that
        fails to load is a fault (as at boot) and stays unloaded."""
        if name in self.plugins:
            return True
        found = self.entry_points.get(name)
        if found is None or name in self.disabled or name in self._failed:
            return False
        value, distribution, version = found
        try:
            obj = _load_value(value)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            self._failed.add(name)
            self.fault(name, "load", exc)
            return False
        if not self.register(name, obj, distribution, version):
            self._failed.add(name)
            return False
        return True

    def register(self, name: str, obj: Any, distribution: str = "", version: str = "") -> bool:
        """Register a plugin object or module; refuse one built for an incompatible core."""
        from loongkit_core import hookspecs

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
        if self._pm is None and not self.plugins:
            return  # nothing registered: no reason to import pluggy
        caller = getattr(self.pm.hook, hook)
        # pluggy calls the last registered first; keep its order (tryfirst/trylast included). Plugins
        # loaded on demand (restore/ensure) register in activation order: put them back in the order a
        # full boot registers them (by entry-point name), so Summary lines come in the same order.
        impls = list(reversed(caller.get_hookimpls()))
        if self._order:
            impls.sort(key=lambda impl: -self._order.get(impl.plugin_name, -1))
        for impl in impls:
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


def _load_value(value: str) -> Any:
    """What ``importlib.metadata.EntryPoint.load`` returns for ``value`` ("module:attr.attr [extra]")."""
    import importlib

    module_name, _, attrs = value.partition("[")[0].strip().partition(":")
    obj: Any = importlib.import_module(module_name.strip())
    for attr in filter(None, attrs.strip().split(".")):
        obj = getattr(obj, attr)
    return obj


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """pluggy passes only the arguments a hookimpl names; do the same."""
    names = getattr(fn, "__code__", None)
    if names is None:
        return kwargs
    argnames = fn.__code__.co_varnames[: fn.__code__.co_argcount + fn.__code__.co_kwonlyargcount]
    return {k: v for k, v in kwargs.items() if k in argnames}
