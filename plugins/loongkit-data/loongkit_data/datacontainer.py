"""LOONGKIT_DATA_CONTAINER: mmcv 1.x DataContainer learns pin_memory; mmdet 2.x loaders pin.

torch's DataLoader pins a batch with ``torch.utils.data._utils.pin_memory.pin_memory``, which calls
an object's own ``pin_memory()`` (no arguments) when it has one and otherwise returns it unpinned.
mmcv's DataContainer has none, so batches collated by ``mmcv.parallel.collate`` (a dict of
DataContainers) were never pinned even with ``pin_memory=True``. ``DataContainer.pin_memory`` is
added: it returns a new DataContainer with the same stack/cpu_only/padding_value/pad_dims whose
tensors are pinned; ``cpu_only`` data (image metas) is returned as is.

mmdet 2.x's ``build_dataloader`` passes ``pin_memory=kwargs.pop('pin_memory', False)``: the wrapper
adds ``pin_memory=True`` when the caller did not choose (an explicit ``pin_memory=False`` in the
config's ``train_dataloader`` is kept) and a CUDA device exists at call time. Without one torch
cannot pin (``Tensor.pin_memory`` raises, DataLoader ignores the flag with a warning), so loaders
are left as they were and the Summary says why.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl
from loongkit_data.prefetch import map_tensors

# Modules that bind mmdet 2.x's build_dataloader by name (``from mmdet.datasets import build_dataloader``).
BUILDER_USERS = ("mmdet.datasets", "mmdet.apis.train")
NO_CUDA = "no CUDA device: torch cannot pin memory, DataLoader pin_memory left as configured"


def make_pin_memory(on_pin: Callable[[], None] | None = None) -> Callable[[Any], Any]:
    """The ``pin_memory`` method for a DataContainer class."""

    def pin_memory(self: Any) -> Any:
        if self.cpu_only:
            return self  # metas and other host-only objects are never pinned
        import torch

        pinned = map_tensors(self.data, lambda t: t.pin_memory(), lambda x: isinstance(x, torch.Tensor))
        if on_pin is not None:
            on_pin()
        return type(self)(pinned, stack=self.stack, padding_value=self.padding_value, cpu_only=self.cpu_only,
                          pad_dims=self.pad_dims)

    return pin_memory


def pinning_possible() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())  # what DataLoader itself checks on torch >= 2.6
    return bool(torch.cuda.is_available())


def wrap_build_dataloader(original: Callable[..., Any], possible: Callable[[], bool] = pinning_possible,
                          on_skip: Callable[[str], None] | None = None,
                          enabled: Callable[[], bool] = lambda: True) -> Callable[..., Any]:
    """``build_dataloader`` that adds ``pin_memory=True``; a plain call-through while ``enabled()`` is False
    (modules that copied the name with ``from ... import`` keep the wrapper after an undo)."""

    def build_dataloader(*args: Any, **kwargs: Any) -> Any:
        if enabled() and "pin_memory" not in kwargs:
            if possible():
                kwargs["pin_memory"] = True
            elif on_skip is not None:
                on_skip(NO_CUDA)
        return original(*args, **kwargs)

    build_dataloader.__wrapped__ = original  # type: ignore[attr-defined]
    build_dataloader.__loongkit_original__ = original  # type: ignore[attr-defined]
    build_dataloader.__name__ = getattr(original, "__name__", "build_dataloader")
    build_dataloader.__doc__ = getattr(original, "__doc__", None)
    return build_dataloader


def patch_builder(patcher: Any, builder: Any, wrapper: Callable[..., Any]) -> list[str]:
    """Replace ``builder.build_dataloader`` and every already-imported module's binding of it: the
    original, or the wrapper of an earlier activation that the module copied by name (switched off by
    that activation's undo; never someone else's wrapper)."""
    original = getattr(builder, "build_dataloader", None)
    if not callable(original):
        raise NotApplicable(f"{builder.__name__}.build_dataloader not found (mmdet changed)")
    patcher.patch(builder, "build_dataloader", wrapper)
    done = [builder.__name__]
    for name in BUILDER_USERS:
        module = sys.modules.get(name)
        bound = getattr(module, "build_dataloader", None)
        if module is not None and (bound is original or getattr(bound, "__loongkit_original__", None) is original):
            patcher.patch(module, "build_dataloader", wrapper)
            done.append(name)
    return done


def bound_to(wrapper: Callable[..., Any]) -> list[str]:
    """The modules of BUILDER_USERS whose ``build_dataloader`` is ``wrapper``."""
    return [name for name in BUILDER_USERS if getattr(sys.modules.get(name), "build_dataloader", None) is wrapper]


class DataContainerPin(FeatureImpl):
    """The patches go through ``ctx.patcher``. The import callback for mmdet (which cannot be
    unregistered) and the wrappers that modules copied by name check this activation's switch, turned
    on with ``ctx.patcher.assign``: the default ``deactivate`` makes them plain call-throughs, and a
    callback left over from an earlier activation stays off when the feature is activated again."""

    def detect(self, env: Any) -> str | None:
        return None  # pinning happens in the training process; without CUDA the Summary says so at run time

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        # ``import mmcv.parallel as ...`` falls back to sys.modules: this runs right after mmcv.parallel's
        # body, before importlib binds it as an attribute of mmcv, so ``mmcv.parallel`` would raise.
        import mmcv.parallel as parallel

        cls = getattr(parallel, "DataContainer", None)
        if cls is None or not all(isinstance(getattr(cls, p, None), property)
                                  for p in ("data", "cpu_only", "stack", "padding_value", "pad_dims")):
            raise NotApplicable("mmcv.parallel.DataContainer is not the 1.x container (data/cpu_only/stack/"
                                "padding_value/pad_dims properties)")
        if "pin_memory" in cls.__dict__:
            raise NotApplicable("mmcv.parallel.DataContainer already has pin_memory")

        ctx.patcher.patch(cls, "pin_memory", make_pin_memory(ctx.count), require=False)
        switch = ctx.scratch  # live until the undo: the import hook and copies of the wrapper then do nothing
        loaders: list[str] = []
        ctx.set_config({"DataContainer.pin_memory": True, "build_dataloader": loaders})
        skipped: set[str] = set()

        def on_skip(reason: str) -> None:
            ctx.waiting(reason)
            if reason not in skipped:  # one log line per distinct reason
                skipped.add(reason)
                ctx.log.info("DataLoader pin_memory not turned on", reason=reason)

        wrapper_holder: dict[str, Any] = {}

        def note_copies() -> None:
            # Modules that import the name after the builder was patched (mmdet.datasets' own __init__,
            # which is still running when the builder's hook fires, and mmdet.apis.train) copy the
            # wrapper itself; list them for the Summary once they exist.
            if switch.live and "w" in wrapper_holder:
                loaders.extend(name for name in bound_to(wrapper_holder["w"]) if name not in loaders)

        def on_builder(builder: Any) -> None:
            if not switch.live:
                return
            original = getattr(builder, "build_dataloader", None)
            if not callable(original):
                ctx.log.warning("mmdet build_dataloader not found; its loaders keep pin_memory=False")
                return
            wrapper = wrapper_holder.setdefault(
                "w", wrap_build_dataloader(original, on_skip=on_skip, enabled=lambda: switch.live))
            loaders.extend(patch_builder(ctx.patcher, builder, wrapper))
            ctx.at_exit(note_copies)
            ctx.log.info("mmdet build_dataloader turns on pin_memory", patched=loaders)

        ctx.on_import("mmdet.datasets.builder", on_builder)
        if not pinning_possible():
            ctx.waiting(NO_CUDA)
        ctx.log.info("DataContainer.pin_memory installed", cuda=pinning_possible())
