"""Post-import hooks: run a callback when a module finishes importing, or at once if it has.

A meta-path finder looks only for watched names; for them it asks the rest of ``sys.meta_path`` for
the real spec and wraps its loader so that callbacks fire after ``exec_module``. The module's
``__loader__`` and ``__spec__.loader`` are put back to the real loader afterwards, so nothing
downstream sees the wrapper.

A callback for a submodule (``torch.utils.data``) that finishes while its top-level package is
still initialising (``torch/__init__`` imports it) waits until the package is complete, so the
callback never sees a half-built ``torch``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import ModuleType

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at boot (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    import importlib.machinery
    from typing import Any

Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_callbacks: dict[str, list[Callback]] = {}
_pending_on_root: dict[str, list[str]] = {}  # root package -> submodules that finished early
_local = threading.local()
_completed: set[str] = set()  # modules whose exec_module returned under our watch
_inflight: dict[str, list[Callback]] = {}  # registered while importing outside our loader
_error_handler: Callable[[str, Callback, BaseException], None] | None = None


def set_error_handler(handler: Callable[[str, Callback, BaseException], None] | None) -> None:
    """Who hears about a callback that raised (the core logs it against the feature)."""
    global _error_handler
    _error_handler = handler


# Plain classes, not importlib.abc's: in Python 3.11 importing importlib.abc imports importlib.resources,
# tempfile, shutil, random at every boot; the import system only needs the methods.
class _ChainedLoader:
    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        # Put the real loader back before executing: code inside the module may inspect it.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _fire(self._name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _Finder:
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if _inflight:
            _check_inflight()
        if fullname not in _callbacks:
            return None
        busy: set[str] = getattr(_local, "busy", None) or set()
        if fullname in busy:
            return None
        busy.add(fullname)
        _local.busy = busy
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            busy.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ChainedLoader(spec.loader, fullname)
        return spec


_finder = _Finder()


def _ensure_finder() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def _initialising(name: str) -> bool:
    if name in _completed:
        return False
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _fire(name: str) -> None:
    # importlib clears spec._initializing only after exec_module returns; we are inside it.
    _completed.add(name)
    root = name.partition(".")[0]
    if root != name and _initialising(root):
        with _lock:
            _pending_on_root.setdefault(root, []).append(name)
        return
    module = sys.modules.get(name)
    if module is None:
        return
    parent_name, _, child = name.rpartition(".")
    parent = sys.modules.get(parent_name) if parent_name else None
    if parent is not None and getattr(parent, child, None) is not module:
        # importlib binds a submodule to its package only after exec_module returns; callbacks run
        # inside it, and `import a.b as m` / `a.b` must already work there.
        try:
            setattr(parent, child, module)
        except (AttributeError, TypeError):
            pass
    with _lock:
        callbacks = _callbacks.pop(name, [])
        later = _pending_on_root.pop(name, []) if root == name else []
    for callback in callbacks:
        _run(name, callback, module)
    for sub in later:
        _fire(sub)


def _run(name: str, callback: Callback, module: ModuleType) -> None:
    try:
        callback(module)
    except BaseException as exc:  # a hook must never break the user's import
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        if _error_handler is not None:
            _error_handler(name, callback, exc)


def _check_inflight() -> None:
    """Fire callbacks of modules that were mid-import (not under our loader) when registered and have
    finished since; checked at every later import, which is when anything could depend on them."""
    with _lock:
        done = [name for name in _inflight
                if name in sys.modules and not _initialising(name)
                and not _initialising(name.partition(".")[0])]
        ready = [(name, _inflight.pop(name)) for name in done]
    for name, callbacks in ready:
        _completed.add(name)
        for callback in callbacks:
            _run(name, callback, sys.modules[name])


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` is fully imported; now if it already is."""
    module = sys.modules.get(name)
    root = name.partition(".")[0]
    if module is not None and not _initialising(name) and not (root != name and _initialising(root)):
        _run(name, callback, module)
        return
    if module is not None and not isinstance(getattr(module.__spec__, "loader", None), _ChainedLoader) \
            and name not in _callbacks:
        # Registered while the module itself is importing (its loader is not ours): fire at the
        # next import after it completes.
        with _lock:
            _inflight.setdefault(name, []).append(callback)
            _ensure_finder()
        return
    with _lock:
        _callbacks.setdefault(name, []).append(callback)
        if root != name:
            # Watch the package too, so a submodule finishing inside its __init__ waits for it.
            _callbacks.setdefault(root, [])
        _ensure_finder()


def watched() -> list[str]:
    with _lock:
        return [name for name, cbs in _callbacks.items() if cbs] + list(_inflight)


def reset() -> None:
    """Forget every pending hook and remove the finder (tests)."""
    with _lock:
        _callbacks.clear()
        _pending_on_root.clear()
        _completed.clear()
        _inflight.clear()
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
