"""loongkit_core.cgroupfs, the core's one cgroup reader, on hand-written trees: where this process's cpuset
is read from (hardware's cgroup_cpus) and its cpuset hierarchy as the mount table shows it (loongkit-numa's
sub-cgroups, whose own tests drive it through loongkit_numa.cgroup_tree, tests/unit/numa_subcgroups/,
including the reasons when there is none).
Quotas and memory: tests/unit/numa_guards/ and tests/unit/numa_pagecache/."""

from __future__ import annotations

from pathlib import Path

from loongkit_core import cgroupfs
from loongkit_core.hardware import detect


def _tree(root: Path, files: dict[str, str]) -> str:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def test_no_cgroup_mount(tmp_path: Path) -> None:
    assert cgroupfs.cpuset_files(str(tmp_path)) == (None, [])


def test_v2_cpuset_files_own_group_then_the_mount_root(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"sys/fs/cgroup/cgroup.controllers": "cpuset cpu memory\n",
                            "proc/self/cgroup": "0::/pod/job\n"})
    mount = tmp_path / "sys/fs/cgroup"
    assert cgroupfs.cpuset_files(root) == (2, [str(mount / "pod/job/cpuset.cpus.effective"),
                                               str(mount / "cpuset.cpus.effective")])


def test_v1_cpuset_files_under_the_cpuset_mount(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"sys/fs/cgroup/cpuset,cpu/cpuset.cpus": "0-3\n",
                            "proc/self/cgroup": "4:memory:/other\n3:cpuset,cpu:/job\n"})
    mount = tmp_path / "sys/fs/cgroup/cpuset,cpu"
    assert cgroupfs.cpuset_files(root) == (1, [str(mount / "job/cpuset.effective_cpus"), str(mount / "job/cpuset.cpus"),
                                               str(mount / "cpuset.effective_cpus"), str(mount / "cpuset.cpus")])


def test_v1_without_a_cpuset_mount_names_the_usual_place(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"sys/fs/cgroup/memory/memory.limit_in_bytes": "1\n", "proc/self/cgroup": ""})
    version, files = cgroupfs.cpuset_files(root)
    assert version == 1 and files[0] == str(tmp_path / "sys/fs/cgroup/cpuset/cpuset.effective_cpus")


def test_hardware_reads_the_cpuset_through_it(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"sys/fs/cgroup/cgroup.controllers": "cpuset\n", "proc/self/cgroup": "0::/job\n",
                            "sys/fs/cgroup/job/cpuset.cpus.effective": "garbage\n",
                            "sys/fs/cgroup/cpuset.cpus.effective": "2-3\n"})
    hw = detect(root)
    assert hw.cgroup_version == 2 and hw.cgroup_cpus == frozenset({2, 3})
    assert "garbled cpulist in sys/fs/cgroup/job/cpuset.cpus.effective: 'garbage'" in hw.notes


MOUNTINFO = ("30 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
             "31 1 0:27 /pod /mnt/cpu\\040set rw - cgroup cgroup ro,cpuset\n")


def test_mount_table_records_compare_and_hash_by_their_fields() -> None:
    v2, v1 = cgroupfs.parse_mountinfo(MOUNTINFO)
    assert v1.point == "/mnt/cpu set" and v1.root == "/pod" and v1.read_only and not v2.read_only
    assert v2 == cgroupfs.parse_mountinfo(MOUNTINFO)[0] and hash(v2) == hash(cgroupfs.parse_mountinfo(MOUNTINFO)[0])
    assert v1 != v2 and repr(v2).startswith("Mount(point='/sys/fs/cgroup', root='/', fstype='cgroup2'")


def test_on_a_hybrid_host_the_v1_cpuset_hierarchy_is_located_and_compares_by_its_fields(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"proc/self/mountinfo": MOUNTINFO, "proc/self/cgroup": "3:cpuset:/pod/job\n0::/x\n",
                            "mnt/cpu set/job/cpuset.cpus": "0\n"})
    found = cgroupfs.locate_cpuset(root)
    assert isinstance(found, cgroupfs.Hierarchy)
    assert (found.version, found.own_path, found.own_dir, found.label) == (
        1, "/pod/job", str(tmp_path / "mnt/cpu set/job"), "v1 cpuset")
    assert found.cpus_file(found.own_dir, effective=True).endswith("cpuset.effective_cpus")
    assert found == cgroupfs.locate_cpuset(root) and len({found, cgroupfs.locate_cpuset(root)}) == 1
