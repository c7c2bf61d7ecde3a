"""loongkit_core.hardware against generated trees, including missing and garbled files."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loongkit_core.hardware import Hardware, detect, format_cpulist, parse_cpulist
from loongkit_core.testing.topology import (
    amd_2s_8gpu,
    asymmetric_4node,
    intel_2s_8gpu,
    narrowed_container,
    write_topology,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0-3,8,10-14:2", {0, 1, 2, 3, 8, 10, 12, 14}),
        ("", set()),
        (" 5 \n", {5}),
        ("0,,2", {0, 2}),
        ("7-7", {7}),
    ],
)
def test_parse_cpulist(text: str, expected: set[int]) -> None:
    assert parse_cpulist(text) == frozenset(expected)


@pytest.mark.parametrize("garbage", ["a-b", "3-1", "-1", "0-3:0", "1-99999999", "0x3"])
def test_parse_cpulist_rejects_garbage(garbage: str) -> None:
    with pytest.raises(ValueError):
        parse_cpulist(garbage)


def test_format_cpulist_round_trips() -> None:
    assert format_cpulist([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert format_cpulist([]) == ""
    for text in ("0-7,16-23", "1", "0,2,4", "0-63"):
        assert format_cpulist(parse_cpulist(text)) == text


def test_intel_two_sockets(tmp_path: Path) -> None:
    topo = intel_2s_8gpu(tmp_path)
    hw = detect(str(tmp_path))
    assert hw.notes == ()
    assert (hw.cpu_vendor, hw.cpu_vendor_id) == ("intel", "GenuineIntel")
    assert hw.online_cpus == topo.online_cpus == frozenset(range(32))
    assert [(n.id, n.cpus, n.has_memory) for n in hw.nodes] == [
        (0, parse_cpulist("0-7,16-23"), True), (1, parse_cpulist("8-15,24-31"), True)]
    assert hw.nodes[0].distance_to(1) == 32 and hw.nodes[1].distance_to(1) == 10
    assert [c.cpus for c in hw.l3_caches] == list(topo.l3_groups)
    cpu9 = hw.cpu(9)
    assert cpu9 is not None and cpu9.siblings == frozenset({9, 25}) and cpu9.package_id == 1 and cpu9.l3 == 1
    assert hw.smt
    # 8 GPUs plus the BMC's VGA chip (a display device, but no accelerator); the NVSwitch-like
    # bridge of the GPU vendor is not a display class and is not listed at all.
    assert len(hw.gpus) == 9
    assert [g.pci for g in hw.accelerators] == [g.pci for g in topo.gpus]
    assert [g.numa_node for g in hw.accelerators] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {g.vendor for g in hw.gpus} == {"nvidia", "other"} and hw.gpu_vendors == {"nvidia"}
    assert hw.accelerators[4].local_cpus == topo.cpus(1)
    assert hw.cgroup_version == 1 and hw.cgroup_cpus == hw.allowed_cpus == topo.online_cpus
    assert hw.allowed_mems == frozenset({0, 1})


def test_amd_l3_groups_and_smt(tmp_path: Path) -> None:
    topo = amd_2s_8gpu(tmp_path)
    hw = detect(str(tmp_path))
    assert hw.cpu_vendor == "amd"
    assert len(hw.l3_caches) == 8
    assert [c.cpus for c in hw.l3_caches] == list(topo.l3_groups)
    assert hw.l3_caches[0].cpus == parse_cpulist("0-3,32-35")
    for cpu in hw.cpus:
        assert cpu.siblings == topo.siblings[cpu.id]
        assert cpu.l3 is not None and topo.siblings[cpu.id] <= hw.l3_caches[cpu.l3].cpus


@pytest.mark.parametrize(("vendor_id", "expected"), [
    ("HygonGenuine", "hygon"), ("AuthenticAMD", "amd"), ("GenuineIntel", "intel"), ("CentaurHauls", "unknown")])
def test_cpu_vendor(tmp_path: Path, vendor_id: str, expected: str) -> None:
    write_topology(tmp_path, vendor=vendor_id, nodes=1, cores_per_node=2, gpus_per_node=(0,))
    assert detect(str(tmp_path)).cpu_vendor == expected


@pytest.mark.parametrize(("vendor_id", "expected"), [
    ("0x10de", "nvidia"), ("0x1ded", "ppu"), ("0x1002", "amd"), ("0x8086", "other")])
def test_gpu_vendor(tmp_path: Path, vendor_id: str, expected: str) -> None:
    write_topology(tmp_path, gpus_per_node=(1, 1), gpu_vendor=vendor_id, bmc_vga=False)
    hw = detect(str(tmp_path))
    assert [g.vendor for g in hw.gpus] == [expected, expected]
    assert len(hw.accelerators) == (0 if expected == "other" else 2)


def test_cgroup_v2_and_narrowed_container(tmp_path: Path) -> None:
    topo = narrowed_container(tmp_path, cgroup_version=2)
    hw = detect(str(tmp_path))
    assert hw.cgroup_version == 2
    assert hw.allowed_cpus == hw.cgroup_cpus == topo.allowed_cpus == parse_cpulist("4-11,20-27")


def test_unknown_gpu_numa_node_is_none(tmp_path: Path) -> None:
    asymmetric_4node(tmp_path, gpu_numa_unknown=True)
    hw = detect(str(tmp_path))
    assert [g.numa_node for g in hw.accelerators] == [None, None, None]
    assert hw.accelerators[2].local_cpus == parse_cpulist("8-11,24-27")


def test_empty_root_never_raises(tmp_path: Path) -> None:
    hw = detect(str(tmp_path))
    assert isinstance(hw, Hardware)
    assert hw.cpu_vendor == "unknown" and hw.nodes == () and hw.gpus == () and hw.online_cpus == frozenset()
    assert hw.cgroup_version is None
    assert any("proc/cpuinfo" in n for n in hw.notes)
    assert any("sys/devices/system/node" in n for n in hw.notes)


def test_garbled_and_unreadable_files(tmp_path: Path) -> None:
    intel_2s_8gpu(tmp_path)
    (tmp_path / "proc/cpuinfo").write_text("processor : 0\nmodel name : ???\n")
    (tmp_path / "sys/devices/system/node/node0/cpulist").write_text("zero-seven\n")
    (tmp_path / "sys/devices/system/node/node1/distance").write_text("32 ten\n")
    (tmp_path / "sys/devices/system/node/has_memory").write_text("?\n")
    (tmp_path / "proc/self/status").write_text("Cpus_allowed_list:\tall of them\n")
    (tmp_path / "sys/bus/pci/devices/0000:18:00.0/numa_node").write_text("north\n")
    (tmp_path / "sys/bus/pci/devices/0000:28:00.0/local_cpulist").write_text("x\n")
    # A directory where a file should be: reading it fails with an OSError even as root.
    vendor = tmp_path / "sys/bus/pci/devices/0000:38:00.0/vendor"
    vendor.unlink()
    vendor.mkdir()
    (tmp_path / "sys/devices/system/cpu/cpu3/cache/index3/shared_cpu_list").write_text("3-\n")
    for name in ("core_id", "physical_package_id", "thread_siblings_list", "core_cpus_list"):
        (tmp_path / f"sys/devices/system/cpu/cpu5/topology/{name}").unlink()

    hw = detect(str(tmp_path))

    notes = "\n".join(hw.notes)
    assert hw.cpu_vendor == "unknown" and "no vendor_id" in notes
    assert hw.nodes[0].cpus == frozenset() and "node0/cpulist" in notes
    assert hw.nodes[1].distances == () and "node1/distance" in notes
    assert all(n.has_memory for n in hw.nodes)  # meminfo fallback after the garbled has_memory
    assert hw.allowed_cpus == hw.online_cpus and "Cpus_allowed_list" in notes
    gpus = {g.pci: g for g in hw.gpus}
    assert gpus["0000:18:00.0"].numa_node is None and "numa_node" in notes
    assert gpus["0000:28:00.0"].local_cpus == frozenset()
    assert gpus["0000:38:00.0"].vendor == "other" and "0000:38:00.0/vendor" in notes
    cpu5 = hw.cpu(5)
    assert cpu5 is not None and cpu5.core_id is None and cpu5.siblings == frozenset({5})
    assert "no core/package topology for CPUs 5" in notes
    # cpu3's L3 file is garbled, but its group is known from cpu0's, which lists it.
    assert hw.cpu(3).l3 == 0  # type: ignore[union-attr]


def test_cpu_without_any_l3_is_noted(tmp_path: Path) -> None:
    write_topology(tmp_path, nodes=1, cores_per_node=2, smt=1, gpus_per_node=(1,))
    for cpu in (0, 1):
        for f in (tmp_path / f"sys/devices/system/cpu/cpu{cpu}/cache/index3").iterdir():
            f.unlink()
        (tmp_path / f"sys/devices/system/cpu/cpu{cpu}/cache/index3").rmdir()
    hw = detect(str(tmp_path))
    assert hw.l3_caches == () and all(c.l3 is None for c in hw.cpus)
    assert "no L3 cache information for CPUs 0-1" in hw.notes


def test_default_root_comes_from_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    amd_2s_8gpu(tmp_path)
    monkeypatch.setenv("LOONGKIT_SYSFS_ROOT", str(tmp_path))
    hw = detect()
    assert hw.root == str(tmp_path) and hw.cpu_vendor == "amd"


def test_real_root_uses_this_process_mask() -> None:
    hw = detect("/")
    assert hw.allowed_cpus == frozenset(os.sched_getaffinity(0))
    assert hw.online_cpus >= hw.allowed_cpus


def test_detection_is_fast(tmp_path: Path) -> None:
    write_topology(tmp_path, vendor="AuthenticAMD", nodes=2, cores_per_node=48, smt=2, l3_per_node=6,
                   gpus_per_node=(4, 4))
    start = time.perf_counter()
    hw = detect(str(tmp_path))
    elapsed = time.perf_counter() - start
    assert len(hw.cpus) == 192 and len(hw.l3_caches) == 12
    assert elapsed < 0.5, f"detect took {elapsed:.3f}s for 192 CPUs"


def test_declaring_and_planning_import_no_torch() -> None:
    code = ("import sys, loongkit_core.hardware, loongkit_core.testing.topology, loongkit_numa.plugin, "
            "loongkit_numa.plan, loongkit_numa.affinity, loongkit_numa.cli; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
