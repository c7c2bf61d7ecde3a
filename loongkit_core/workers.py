"""Run callbacks at the start of every torch DataLoader worker (fork, spawn and forkserver).

Features that act in data workers (NUMA data affinity, allocator tuning, thread caps) register
here. The core wraps ``torch.utils.data._utils.worker._worker_loop`` once, when that module is
imported. Spawned workers unpickle ``_worker_loop`` by name, so with the prelude in the child they
get the wrapped function too, and their features registered the same callbacks at boot.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from loongkit_core import importhooks
from loongkit_core.patcher import Patcher

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at boot (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    from typing import Any

TARGET = "torch.utils.data._utils.worker"

_callbacks: list[tuple[str, Callable[[int], None]]] = []
_exit_callbacks: list[tuple[str, Callable[[int], None]]] = []
_patcher = Patcher()
_errors: list[tuple[str, BaseException]] = []
_error_handler: Callable[[str, BaseException], None] | None = None


def set_error_handler(handler: Callable[[str, BaseException], None] | None) -> None:
    global _error_handler
    _error_handler = handler


def on_worker_start(callback: Callable[[int], None], owner: str = "") -> None:
    """Call ``callback(worker_id)`` first thing in each DataLoader worker (errors are isolated)."""
    _callbacks.append((owner, callback))
    importhooks.when_imported(TARGET, _install)


def on_worker_exit(callback: Callable[[int], None], owner: str = "") -> None:
    """Call ``callback(worker_id)`` when a DataLoader worker's loop returns (it was told to stop;
    a worker killed by a signal never gets here)."""
    _exit_callbacks.append((owner, callback))
    importhooks.when_imported(TARGET, _install)


def forget(callback: Callable[[int], None]) -> None:
    """Unregister ``callback`` (start and exit lists, every registration of it; ``ActivationContext``
    does this at the feature's undo). The worker loop stays wrapped: with no callbacks it only calls
    through."""
    _callbacks[:] = [entry for entry in _callbacks if entry[1] is not callback]
    _exit_callbacks[:] = [entry for entry in _exit_callbacks if entry[1] is not callback]


def run_callbacks(worker_id: int, callbacks: list[tuple[str, Callable[[int], None]]] | None = None) -> None:
    for owner, callback in list(_callbacks if callbacks is None else callbacks):
        try:
            callback(worker_id)
        except Exception as exc:  # a feature must never kill a data worker
            _errors.append((owner, exc))
            if _error_handler is not None:
                try:
                    _error_handler(owner, exc)
                except Exception:
                    pass


def _install(module: ModuleType) -> None:
    if _patcher.patched:
        return
    original = module._worker_loop
    import inspect  # here, not at boot: torch has imported it by now; a booting process has not

    try:
        position = list(inspect.signature(original).parameters).index("worker_id")
    except (TypeError, ValueError) as exc:
        raise RuntimeError(f"{TARGET}._worker_loop has no worker_id parameter; cannot hook workers") from exc

    def _worker_loop(*args: Any, **kwargs: Any) -> Any:
        worker_id = kwargs["worker_id"] if "worker_id" in kwargs else args[position]
        run_callbacks(int(worker_id))
        try:
            return original(*args, **kwargs)
        finally:
            run_callbacks(int(worker_id), _exit_callbacks)

    _worker_loop.__wrapped__ = original  # type: ignore[attr-defined]
    _worker_loop.__module__ = original.__module__
    _worker_loop.__qualname__ = original.__qualname__
    _patcher.patch(module, "_worker_loop", _worker_loop)


def uninstall() -> None:
    """Restore the original worker loop and forget callbacks (tests)."""
    _patcher.undo()
    _callbacks.clear()
    _exit_callbacks.clear()
