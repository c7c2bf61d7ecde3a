"""The node's CPU budget from fake cgroup v1/v2 trees, and the pure checks' numbers and suggestions."""

from __future__ import annotations

from pathlib import Path

import pytest
from loongkit_numa.fake_cgroups import write_cgroup_tree
from loongkit_numa.guards import (
    CpuBudget,
    check_cv2,
    check_dataloader,
    check_threads,
    cpu_budget,
    user_thread_vars,
)

from loongkit_core import cgroupfs
from loongkit_core.hardware import detect


def budget_of(root: Path) -> CpuBudget:
    return cpu_budget(detect(str(root)), str(root))


@pytest.mark.parametrize(("tree", "cpus", "quota"), [
    (dict(version=2, cpus="0-7", cpu_max="max 100000"), 8, None),
    (dict(version=2, cpus="0-7", cpu_max="250000 100000"), 2, 2.5),  # fractional: whole CPUs only
    (dict(version=2, cpus="0-7", cpu_max="50000 100000"), 1, 0.5),  # never below one
    (dict(version=2, cpus="0-3", cpu_max="1600000 100000"), 4, 16.0),  # quota above the mask
    (dict(version=2, cpus="0-15", group="/kubepods/pod1", cpu_max="max", parent_cpu_max="300000 100000"), 3, 3.0),
    (dict(version=2, cpus="0-15", group="/kubepods/pod1", cpu_max="600000 100000",
          parent_cpu_max="800000 100000"), 6, 6.0),
    (dict(version=1, cpus="0-7", cfs_quota_us="-1"), 8, None),
    (dict(version=1, cpus="0-7", cfs_quota_us="300000", cfs_period_us="100000"), 3, 3.0),
    (dict(version=1, cpus="0-7", group="/docker/abc", cfs_quota_us="200000", cfs_period_us="50000"), 4, 4.0),
])
def test_budget_mask_and_quota(tmp_path: Path, tree: dict, cpus: int, quota: float | None) -> None:
    write_cgroup_tree(tmp_path, **tree)
    budget = budget_of(tmp_path)
    assert (budget.cpus, budget.quota) == (cpus, quota)


@pytest.mark.parametrize("tree", [
    dict(version=2, cpus="0-5", cpu_max="garbage here"),
    dict(version=2, cpus="0-5", cpu_max="-5 100000"),
    dict(version=2, cpus="0-5", cpu_max="100000 0"),
    dict(version=2, cpus="0-5", cpu_max=""),
    dict(version=1, cpus="0-5", cfs_quota_us="lots"),
    dict(version=1, cpus="0-5", cfs_quota_us="200000", cfs_period_us="zero"),
    dict(version=1, cpus="0-5", cfs_quota_us="200000", cfs_period_us=None),
])
def test_garbled_quota_falls_back_to_the_mask(tmp_path: Path, tree: dict) -> None:
    write_cgroup_tree(tmp_path, **tree)
    budget = budget_of(tmp_path)
    assert budget.cpus == 6 and budget.quota is None


def test_garbage_is_noted(tmp_path: Path) -> None:
    write_cgroup_tree(tmp_path, version=2, cpus="0-5", cpu_max="garbage")
    assert any("garbled" in n and "cpu.max" in n for n in budget_of(tmp_path).notes)


