"""The batch prefetcher shared by LOONGKIT_DATA_PREFETCH (mmcv 1.x) and LOONGKIT_MMENGINE_DATA_PREFETCH.

:class:`Prefetcher` wraps a batch iterator and keeps one batch in flight: while step k runs, batch k+1
is already being copied to the device. It knows nothing about CUDA; a :class:`DeviceLayer` does the
copy. :class:`CudaLayer` is the real one (side stream, non-blocking copies, the compute stream waits on
the copy's event, ``record_stream`` so the caching allocator does not hand the memory to the next copy
while the step still reads it); :class:`CloneLayer` copies on the CPU so that the ordering,
exhaustion and error semantics are testable without a GPU.

What the wrapped iteration looks like from the outside is unchanged: the same batches in the same
order (moved to the device), StopIteration at the same call, and an exception raised by the source
(a DataLoader worker's error) re-raised unchanged at the call where it would have surfaced without
the prefetcher, not one step early. The one visible difference: the source is asked for batch k+1
before step k runs (with worker processes the DataLoader already works ahead of the loop).

Batch structures are rebuilt like torch's ``pin_memory`` and mmengine's ``cast_data`` rebuild them:
mappings, (named)tuples, sequences, mmengine data elements (``BaseDataElement``) and mmcv 1.x
``DataContainer`` (its ``cpu_only`` data stays on the CPU). Other objects are left alone: whatever
moved them before (``cast_data``, mmcv's ``scatter``) still does.
"""

from __future__ import annotations

import collections.abc
import copy
from collections.abc import Callable, Iterator
from typing import Any, Protocol

# What a preloaded slot holds.
_READY, _PLAIN, _ERROR, _END = "ready", "plain", "error", "end"


class DeviceLayer(Protocol):
    """Moves a batch to the device, asynchronously where the device allows it."""

    def start(self, batch: Any) -> Any:
        """Queue the copy of ``batch``; return a handle for :meth:`finish`."""

    def finish(self, handle: Any) -> Any:
        """Make the compute stream wait for the copy; return the batch on the device."""


# -- structures --------------------------------------------------------------------------------------
def _is_data_element(obj: Any) -> bool:
    # mmengine.structures.BaseDataElement, by duck type so that this module never imports mmengine.
    return all(callable(getattr(obj, name, None)) for name in ("new", "items", "set_data", "to")) \
        and hasattr(obj, "_data_fields")


def _is_data_container(obj: Any) -> bool:
    # mmcv.parallel.DataContainer (mmcv 1.x), by duck type.
    return type(obj).__name__ == "DataContainer" and all(
        hasattr(obj, name) for name in ("cpu_only", "stack", "padding_value", "pad_dims", "data"))


def map_tensors(data: Any, fn: Callable[[Any], Any], is_tensor: Callable[[Any], bool]) -> Any:
    """``data`` with every tensor ``t`` replaced by ``fn(t)``, containers rebuilt with their own types."""

    def walk(obj: Any) -> Any:
        if is_tensor(obj):
            return fn(obj)
        if isinstance(obj, (str, bytes)) or obj is None:
            return obj
        if _is_data_container(obj):
            if obj.cpu_only:
                return obj
            return type(obj)(walk(obj.data), stack=obj.stack, padding_value=obj.padding_value,
                             cpu_only=obj.cpu_only, pad_dims=obj.pad_dims)
        if _is_data_element(obj):
            # What BaseDataElement.to does, with the recursion (and the tensor function) ours.
            new = obj.new()
            for key, value in obj.items():
                if is_tensor(value) or _is_data_element(value):
                    new.set_data({key: walk(value)})
            return new
        if isinstance(obj, collections.abc.Mapping):
            items = {k: walk(v) for k, v in obj.items()}
            try:
                if isinstance(obj, collections.abc.MutableMapping):
                    clone = copy.copy(obj)  # keeps the mapping's own type and extra attributes
                    clone.update(items)
                    return clone
                return type(obj)(items)  # type: ignore[call-arg]
            except TypeError:
                return items
        if isinstance(obj, tuple):
            if hasattr(obj, "_fields"):  # namedtuple
                return type(obj)(*(walk(v) for v in obj))
            return type(obj)(walk(v) for v in obj)
        if isinstance(obj, collections.abc.Sequence):
            try:
                if isinstance(obj, collections.abc.MutableSequence):
                    clone = copy.copy(obj)
                    for i, value in enumerate(obj):
                        clone[i] = walk(value)
                    return clone
                return type(obj)([walk(v) for v in obj])  # type: ignore[call-arg]
            except TypeError:
                return [walk(v) for v in obj]
        return obj

    return walk(data)


