"""See the classes that projects register in mmcv 1.x / mmengine registries, when they register.

BEVFormer, UniAD and their forks are vendored (``projects/mmdet3d_plugin/...``), not installed, so
the only stable place where their classes enter is a registry: ``@ATTENTION.register_module()``
(mmcv 1.x, ``mmcv.utils.registry.Registry``) or ``@MODELS.register_module()`` (mmengine /
mmcv 2.x ports, ``mmengine.registry.Registry``). Both route every registration, decorator or call
form, through ``Registry._register_module``; that method is wrapped on the Registry class (so every
instance, child and scope sees it) and the wrapper tells subscribers about each registered class.
Classes registered before the hook was installed are found by :func:`registered_classes`.

One wrapper per Registry class is shared by every subscribing feature (BEVFORMER and UNIAD watch the
same names), so features can subscribe and leave in any order; the original method is put back when
the last subscriber leaves. A subscriber's exception is logged and swallowed: a registration (the
user's import) never fails because of loongkit.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

Callback = Callable[[str, type], None]

_lock = threading.RLock()
_originals: dict[type, tuple[Any, bool]] = {}  # Registry class -> (_register_module, was in its __dict__)
_subscribers: dict[type, list[tuple[Callback, Any]]] = {}  # Registry class -> (callback, logger)


def _registered(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, list[str]]:
    """(class, names) of one ``_register_module`` call: mmcv 1.x says module_class, mmengine module."""
    cls = args[0] if args else kwargs.get("module_class", kwargs.get("module"))
    given = args[1] if len(args) > 1 else kwargs.get("module_name")
    names = [given] if isinstance(given, str) else list(given or [])
    if isinstance(cls, type):
        names.append(cls.__name__)
    return cls, names


def _make_wrapper(registry_cls: type, original: Any) -> Any:
    def _register_module(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        cls, names = _registered(args, kwargs)
        if isinstance(cls, type):
            for callback, logger in list(_subscribers.get(registry_cls, ())):
                for name in dict.fromkeys(names):
                    try:
                        callback(name, cls)
                    except Exception as exc:  # never break the user's import
                        logger.warning("registry hook failed", cls=getattr(cls, "__qualname__", cls),
                                       error=f"{type(exc).__name__}: {exc}")
        return result

    _register_module.__loongkit_original__ = original  # type: ignore[attr-defined]
    _register_module.__wrapped__ = original  # type: ignore[attr-defined]
    return _register_module


def registry_problem(registry_cls: Any) -> str | None:
    """None when ``registry_cls`` looks like an mmcv 1.x / mmengine Registry, else what differs."""
    if not isinstance(registry_cls, type):
        return "no Registry class"
    if not callable(getattr(registry_cls, "_register_module", None)):
        return f"{registry_cls.__qualname__} has no _register_module"
    if not isinstance(getattr(registry_cls, "module_dict", None), property):
        return f"{registry_cls.__qualname__} has no module_dict property"
    return None


def subscribe(registry_cls: type, callback: Callback, logger: Any) -> None:
    """Call ``callback(name, cls)`` for every class registered in any ``registry_cls`` from now on."""
    with _lock:
        if registry_cls not in _originals:
            in_dict = "_register_module" in vars(registry_cls)
            original = vars(registry_cls)["_register_module"] if in_dict else registry_cls._register_module
            _originals[registry_cls] = (original, in_dict)
            registry_cls._register_module = _make_wrapper(registry_cls, original)  # type: ignore[attr-defined]
        _subscribers.setdefault(registry_cls, []).append((callback, logger))


def unsubscribe(callback: Callback) -> None:
    """Stop calling ``callback``; unhook Registry classes nobody watches any more."""
    with _lock:
        for registry_cls in list(_subscribers):
            kept = [(cb, lg) for cb, lg in _subscribers[registry_cls] if cb != callback]  # bound methods: ==
            if kept:
                _subscribers[registry_cls] = kept
                continue
            del _subscribers[registry_cls]
            original, in_dict = _originals.pop(registry_cls)
            current = vars(registry_cls).get("_register_module")
            if getattr(current, "__loongkit_original__", None) is not original:
                continue  # someone replaced the method after us: theirs stays, ours is gone already
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


def all_registered(registry_cls: type) -> list[tuple[str, type]]:
    """(name, class) of every class already registered in a live ``registry_cls`` instance."""
    found: list[tuple[str, type]] = []
    for registry in _registries(registry_cls):
        table = getattr(registry, "_module_dict", None)
        if isinstance(table, dict):
            found.extend((key, cls) for key, cls in list(table.items()) if isinstance(cls, type))
    return found


def registered_classes(registry_cls: type, names: frozenset[str]) -> list[tuple[str, type]]:
    """(name, class) already registered under, or with a class named, one of ``names``."""
    found: list[tuple[str, type]] = []
    for registry in _registries(registry_cls):
        table = getattr(registry, "_module_dict", None)
        if not isinstance(table, dict):
            continue
        for key, cls in list(table.items()):
            if not isinstance(cls, type):
                continue
            for name in dict.fromkeys((key, cls.__name__)):
                if name in names:
                    found.append((name, cls))
    return found
