"""Class patches of the compile features: ``__init__`` handing each new instance to a compile step, and a
method dispatching compiled instances to their compiled call."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from loongkit_core.context import ActivationContext
from loongkit_ops.compile.common import Compiler


def after_init(ctx: ActivationContext, cls: type, compiler: Compiler, step: Callable[[Any], None]) -> None:
    """Patch ``cls.__init__`` (its own, through ``ctx.patcher``) to run ``step(instance)`` after it.

    Only instances whose construction ran this very ``__init__`` last are handed over once: a subclass
    calling ``super().__init__()`` gets the step when the base ``__init__`` returns (its own ``__init__``
    may still change modules afterwards; those changes stay eager, which is always correct).
    """
    original = cls.__init__

    def __init__(obj: Any, *args: Any, **kwargs: Any) -> None:
        original(obj, *args, **kwargs)
        try:
            step(obj)
        except Exception as exc:  # a fault here must leave the model as its library built it (eager)
            ctx.log.error("compile setup failed; module left eager", cls=type(obj).__name__, error=repr(exc))
            compiler.keep_eager(type(obj).__name__, f"setup failed: {exc!r}"[:200])

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    for attr in ("__doc__", "__qualname__", "__module__", "__name__"):
        setattr(__init__, attr, getattr(original, attr, None))
    ctx.patcher.patch(cls, "__init__", __init__)


class CompiledMethod:
    """``cls.<name>`` patched (through ``ctx.patcher``) to run an instance's compiled call where one was
    installed with :meth:`install`, and the original method for every other instance.

    For a method the training loop calls directly: lerobot's ``PI0Policy.forward`` computes the loss with
    ``self.model.forward(...)``, which never reaches ``nn.Module.__call__`` (nor so a compiled
    ``_compiled_call_impl``). A module *called* reaches the same method through ``_call_impl``, so both
    ways of calling are covered, with the module's hooks still run by ``__call__`` as before.

    The compiled calls live in a weak mapping keyed by instance, not on the instance: ``copy.deepcopy``
    (an EMA copy) and pickling see no trace of them and give plain eager copies, as the compiled slot
    does; undo restores the class attribute and so drops them all.
    """

    def __init__(self, ctx: ActivationContext, cls: type, name: str) -> None:
        original = cls.__dict__[name]
        calls: weakref.WeakKeyDictionary[Any, Callable[..., Any]] = weakref.WeakKeyDictionary()
        self.original: Callable[..., Any] = original
        self._calls = calls

        def method(obj: Any, *args: Any, **kwargs: Any) -> Any:
            call = calls.get(obj)
            if call is None:
                return original(obj, *args, **kwargs)
            return call(obj, *args, **kwargs)

        functools.update_wrapper(method, original)
        ctx.patcher.patch(cls, name, method)

    def install(self, obj: Any, call: Callable[..., Any]) -> None:
        """``obj.<name>(...)`` (and ``obj(...)`` for a module) runs ``call(obj, ...)`` from now on."""
        self._calls[obj] = call