def test_missing_everything_never_raises(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    budget = budget_of(tmp_path / "empty")  # no proc, no sys: the host's CPU count, no quota
    assert budget.cpus >= 1 and budget.quota is None
    assert cgroupfs.cpu_quota(str(tmp_path / "empty")) == (None, [])
    assert cgroupfs.own_group(str(tmp_path / "empty"), "memory") is None


def test_own_group_follows_proc_self_cgroup_and_falls_back_to_the_mount(tmp_path: Path) -> None:
    write_cgroup_tree(tmp_path, version=1, group="/docker/abc")
    group = cgroupfs.own_group(str(tmp_path), "memory")
    assert group is not None and group.path.endswith("sys/fs/cgroup/memory/docker/abc")
    # A path from another cgroup namespace (not under our mount): the mount root is the container's group.
    (tmp_path / "proc/self/cgroup").write_text("5:memory:/not/visible\n4:cpu,cpuacct:/not/visible\n")
    group = cgroupfs.own_group(str(tmp_path), "memory")
    assert group is not None and group.path == str(tmp_path / "sys/fs/cgroup/memory")


def test_the_dataloader_message_of_the_issue() -> None:
    finding = check_dataloader(8, 1, 2, CpuBudget(cpus=2, mask=2, quota=None))
    assert finding is not None
    assert finding.message == ("DataLoader num_workers=8 x 2 local ranks + 2 pin-memory threads = 18 > "
                               "2 CPUs available to this node's job; suggest num_workers=0")
    assert finding.suggested == 0


@pytest.mark.parametrize(("workers", "pin", "lws", "cpus", "suggested"), [
    (8, 0, 2, 2, 1),
    (8, 0, 1, 16, None),  # fits
    (16, 1, 4, 32, 7),
    (4, 0, 8, 4, 0),  # more ranks than CPUs: no room for workers at all
    (0, 1, 8, 2, None),  # no workers, nothing to check
])
def test_dataloader_suggestion(workers: int, pin: int, lws: int, cpus: int, suggested: int | None) -> None:
    finding = check_dataloader(workers, pin, lws, CpuBudget(cpus=cpus, mask=cpus, quota=None))
    assert (finding.suggested if finding else None) == suggested
    if finding is not None:  # the suggestion fits the budget
        assert finding.suggested * lws + pin * lws <= cpus or finding.suggested == 0


def test_thread_check_numbers_and_quota_wording() -> None:
    budget = CpuBudget(cpus=4, mask=16, quota=4.0)
    finding = check_threads("OMP_NUM_THREADS", 16, 2, budget, "OMP_NUM_THREADS={}")
    assert finding is not None and finding.suggested == 2
    assert finding.message == ("OMP_NUM_THREADS=16 x 2 local ranks = 32 > 4 CPUs available to this node's job "
                               "(cgroup quota 4 CPUs, 16 CPUs in the mask); suggest OMP_NUM_THREADS=2")
    assert check_threads("OMP_NUM_THREADS", 2, 2, budget, "{}") is None
    assert check_threads("OMP_NUM_THREADS", 1, 8, budget, "{}") is None  # one thread is never too many


def test_cv2_check() -> None:
    budget = CpuBudget(cpus=8, mask=8, quota=None)
    finding = check_cv2(8, 4, 2, budget)
    assert finding is not None and finding.suggested == 1
    assert "OpenCV threads=8 in each of 4 DataLoader workers x 2 local ranks = 64 > 8 CPUs" in finding.message
    assert check_cv2(1, 4, 2, budget) is None
    assert check_cv2(4, 1, 2, budget) is None  # 4 x 2 = 8 fits


def test_user_thread_vars_sees_through_torchrun_default() -> None:
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "12"}
    found = user_thread_vars(torchrun, 2)
    assert found["OMP_NUM_THREADS"] == (None, "torchrun default 1 (unset by the user)")
    assert found["MKL_NUM_THREADS"] == (12, "user")
    # A single-process torchrun never sets it, nor does plain python: "1" is the user's.
    assert user_thread_vars(torchrun, 1)["OMP_NUM_THREADS"] == (1, "user")
    assert user_thread_vars({"OMP_NUM_THREADS": "1"}, 2)["OMP_NUM_THREADS"] == (1, "user")
    assert user_thread_vars({"OMP_NUM_THREADS": "many"}, 1)["OMP_NUM_THREADS"][0] is None
    assert user_thread_vars({}, 1)["MKL_NUM_THREADS"] == (None, "unset")
