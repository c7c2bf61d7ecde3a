"""See the classes that projects register in mmcv 1.x / mmengine registries, when they register.

BEVFormer, UniAD, Sparse4D, BEVFusion and their forks are vendored (``projects/mmdet3d_plugin/...``),
not installed, so the only stable place where their classes enter is a registry:
``@ATTENTION.register_module()`` (mmcv 1.x, ``mmcv.utils.registry.Registry``) or
``@MODELS.register_module()`` (mmengine / mmcv 2.x ports, ``mmengine.registry.Registry``). Both route
every registration, decorator or call form, through ``Registry._register_module``; that method is
wrapped on the Registry class (so every instance, child and scope sees it) and the wrapper tells
subscribers about each registered class. Classes registered before the subscription are found in the
live registries reachable from loaded modules (and mmengine's children).

One wrapper per Registry class is shared by every subscribing feature (BEVFORMER, UNIAD, DAG and
BEVFUSION watch the same registries), so features can subscribe and leave in any order; the original
method is put back when the last subscriber leaves. A subscription ends with its feature's
``ctx.patcher.undo()`` (the default ``deactivate``). A subscriber's exception is logged and swallowed:
a registration (the user's import) never fails because of loongkit.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Collection, Iterator
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable

Callback = Callable[[str, type], None]

_lock = threading.RLock()
_originals: dict[type, tuple[Any, bool]] = {}  # Registry class -> (_register_module, was in its __dict__)
_subscribers: dict[type, list[Subscription]] = {}  # Registry class -> its live subscriptions


class Subscription:
    """``callback(name, cls)`` for the classes registered in one Registry class (all of them, or those
    registered under or named one of ``names``). :meth:`close` ends it; closing twice is harmless."""

    def __init__(self, registry_cls: type, callback: Callback, names: frozenset[str] | None, logger: Any) -> None:
        self.registry_cls = registry_cls
        self.callback = callback
        self.names = names
        self.log = logger
        self.closed = False

    def notify(self, cls: type, names: list[str]) -> None:
        for name in dict.fromkeys(names):
            if self.closed or (self.names is not None and name not in self.names):
                continue
            try:
                self.callback(name, cls)
            except Exception as exc:  # never break the user's import
                self.log.warning("registry hook failed", cls=getattr(cls, "__qualname__", cls),
                                 error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        with _lock:
            if self.closed:
                return
            self.closed = True
            live = [s for s in _subscribers.get(self.registry_cls, ()) if s is not self]
            if live:
                _subscribers[self.registry_cls] = live
                return
            _subscribers.pop(self.registry_cls, None)
            _unhook(self.registry_cls)


def registry_problem(registry_cls: Any) -> str | None:
    """None when ``registry_cls`` looks like an mmcv 1.x / mmengine Registry, else what differs."""
    if not isinstance(registry_cls, type):
        return "no Registry class"
    if not callable(getattr(registry_cls, "_register_module", None)):
        return f"{registry_cls.__qualname__} has no _register_module"
    if not isinstance(getattr(registry_cls, "module_dict", None), property):
        return f"{registry_cls.__qualname__} has no module_dict property"
    return None


def watch(ctx: ActivationContext, registry_module: Any, callback: Callback,
          names: Collection[str] | None = None) -> Subscription:
    """Call ``callback(name, cls)`` for every class registered in any ``registry_module.Registry``: those
    registered already, then each new registration (under each of its names, and its class name). With
    ``names``, only for those names. Ends at ``ctx.patcher.undo()``.

    Raises NotApplicable when the module has no Registry of the expected shape.
    """
    registry_cls = getattr(registry_module, "Registry", None)
    problem = registry_problem(registry_cls)
    if problem is not None:
        raise NotApplicable(f"interface differs: {registry_module.__name__}: {problem}")
    assert isinstance(registry_cls, type)
    subscription = Subscription(registry_cls, callback, None if names is None else frozenset(names), ctx.log)
    with _lock:
        _hook(registry_cls)
        _subscribers.setdefault(registry_cls, []).append(subscription)
    ctx.patcher.defer(subscription.close)
    for key, cls in registered(registry_cls):
        subscription.notify(cls, [key, cls.__name__])
    return subscription


def watch_registrations(ctx: ActivationContext, registry_module: Any,
                        callback: Callable[[type], None]) -> Subscription:
    """:func:`watch` for features that match by structure, not name: ``callback(cls)`` once per class."""
    seen: weakref.WeakSet[type] = weakref.WeakSet()

    def once(name: str, cls: type) -> None:
        if cls not in seen:  # a class is reported under each of its names
            seen.add(cls)
            callback(cls)

    return watch(ctx, registry_module, once)


def stop(subscription: Subscription | None) -> None:
    """End ``subscription`` before the feature's undo (which ends it anyway)."""
    if subscription is not None:
        subscription.close()


def hooked() -> list[type]:
    """The Registry classes whose ``_register_module`` is wrapped now."""
    with _lock:
        return list(_originals)


def registered(registry_cls: type) -> list[tuple[str, type]]:
    """(name, class) of every class already registered in a live ``registry_cls`` instance."""
    found: list[tuple[str, type]] = []
    for registry in _registries(registry_cls):
        table = getattr(registry, "_module_dict", None)
        if isinstance(table, dict):
            found.extend((key, cls) for key, cls in list(table.items()) if isinstance(cls, type))
    return found


# -- the shared wrapper ------------------------------------------------------------------------------


def _registered(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, list[str]]:
    """(class, names) of one ``_register_module`` call: mmcv 1.x says module_class, mmengine module."""
    cls = args[0] if args else kwargs.get("module_class", kwargs.get("module"))
    given = args[1] if len(args) > 1 else kwargs.get("module_name")
    names = [given] if isinstance(given, str) else list(given or [])
    if isinstance(cls, type):
        names.append(cls.__name__)
    return cls, names


def _hook(registry_cls: type) -> None:
    if registry_cls in _originals:
        return
    in_dict = "_register_module" in vars(registry_cls)
    original = vars(registry_cls)["_register_module"] if in_dict else registry_cls._register_module

    def _register_module(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        cls, names = _registered(args, kwargs)
        if isinstance(cls, type):
            for subscription in list(_subscribers.get(registry_cls, ())):
                subscription.notify(cls, names)
        return result

    _register_module.__loongkit_original__ = original  # type: ignore[attr-defined]
    _register_module.__wrapped__ = original  # type: ignore[attr-defined]
    _originals[registry_cls] = (original, in_dict)
    registry_cls._register_module = _register_module  # type: ignore[attr-defined]


def _unhook(registry_cls: type) -> None:
    original, in_dict = _originals.pop(registry_cls)
    current = vars(registry_cls).get("_register_module")
    if getattr(current, "__loongkit_original__", None) is not original:
        return  # someone replaced the method after us: theirs stays, ours is gone already
    if in_dict:
        registry_cls._register_module = original  # type: ignore[attr-defined]
    else:
        delattr(registry_cls, "_register_module")


def _registries(registry_cls: type) -> Iterator[Any]:
    """Every live ``registry_cls`` instance reachable from a loaded module (and mmengine's children)."""
    seen: set[int] = set()
    stack: list[Any] = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for value in list(namespace.values()):
            if issubclass(type(value), registry_cls) and id(value) not in seen:
                seen.add(id(value))
                stack.append(value)
    while stack:
        registry = stack.pop()
        yield registry
        for child in list((getattr(registry, "_children", None) or {}).values()):
            if isinstance(child, registry_cls) and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
