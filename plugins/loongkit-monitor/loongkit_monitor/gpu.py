"""GPU busy and idle time of a step, without synchronising the training stream.

Two sources, the better one wins in the report:

* NVML (``pynvml`` from nvidia-ml-py, when installed): the device's utilisation, the share of the
  last sample period in which a kernel ran, read at step boundaries at most once a second. The
  GPU-idle share is one minus its mean over the warm steps.
* CUDA events around each wait in the DataLoader iterator (always, on CUDA): an event recorded when
  the main process starts waiting and one when the batch arrives. The GPU reaches the first when it
  has run everything queued before the wait, and the second as soon as it is recorded if it has
  nothing left to do, so the time between the two events is the time the GPU sat idle during that
  wait (zero when it was still busy). Events are polled with ``query()`` at later step boundaries,
  never waited on. This is a lower bound: idle time while the CPU runs Python between kernels is
  not seen, and work on other streams is not told apart.

``cuda`` and ``nvml`` are passed in, so the logic is tested with fakes on a machine without a GPU.
"""

from __future__ import annotations

from array import array
from collections import deque
from typing import Any

MAX_PENDING = 512  # event pairs not yet completed; older ones are dropped (a GPU far behind the CPU)
POOL = 64  # events kept for reuse
MAX_STEPS_KEPT = 1 << 20


class EventIdle:
    """GPU idle time during data waits, from CUDA event pairs, per step."""

    def __init__(self, cuda: Any) -> None:
        self.cuda = cuda
        self.pending: deque[tuple[Any, Any, int]] = deque()  # (start, end, step the wait belongs to)
        self.free: list[Any] = []
        self.per_step = array("d")  # idle seconds of completed pairs, by step number (0-based)
        self.pairs = 0
        self.dropped = 0
        self._open: Any = None

    def _event(self) -> Any:
        return self.free.pop() if self.free else self.cuda.Event(enable_timing=True)

    def wait_started(self) -> None:
        event = self._event()
        event.record()
        self._open = event

    def wait_ended(self, step: int) -> None:
        """The wait that started last ended; it belongs to step number ``step`` (0-based)."""
        start, self._open = self._open, None
        if start is None:
            return
        end = self._event()
        end.record()
        self.pending.append((start, end, step))
        if len(self.pending) > MAX_PENDING:
            self.pending.popleft()
            self.dropped += 1

    def poll(self) -> None:
        """Account every pair the GPU has passed; never blocks."""
        pending = self.pending
        while pending and pending[0][1].query():
            start, end, step = pending.popleft()
            seconds = max(0.0, start.elapsed_time(end) / 1000.0)  # elapsed_time is in milliseconds
            if step < MAX_STEPS_KEPT:
                if len(self.per_step) <= step:
                    self.per_step.extend([0.0] * (step + 1 - len(self.per_step)))
                self.per_step[step] += seconds
            self.pairs += 1
            if len(self.free) < POOL:
                self.free.extend((start, end))

    def idle_from(self, step: int) -> float:
        """Idle seconds of the completed pairs of steps ``step`` (0-based) and later."""
        return float(sum(self.per_step[step:]))


class NvmlUtilisation:
    """The device's utilisation sampled at step boundaries (at most once per ``interval`` seconds)."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml = nvml
        self.handle = handle
        self.samples: list[tuple[int, float]] = []  # (step, utilisation 0..1)
        self.errors = 0

    @classmethod
    def open(cls, nvml: Any, pci_bus_id: str | None, index: int) -> NvmlUtilisation | None:
        """A sampler for the CUDA device at ``pci_bus_id`` (or NVML index ``index``); None if NVML fails."""
        try:
            nvml.nvmlInit()
            if pci_bus_id:
                handle = nvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
            else:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            nvml.nvmlDeviceGetUtilizationRates(handle)
        except Exception:
            return None
        return cls(nvml, handle)

    def sample(self, step: int) -> None:
        if self.errors > 3:
            return
        try:
            rates = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
            self.samples.append((step, float(rates.gpu) / 100.0))
        except Exception:
            self.errors += 1

    def busy_share(self, from_step: int) -> float | None:
        warm = [u for step, u in self.samples if step >= from_step]
        return sum(warm) / len(warm) if warm else None


def pci_bus_id(props: Any) -> str | None:
    """NVML's bus id ("00000000:3B:00.0") from ``torch.cuda.get_device_properties``; None if unknown."""
    try:
        return f"{int(props.pci_domain_id):08X}:{int(props.pci_bus_id):02X}:{int(props.pci_device_id):02X}.0"
    except (AttributeError, TypeError, ValueError):
        return None


def sysfs_pci(bus_id: str | None) -> str | None:
    """The same device as sysfs names it ("0000:3b:00.0"), to find its NUMA node in the hardware."""
    if not bus_id:
        return None
    domain, _, rest = bus_id.partition(":")
    return f"{domain[-4:]}:{rest}".lower()


class GpuMonitor:
    """Both sources for the device this process trains on."""

    def __init__(self, cuda: Any, device: int, nvml: Any = None) -> None:
        self.cuda = cuda
        self.device = device
        self.events = EventIdle(cuda)
        props = None
        try:
            props = cuda.get_device_properties(device)
        except Exception:
            props = None
        self.pci = pci_bus_id(props) if props is not None else None
        self.name = str(getattr(props, "name", "")) if props is not None else ""
        self.nvml = NvmlUtilisation.open(nvml, self.pci, device) if nvml is not None else None

    def idle_share(self, warm_wall_s: float, from_step: int) -> tuple[float | None, str]:
        """GPU-idle share of the warm steps (step numbers ``from_step`` on, 0-based) and its source."""
        if self.nvml is not None:
            busy = self.nvml.busy_share(from_step)
            if busy is not None:
                return max(0.0, 1.0 - busy), "nvml utilisation"
        self.events.poll()
        if warm_wall_s > 0 and self.events.pairs:
            share = min(1.0, self.events.idle_from(from_step) / warm_wall_s)
            return share, "cuda events during data waits (lower bound)"
        return None, "no completed CUDA events"


def load_nvml() -> Any:
    """``pynvml`` when nvidia-ml-py is installed, else None (imported only once CUDA is in use)."""
    try:
        import pynvml
    except Exception:
        return None
    return pynvml
