"""Wrap a class's ``__init__`` so that each new instance is handed to a compile step afterwards."""

from __future__ import annotations

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