# -- device layers -----------------------------------------------------------------------------------
class CudaLayer:
    """Copies on a side CUDA stream of ``device``; one layer (one stream) per device and process."""

    def __init__(self, torch: Any, device: Any) -> None:
        self._torch = torch
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)

    def start(self, batch: Any) -> tuple[Any, Any, list[Any]]:
        torch = self._torch
        moved: list[Any] = []

        def copy_one(t: Any) -> Any:
            out = t.to(self.device, non_blocking=True)  # asynchronous from pinned memory
            if out is not t:
                moved.append(out)
            return out

        with torch.cuda.stream(self.stream):
            batch = map_tensors(batch, copy_one, lambda x: isinstance(x, torch.Tensor))
            event = torch.cuda.Event()
            event.record(self.stream)
        return batch, event, moved

    def finish(self, handle: tuple[Any, Any, list[Any]]) -> Any:
        batch, event, moved = handle
        current = self._torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for tensor in moved:
            # Allocated on the side stream: without this the allocator could give the block to the
            # next prefetch while the step still reads it.
            tensor.record_stream(current)
        return batch


class CloneLayer:
    """A CPU stand-in for :class:`CudaLayer`: every tensor is copied (``clone``), nothing is async.

    ``log`` records ("start", n) / ("finish", n) with the number of the batch, so tests can check
    that batch k+1 is queued before batch k is handed out.
    """

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self.log: list[tuple[str, int]] = []
        self._started = 0

    def start(self, batch: Any) -> tuple[int, Any]:
        torch = self._torch
        n = self._started
        self._started += 1
        self.log.append(("start", n))
        return n, map_tensors(batch, lambda t: t.clone(), lambda x: isinstance(x, torch.Tensor))

    def finish(self, handle: tuple[int, Any]) -> Any:
        n, batch = handle
        self.log.append(("finish", n))
        return batch


# -- the prefetcher ----------------------------------------------------------------------------------
class Prefetcher:
    """Iterate ``source`` with the next batch's copy to the device queued while the current step runs.

    ``skip``: the first ``skip`` batches pass through untouched and are not copied (a loop that fast-
    forwards a resumed run). ``limit``: at most this many batches are copied (after the skipped ones),
    so a loop that stops after a known number of steps does not pull one extra batch from its source.
    ``on_copied`` runs for every batch handed out on the device; ``on_fault(exc)`` when the device
    layer fails, after which the remaining batches pass through untouched (the loop's own device copy
    then moves them, as it would without loongkit).
    """

    def __init__(self, source: Iterator[Any], layer: DeviceLayer, *, skip: int = 0, limit: int | None = None,
                 on_copied: Callable[[], None] | None = None,
                 on_fault: Callable[[BaseException], None] | None = None) -> None:
        self._source = source
        self._layer: DeviceLayer | None = layer
        self._skip = skip
        self._left = limit
        self._on_copied = on_copied
        self._on_fault = on_fault
        self._slot: tuple[str, Any] | None = None

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._skip > 0:
            self._skip -= 1
            return next(self._source)
        if self._slot is None:  # first call, past the limit, or the previous call raised the source's error
            self._slot = self._load()
        kind, value = self._slot
        if kind == _END:
            raise StopIteration  # stays exhausted, like the source
        self._slot = None
        if kind == _ERROR:
            raise value  # the source's own exception object, at the step it belongs to
        if kind == _READY:
            value = self._finish(value)
        if self._left is None or self._left > 0:
            self._slot = self._load()  # queue the next copy before the caller's step runs
        return value

    def _load(self) -> tuple[str, Any]:
        copy_it = self._layer is not None and (self._left is None or self._left > 0)
        if self._left is not None and self._left > 0:
            self._left -= 1
        try:
            batch = next(self._source)
        except StopIteration:
            return _END, None
        except Exception as exc:
            return _ERROR, exc
        if not copy_it:
            return _PLAIN, batch
        try:
            return _READY, (batch, self._layer.start(batch))  # type: ignore[union-attr]
        except Exception as exc:
            self._fault(exc)
            return _PLAIN, batch

    def _finish(self, pending: tuple[Any, Any]) -> Any:
        host_batch, handle = pending
        if self._layer is None:  # the layer failed on an earlier batch; this one's copy is not trusted
            return host_batch
        try:
            batch = self._layer.finish(handle)
        except Exception as exc:  # the step's own device copy (cast_data, scatter) moves the host batch
            self._fault(exc)
            return host_batch
        if self._on_copied is not None:
            self._on_copied()
        return batch

    def _fault(self, exc: BaseException) -> None:
        self._layer = None
        if self._on_fault is not None:
            self._on_fault(exc)


