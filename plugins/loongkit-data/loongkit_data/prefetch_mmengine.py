"""LOONGKIT_MMENGINE_DATA_PREFETCH: mmengine's loops get the next batch on the device ahead of time.

While step k runs, batch k+1 is copied to the model's device on a side CUDA stream
(:mod:`loongkit_data.prefetch`). The model's ``data_preprocessor.cast_data`` then calls
``tensor.to(device)`` / ``BaseDataElement.to(device)`` on tensors already there, which returns the
same tensors: the step's host-to-device copy is gone from the critical path.

Patched, each only for the duration of one call on one loop object:

* ``EpochBasedTrainLoop.run_epoch``, ``ValLoop.run``, ``TestLoop.run``: ``self.dataloader`` iterates
  through a :class:`~loongkit_data.prefetch.Prefetcher` (every other attribute, ``len`` included,
  still reaches the real DataLoader);
* ``IterBasedTrainLoop.run``: ``self.dataloader_iterator`` (mmengine's infinite iterator) is
  wrapped; the batches a resumed run skips are not copied, and nothing is pulled beyond
  ``max_iters``.

The device is the model's data preprocessor's (what ``cast_data`` moves to). A model on the CPU, or
no usable CUDA at run time, leaves the loop untouched (the Summary says why). Subclasses that
override these methods keep their own iteration.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl
from loongkit_data.prefetch import CudaLayer, DeviceLayer, Prefetcher, PrefetchingLoader, PrefetchReport, no_cuda_reason

LayerFor = Callable[[Any], "DeviceLayer | None"]

# (class name, method, the attribute of the loop that the method iterates)
PATCHES = (
    ("EpochBasedTrainLoop", "run_epoch", "dataloader"),
    ("IterBasedTrainLoop", "run", "dataloader_iterator"),
    ("ValLoop", "run", "dataloader"),
    ("TestLoop", "run", "dataloader"),
)


def preprocessor_device(model: Any) -> Any:
    """The device ``cast_data`` moves batches to (model wrappers unwrapped), or None."""
    pre = getattr(model, "data_preprocessor", None)
    if pre is None:
        pre = getattr(getattr(model, "module", None), "data_preprocessor", None)
    return getattr(pre, "device", None) if pre is not None else None


def install(patcher: Any, loops: Any, layer_for: LayerFor, *, on_copied: Callable[[], None] | None = None,
            on_fault: Callable[[BaseException], None] | None = None) -> list[str]:
    """Patch the loop classes of ``loops`` (mmengine.runner.loops); return what was patched.

    ``layer_for(loop)`` picks the device layer for a run of that loop (None: leave it alone).
    """
    for cls_name, method, _ in PATCHES:
        cls = getattr(loops, cls_name, None)
        if cls is None or not callable(getattr(cls, method, None)):
            raise NotApplicable(f"mmengine.runner.loops.{cls_name}.{method} not found (mmengine changed)")
    done = []
    for cls_name, method, attr in PATCHES:
        cls = getattr(loops, cls_name)
        original = cls.__dict__.get(method, getattr(cls, method))
        wrapper = _wrap(original, attr, layer_for, on_copied, on_fault)
        patcher.patch(cls, method, wrapper)
        done.append(f"{cls_name}.{method}")
    return done


def _wrap(original: Callable[..., Any], attr: str, layer_for: LayerFor, on_copied: Callable[[], None] | None,
          on_fault: Callable[[BaseException], None] | None) -> Callable[..., Any]:
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        source = getattr(self, attr, None)
        layer = layer_for(self) if source is not None else None
        if layer is None:
            return original(self, *args, **kwargs)
        if attr == "dataloader_iterator":
            # IterBasedTrainLoop.run first fast-forwards `_iter` batches (resume), then runs to max_iters.
            skip = int(getattr(self, "_iter", 0))
            limit = max(int(getattr(self, "_max_iters", 0)) - skip, 0)
            stand_in: Any = Prefetcher(source, layer, skip=skip, limit=limit, on_copied=on_copied,
                                       on_fault=on_fault)
        else:
            def make(it: Iterator[Any]) -> Iterator[Any]:
                return Prefetcher(it, layer, on_copied=on_copied, on_fault=on_fault)

            stand_in = PrefetchingLoader(source, make)
        setattr(self, attr, stand_in)
        try:
            return original(self, *args, **kwargs)
        finally:
            if getattr(self, attr, None) is stand_in:  # unless the loop replaced it itself
                setattr(self, attr, source)

    run.__wrapped__ = original  # type: ignore[attr-defined]
    run.__name__ = getattr(original, "__name__", "run")
    run.__qualname__ = getattr(original, "__qualname__", "run")
    run.__doc__ = getattr(original, "__doc__", None)
    return run


class CudaLayers:
    """``layer_for`` of the real feature: one CudaLayer per CUDA device, None (with a reason) otherwise."""

    def __init__(self, on_skip: Callable[[str], None]) -> None:
        self._layers: dict[Any, CudaLayer] = {}
        self._on_skip = on_skip

    def __call__(self, loop: Any) -> CudaLayer | None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        device = preprocessor_device(getattr(getattr(loop, "runner", None), "model", None))
        if device is None:
            self._on_skip("the model has no data_preprocessor with a device")
            return None
        device = torch.device(device)
        if device.type != "cuda":
            self._on_skip(f"the model's data_preprocessor is on {device}, not a CUDA device")
            return None
        if not torch.cuda.is_available():
            self._on_skip("torch.cuda.is_available() is False")
            return None
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        layer = self._layers.get(device)
        if layer is None:
            layer = self._layers[device] = CudaLayer(torch, device)
        return layer


class MmengineDataPrefetch(FeatureImpl):
    def detect(self, env: Any) -> str | None:
        return no_cuda_reason(env)

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        import mmengine.runner.loops as loops

        report = PrefetchReport(ctx, "loop")
        patched = install(ctx.patcher, loops, CudaLayers(report.on_skip), on_copied=report.on_copied,
                          on_fault=report.on_fault)
        ctx.set_config({"loops": patched})
        ctx.log.info("mmengine loops prefetch the next batch on a side CUDA stream", loops=patched)
