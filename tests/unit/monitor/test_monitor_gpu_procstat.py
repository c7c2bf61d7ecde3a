"""The CUDA path with fakes (a simulated GPU stream timeline, a fake NVML) and the /proc readers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from loongkit_monitor import gpu, procstat

from loongkit_core import resident


class FakeStream:
    """A GPU stream: kernels queue behind each other; an event completes when the GPU reaches it."""

    def __init__(self) -> None:
        self.cpu = 0.0  # the host's clock
        self.gpu_free_at = 0.0  # when the GPU finishes what is queued

    def launch(self, seconds: float) -> None:
        self.gpu_free_at = max(self.gpu_free_at, self.cpu) + seconds


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.at: float | None = None

    def record(self) -> None:
        s = self.stream
        self.at = max(s.gpu_free_at, s.cpu)  # reached once everything queued before it ran
        s.gpu_free_at = self.at

    def query(self) -> bool:
        return self.at is not None and self.at <= self.stream.cpu

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on an incomplete event would synchronise"
        return ((end.at or 0.0) - (self.at or 0.0)) * 1000.0


def fake_cuda(stream: FakeStream) -> Any:
    return SimpleNamespace(Event=lambda enable_timing=False: FakeEvent(stream))


def run_steps(events: gpu.EventIdle, stream: FakeStream, steps: int, data_wait: float, gpu_work: float,
              cpu_work: float) -> None:
    for step in range(steps):
        events.wait_started()
        stream.cpu += data_wait  # the main process waits for a batch
        events.wait_ended(step)
        stream.launch(gpu_work)  # the step's kernels, queued without waiting
        stream.cpu += cpu_work
        events.poll()


def test_idle_during_data_waits_when_the_gpu_catches_up() -> None:
    stream = FakeStream()
    events = gpu.EventIdle(fake_cuda(stream))
    run_steps(events, stream, steps=10, data_wait=0.030, gpu_work=0.010, cpu_work=0.001)
    stream.cpu += 1.0
    events.poll()
    # GPU runs 10 ms per step and then sits idle: through the 30 ms wait, minus the 9 ms of its work
    # still running after the 1 ms of CPU work
    assert events.pairs == 10
    assert events.idle_from(1) == pytest.approx(9 * 0.021)


def test_no_idle_when_the_gpu_is_the_bottleneck() -> None:
    stream = FakeStream()
    events = gpu.EventIdle(fake_cuda(stream))
    run_steps(events, stream, steps=10, data_wait=0.002, gpu_work=0.050, cpu_work=0.001)
    stream.cpu += 1.0
    events.poll()
    assert events.idle_from(1) == pytest.approx(0.0, abs=1e-9)


def test_poll_never_reads_an_incomplete_event() -> None:
    stream = FakeStream()
    events = gpu.EventIdle(fake_cuda(stream))
    stream.launch(10.0)  # a long kernel: every event stays pending
    run_steps(events, stream, steps=3, data_wait=0.01, gpu_work=0.0, cpu_work=0.0)
    assert events.pairs == 0 and len(events.pending) == 3  # FakeEvent.elapsed_time would have asserted


def test_pending_events_are_bounded() -> None:
    stream = FakeStream()
    events = gpu.EventIdle(fake_cuda(stream))
    stream.launch(1e9)
    for step in range(gpu.MAX_PENDING + 10):
        events.wait_started()
        events.wait_ended(step)
    assert len(events.pending) == gpu.MAX_PENDING and events.dropped == 10


class FakeNvml:
    def __init__(self, utilisation: list[int], fail_init: bool = False) -> None:
        self.values = iter(utilisation)
        self.fail_init = fail_init
        self.bus_ids: list[str] = []

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByPciBusId(self, bus: str) -> str:
        self.bus_ids.append(bus)
        return bus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUtilizationRates(self, handle: object) -> Any:
        return SimpleNamespace(gpu=next(self.values, 50))


def fake_torch_cuda(stream: FakeStream) -> Any:
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0, name="Fake H100")
    return SimpleNamespace(Event=lambda enable_timing=False: FakeEvent(stream),
                           get_device_properties=lambda device: props)


def test_nvml_utilisation_wins_when_available() -> None:
    nvml = FakeNvml([100, 0, 60, 60, 60, 60])  # the first reading belongs to open()'s check
    monitor = gpu.GpuMonitor(fake_torch_cuda(FakeStream()), 0, nvml)
    assert monitor.pci == "00000000:3B:00.0" and nvml.bus_ids == ["00000000:3B:00.0"]
    for step in range(5):
        monitor.nvml.sample(step)  # type: ignore[union-attr]
    share, source = monitor.idle_share(warm_wall_s=1.0, from_step=1)
    assert source == "nvml utilisation" and share == pytest.approx(0.4)


def test_without_nvml_the_events_give_a_lower_bound() -> None:
    stream = FakeStream()
    monitor = gpu.GpuMonitor(fake_torch_cuda(stream), 0, FakeNvml([], fail_init=True))
    assert monitor.nvml is None
    run_steps(monitor.events, stream, steps=5, data_wait=0.05, gpu_work=0.01, cpu_work=0.0)
    stream.cpu += 1.0
    share, source = monitor.idle_share(warm_wall_s=0.24, from_step=1)
    assert source.startswith("cuda events") and share == pytest.approx(4 * 0.04 / 0.24)


def test_pci_ids_between_nvml_and_sysfs() -> None:
    assert gpu.pci_bus_id(SimpleNamespace(pci_domain_id=1, pci_bus_id=0xAF, pci_device_id=3)) == "00000001:AF:03.0"
    assert gpu.pci_bus_id(SimpleNamespace()) is None
    assert gpu.sysfs_pci("00000000:3B:00.0") == "0000:3b:00.0"


# -- /proc ------------------------------------------------------------------------------------------
def test_statm_smaps_and_schedstat_parsers(tmp_path: Path) -> None:
    (tmp_path / "statm").write_text("5000 1200 300 10 0 900 0\n")
    assert procstat.rss_bytes(str(tmp_path / "statm")) == 1200 * resident.PAGE_SIZE
    assert procstat.rss_bytes(str(tmp_path / "missing")) == 0  # a count in a sample: 0, not None
    (tmp_path / "smaps_rollup").write_text("Rss: 900 kB\nPrivate_Clean:  40 kB\nPrivate_Dirty: 116 kB\n")
    assert procstat.private_bytes(str(tmp_path / "smaps_rollup")) == 156 * 1024
    (tmp_path / "schedstat").write_text("335696710 1108510469 107\n")
    assert procstat.run_delay(str(tmp_path / "schedstat")) == pytest.approx(1.108510469)
    assert procstat.rss_bytes(str(tmp_path / "missing")) == 0
    assert procstat.private_bytes(str(tmp_path / "missing")) is None
    assert procstat.run_delay(str(tmp_path / "missing")) is None


def test_live_sample_of_this_process() -> None:
    u = procstat.sample(private=True)
    assert u.rss > 0 and u.cpu_s > 0 and u.private is not None and u.private > 0
    assert procstat.Usage.from_json(u.to_json()) == u
    assert procstat.Usage.from_json({"t": "x"}) is None
    assert procstat.Usage.from_json(["x", 0, 0, 0, 0, None, None]) is None


def test_allowance_caps_the_mask_with_the_quota_shared_by_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procstat, "cgroup_quota", lambda root="/": (6.0, ""))
    a = procstat.allowance(frozenset(range(16)), local_ranks=2)
    assert (a.cpus, a.mask, a.quota) == (3.0, 16, 6.0)
    assert a.describe() == "cgroup quota 6 CPUs, shared by 2 local ranks"
    monkeypatch.setattr(procstat, "cgroup_quota", lambda root="/": (None, ""))
    assert procstat.allowance(frozenset({0, 1})).describe() == "2 CPUs in the affinity mask"


def test_quota_read_through_the_core_reader(tmp_path: Path) -> None:
    """loongkit_core.cgroupfs: no other plugin needed (this test runs with loongkit-monitor alone)."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/\n")
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "sys/fs/cgroup/cpu.max").write_text("150000 100000\n")
    quota, note = procstat.cgroup_quota(str(tmp_path))
    assert quota == pytest.approx(1.5) and note == ""
