"""LOONGKIT_DATA_PREFETCH: mmcv 1.x runners get the next batch on the GPU ahead of time.

mmcv 1.x moves a batch in ``MMDataParallel`` / ``MMDistributedDataParallel.scatter``: it copies the
DataContainers' tensors on its own streams and makes the compute stream wait right there, every
step. Here the runner's data loader is iterated through a
:class:`~loongkit_data.prefetch.Prefetcher`: while step k runs, batch k+1's DataContainers (not the
``cpu_only`` ones) are copied to the wrapper's device on a side stream. ``scatter`` then finds
tensors already on that device, and ``tensor.cuda(device)`` returns them as they are.

Patched: ``EpochBasedRunner.train`` / ``.val`` (the loader argument is wrapped for that call;
``len`` and every attribute still reach the DataLoader) and ``IterBasedRunner.train`` (one step
per call: the ``IterLoader`` gets a prefetcher of its own; the runner still reads the epoch of the
batch it is about to run). Only a model wrapped for exactly one CUDA device (``device_ids=[i]``,
what mmdet 2.x builds) is prefetched for; anything else runs as before, with the reason logged.
Pinned host memory (LOONGKIT_DATA_CONTAINER) is what makes the copies asynchronous, hence the
dependency.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl
from loongkit_data.prefetch import CudaLayer, DeviceLayer, Prefetcher, PrefetchingLoader, PrefetchReport, no_cuda_reason

LayerFor = Callable[[Any], "DeviceLayer | None"]


def wrapper_device(model: Any) -> tuple[Any, str | None]:
    """(CUDA device index, None) for a model wrapped for one GPU, else (None, why not)."""
    ids = getattr(model, "device_ids", None)
    if not ids:
        return None, f"{type(model).__name__} has no device_ids (not MMDataParallel/MMDistributedDataParallel on GPU)"
    if len(ids) != 1:
        return None, f"{type(model).__name__} spans {len(ids)} devices; mmcv splits the batch itself"
    dev = ids[0]
    index = getattr(dev, "index", dev)
    if getattr(dev, "type", "cuda") != "cuda" or index is None or int(index) < 0:
        return None, f"{type(model).__name__} runs on {dev!r}, not a CUDA device"
    return int(index), None


class _IterLoaderStandIn:
    """What IterBasedRunner.train sees instead of an IterLoader: batches from the prefetcher, and the
    epoch the IterLoader had when the batch about to be returned was read (not one step later)."""

    __slots__ = ("_lk_epoch", "_lk_loader", "_lk_prefetcher")

    def __init__(self, loader: Any, layer: DeviceLayer, on_copied: Callable[[], None] | None,
                 on_fault: Callable[[BaseException], None] | None) -> None:
        object.__setattr__(self, "_lk_loader", loader)
        object.__setattr__(self, "_lk_epoch", None)
        take = type(loader).__next__

        def source() -> Iterator[tuple[Any, Any]]:
            while True:
                try:
                    batch = take(loader)
                except StopIteration:
                    return
                yield batch, loader.epoch

        object.__setattr__(self, "_lk_prefetcher", Prefetcher(source(), _PairLayer(layer), on_copied=on_copied,
                                                              on_fault=on_fault))

    def __next__(self) -> Any:
        batch, epoch = next(self._lk_prefetcher)
        object.__setattr__(self, "_lk_epoch", epoch)
        return batch

    def __iter__(self) -> _IterLoaderStandIn:
        return self

    @property
    def epoch(self) -> Any:
        # Without prefetch the runner reads IterLoader.epoch after the previous batch was read.
        return self._lk_loader.epoch if self._lk_epoch is None else self._lk_epoch

    def __len__(self) -> int:
        return len(self._lk_loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lk_loader, name)


class _PairLayer:
    """Moves only the batch of a (batch, epoch) pair."""

    def __init__(self, layer: DeviceLayer) -> None:
        self.layer = layer

    def start(self, item: tuple[Any, Any]) -> Any:
        return self.layer.start(item[0]), item[1]

    def finish(self, handle: Any) -> tuple[Any, Any]:
        inner, epoch = handle
        return self.layer.finish(inner), epoch


def install(patcher: Any, runners: Any, layer_for: LayerFor, *, on_copied: Callable[[], None] | None = None,
            on_fault: Callable[[BaseException], None] | None = None) -> list[str]:
    """Patch EpochBasedRunner.train/val and IterBasedRunner.train of ``runners`` (mmcv.runner)."""
    epoch_cls = getattr(runners, "EpochBasedRunner", None)
    iter_cls = getattr(runners, "IterBasedRunner", None)
    for name, cls, method in (("EpochBasedRunner", epoch_cls, "train"), ("EpochBasedRunner", epoch_cls, "val"),
                              ("IterBasedRunner", iter_cls, "train")):
        if cls is None or not callable(getattr(cls, method, None)):
            raise NotApplicable(f"mmcv.runner.{name}.{method} not found (mmcv changed)")

    def make(layer: DeviceLayer) -> Callable[[Iterator[Any]], Iterator[Any]]:
        return lambda it: Prefetcher(it, layer, on_copied=on_copied, on_fault=on_fault)

    def epoch_wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, data_loader: Any, **kwargs: Any) -> Any:
            layer = layer_for(self)
            if layer is None:
                return original(self, data_loader, **kwargs)
            return original(self, PrefetchingLoader(data_loader, make(layer)), **kwargs)

        return _named(run, original)

    def iter_wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        stand_ins: dict[int, Any] = {}  # id(IterLoader) -> its stand-in, for this runner class

        def run(self: Any, data_loader: Any, **kwargs: Any) -> Any:
            stand_in = stand_ins.get(id(data_loader))
            if stand_in is None or stand_in._lk_loader is not data_loader:
                layer = layer_for(self)
                if layer is None or not hasattr(data_loader, "epoch"):
                    return original(self, data_loader, **kwargs)
                stand_in = stand_ins[id(data_loader)] = _IterLoaderStandIn(data_loader, layer, on_copied, on_fault)
            return original(self, stand_in, **kwargs)

        return _named(run, original)

    patcher.patch(epoch_cls, "train", epoch_wrap(epoch_cls.__dict__.get("train", epoch_cls.train)))
    patcher.patch(epoch_cls, "val", epoch_wrap(epoch_cls.__dict__.get("val", epoch_cls.val)))
    patcher.patch(iter_cls, "train", iter_wrap(iter_cls.__dict__.get("train", iter_cls.train)))
    return ["EpochBasedRunner.train", "EpochBasedRunner.val", "IterBasedRunner.train"]


def _named(fn: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    fn.__wrapped__ = original  # type: ignore[attr-defined]
    fn.__name__ = getattr(original, "__name__", fn.__name__)
    fn.__qualname__ = getattr(original, "__qualname__", fn.__qualname__)
    fn.__doc__ = getattr(original, "__doc__", None)
    return fn


class CudaLayers:
    """``layer_for`` of the real feature: the runner's model decides the device."""

    def __init__(self, on_skip: Callable[[str], None]) -> None:
        self._layers: dict[int, CudaLayer] = {}
        self._on_skip = on_skip

    def __call__(self, runner: Any) -> CudaLayer | None:
        torch = sys.modules.get("torch")
        index, why = wrapper_device(getattr(runner, "model", None))
        if index is None:
            self._on_skip(why or "no device")
            return None
        if torch is None or not torch.cuda.is_available():
            self._on_skip("torch.cuda.is_available() is False")
            return None
        layer = self._layers.get(index)
        if layer is None:
            layer = self._layers[index] = CudaLayer(torch, torch.device("cuda", index))
        return layer


class DataPrefetch(FeatureImpl):
    def detect(self, env: Any) -> str | None:
        return no_cuda_reason(env)

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        import mmcv.runner as runners

        report = PrefetchReport(ctx, "runner")
        patched = install(ctx.patcher, runners, CudaLayers(report.on_skip), on_copied=report.on_copied,
                          on_fault=report.on_fault)
        ctx.set_config({"runners": patched})
        ctx.log.info("mmcv runners prefetch the next batch on a side CUDA stream", runners=patched)
