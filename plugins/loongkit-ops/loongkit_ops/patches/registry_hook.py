"""Class-level convenience over :mod:`.registry_watch` for features that look at every registered class.

DAG and BEVFUSION want each class registered in any mmengine / mmcv 1.x registry (they match by
structure: a DeformableFeatureAggregation, a subclass of BEVFusion's BaseTransform), not by one
name. They subscribe through the same shared ``Registry._register_module`` wrapper as BEVFORMER and
UNIAD, so all four features can come and go in any order without restoring each other's wrappers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_ops.patches import registry_watch


def watch_registrations(ctx: ActivationContext, registry_module: Any,
                        callback: Callable[[type], None]) -> Callable[[str, type], None]:
    """Call ``callback(cls)`` once per class registered in any ``registry_module.Registry``, from now on
    and for the classes already registered; return the subscription for :func:`stop`.

    Raises NotApplicable when the module has no Registry of the expected shape.
    """
    registry_cls = getattr(registry_module, "Registry", None)
    problem = registry_watch.registry_problem(registry_cls)
    if problem is not None:
        raise NotApplicable(f"interface differs: {registry_module.__name__}: {problem}")
    seen: set[int] = set()

    def on_register(name: str, cls: type) -> None:
        if id(cls) in seen:  # registry_watch reports a class under each of its names
            return
        seen.add(id(cls))
        callback(cls)

    registry_watch.subscribe(registry_cls, on_register, ctx.log)
    for name, cls in registry_watch.all_registered(registry_cls):
        try:
            on_register(name, cls)
        except Exception as exc:  # same rule as for new registrations: log, never raise
            ctx.log.warning("registered class not patched (error in the check)",
                            cls=getattr(cls, "__qualname__", cls), error=f"{type(exc).__name__}: {exc}")
    return on_register


def stop(subscription: Callable[[str, type], None] | None) -> None:
    if subscription is not None:
        registry_watch.unsubscribe(subscription)