class PrefetchingLoader:
    """Stands in for a DataLoader while a loop iterates it: iteration goes through a :class:`Prefetcher`.

    Everything else (``len``, ``dataset``, ``sampler``, ``batch_size``, attribute writes, even
    ``isinstance(x, DataLoader)``) reaches the wrapped loader, so hooks that look at the loop's
    dataloader during the epoch see what they saw before.
    """

    __slots__ = ("_lk_loader", "_lk_make")

    def __init__(self, loader: Any, make: Callable[[Iterator[Any]], Iterator[Any]]) -> None:
        object.__setattr__(self, "_lk_loader", loader)
        object.__setattr__(self, "_lk_make", make)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance() consults __class__ after type()
        return type(self._lk_loader)

    def __iter__(self) -> Iterator[Any]:
        return self._lk_make(iter(self._lk_loader))

    def __len__(self) -> int:
        return len(self._lk_loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lk_loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._lk_loader, name, value)

    def __repr__(self) -> str:
        return f"PrefetchingLoader({self._lk_loader!r})"


# -- detection shared by both prefetch features --------------------------------------------------------
def no_cuda_reason(env: Any) -> str | None:
    """Why there is no CUDA device for this process to prefetch to, from sysfs and the environment.

    Never imports torch: a PCI scan finds the accelerators (NVIDIA, PPU; ROCm's HIP also serves
    torch.cuda), CUDA_VISIBLE_DEVICES can hide them all.
    """
    from loongkit_core.process import MAIN, SUBPROCESS

    if env.process.role not in (MAIN, SUBPROCESS):
        return f"nothing to prefetch in a {env.process.role} process"
    visible = env.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"no CUDA device: CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    hw = env.hardware
    if not hw.accelerators:
        return f"no CUDA device (no GPU under {hw.root.rstrip('/')}/sys/bus/pci/devices)"
    return None


class PrefetchReport:
    """The Summary and log side of a prefetch feature: why a pass was not prefetched, a failed copy,
    and each prefetched batch (the Summary's '*'). Shared by the mmcv 1.x and mmengine patch layers."""

    def __init__(self, ctx: Any, what: str) -> None:
        self.ctx = ctx
        self.what = what  # "runner" or "loop", for the log
        self._skipped: set[str] = set()
        self.on_copied: Callable[[], None] = ctx.count  # bound once: called per prefetched batch

    def on_skip(self, reason: str) -> None:
        if reason not in self._skipped:  # one log line per distinct reason
            self._skipped.add(reason)
            self.ctx.log.info(f"{self.what} left without prefetch", reason=reason)
        if not self.ctx.calls:
            self.ctx.waiting(f"not prefetching: {reason}")

    def on_fault(self, exc: BaseException) -> None:
        self.ctx.log.warning("device copy failed; the rest of this pass runs without prefetch",
                             error=f"{type(exc).__name__}: {exc}")
        self.ctx.fallback(f"a device copy failed ({type(exc).__name__}); that pass ran without prefetch")
