"""Sub-cgroups pieces: mountinfo, locating the group, options, names, sets, missing files, cleanup."""

from __future__ import annotations

import atexit
import errno
import os
from pathlib import Path
from typing import Any

import pytest
from loongkit_numa import subcgroups
from loongkit_numa.cgroup_tree import CgroupOps, locate, parse_mountinfo, parse_proc_cgroup
from loongkit_numa.plan import RankPlan
from loongkit_numa.subcgroups import (
    WORKER_ENV,
    Partition,
    SubcgroupsOptions,
    group_names,
    group_sets,
    job_tag,
    join_data_group,
    on_data_worker_start,
    remove,
)
from numa_helpers import gpus_by_index
from subcg_helpers import make_ctx, write_v2_tree

from loongkit_core.context import NotApplicable
from loongkit_core.hardware import detect
from loongkit_core.process import HELPER, LAUNCHER, WORKER
from loongkit_core.settings import load_settings
from loongkit_core.testing.topology import two_cpu_two_node

MOUNTINFO_V1 = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "34 31 0:31 /kubepods/pod1 /sys/fs/cgroup/cpuset {opts} - cgroup cgroup {opts},cpuset\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)


@pytest.fixture(autouse=True)
def _no_handoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKER_ENV, raising=False)
    monkeypatch.setattr(atexit, "register", lambda fn: fn)


def write_v1(root: Path, *, own: str = "/kubepods/pod1/c1", opts: str = "rw,relatime") -> Path:
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/self/mountinfo").write_text(MOUNTINFO_V1.format(opts=opts))
    (root / "proc/self/cgroup").write_text(f"4:memory:/x\n3:cpuset:{own}\n0::/\n")
    # The mount shows /kubepods/pod1 as its root: the group /kubepods/pod1/c1 is <mount>/c1.
    group = root / "sys/fs/cgroup/cpuset/c1"
    group.mkdir(parents=True, exist_ok=True)
    for name, value in (("cpuset.cpus", "0-1"), ("cpuset.mems", "0"), ("cgroup.procs", ""), ("tasks", "")):
        (group / name).write_text(value)
    return group


def test_parse_mountinfo_and_proc_cgroup() -> None:
    mounts = parse_mountinfo(MOUNTINFO_V1.format(opts="ro,nosuid") + "garbage line\n12 1 0:1 / /a\\040b rw - x y rw\n")
    cpuset = next(m for m in mounts if "cpuset" in m.super_options)
    assert cpuset.point == "/sys/fs/cgroup/cpuset" and cpuset.root == "/kubepods/pod1" and cpuset.read_only
    assert [m.point for m in mounts][-1] == "/a b" and len(mounts) == 4
    assert parse_proc_cgroup("4:cpu,cpuacct:/a\n0::/b\nbad\n") == {"cpu": "/a", "cpuacct": "/a", "": "/b"}


def test_locate_v1_strips_the_mount_root(tmp_path: Path) -> None:
    group = write_v1(tmp_path)
    found = locate(str(tmp_path))
    assert not isinstance(found, str)
    assert found.version == 1 and found.own_dir == str(group) and found.label == "v1 cpuset"


def test_locate_v2(tmp_path: Path) -> None:
    group = write_v2_tree(tmp_path, group="/a/b")
    found = locate(str(tmp_path))
    assert not isinstance(found, str) and found.version == 2 and found.own_dir == str(group)


@pytest.mark.parametrize("damage, reason", [
    ("no-mountinfo", "cannot read {root}/proc/self/mountinfo"),
    ("no-cgroup", "cannot read {root}/proc/self/cgroup"),
    ("garbled-mountinfo", "no cgroup v1 cpuset mount and no cgroup v2 mount"),
    ("no-cpuset-line", "a cgroup v1 cpuset mount exists but {root}/proc/self/cgroup has no cpuset line"),
    ("group-missing", "this process's cpuset group /kubepods/pod1/c1 is not visible under the cpuset mount"),
])
def test_missing_or_garbled_files_give_reasons(tmp_path: Path, damage: str, reason: str) -> None:
    group = write_v1(tmp_path)
    if damage == "no-mountinfo":
        (tmp_path / "proc/self/mountinfo").unlink()
    elif damage == "no-cgroup":
        (tmp_path / "proc/self/cgroup").unlink()
    elif damage == "garbled-mountinfo":
        (tmp_path / "proc/self/mountinfo").write_text("\x00\x01 nonsense\n - \n")
    elif damage == "no-cpuset-line":
        (tmp_path / "proc/self/cgroup").write_text("0::/\n")
    else:
        for f in group.iterdir():
            f.unlink()
        group.rmdir()
    found = locate(str(tmp_path))
    assert isinstance(found, str) and reason.format(root=tmp_path) in found


def test_v1_read_only_mount_is_not_applicable(tmp_path: Path) -> None:
    two_cpu_two_node(tmp_path)
    group = write_v1(tmp_path, opts="ro,nosuid")
    impl, ctx, _ = make_ctx(str(tmp_path), gpus_by_index())
    with pytest.raises(NotApplicable, match=r"cpuset hierarchy at .*/sys/fs/cgroup/cpuset is mounted read-only"):
        impl.activate(ctx, None)
    assert sorted(p.name for p in group.iterdir() if p.is_dir()) == []


class RefusingOps(CgroupOps):
    """Every write fails with ``code``; mkdir and rmdir as well."""

    def __init__(self, code: int) -> None:
        self.code = code

    def write(self, path: str, value: str) -> OSError | None:
        return OSError(self.code, os.strerror(self.code))

    def mkdir(self, path: str) -> tuple[bool, OSError | None]:
        return False, OSError(self.code, os.strerror(self.code))

    def rmdir(self, path: str) -> OSError | None:
        return OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize("code, name", [(errno.EPERM, "EPERM"), (errno.EBUSY, "EBUSY"), (errno.EROFS, "EROFS")])
def test_v1_kernel_refusals_fail_with_the_reason(tmp_path: Path, code: int, name: str) -> None:
    two_cpu_two_node(tmp_path)
    write_v1(tmp_path)
    impl, ctx, _ = make_ctx(str(tmp_path), gpus_by_index())
    impl.ops = RefusingOps(code)
    with pytest.raises(RuntimeError, match=rf"cgroup v1 cpuset: cannot create .*-rank0-train: {name} "):
        impl.activate(ctx, None)
    assert WORKER_ENV not in os.environ


def test_cleanup_retries_then_reports_and_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subcgroups, "RMDIR_WAIT_S", 0.0)
    group = write_v1(tmp_path)
    found = locate(str(tmp_path))
    assert not isinstance(found, str)
    calls: list[str] = []

    class Busy(CgroupOps):
        def rmdir(self, path: str) -> OSError | None:
            calls.append(path)
            return OSError(errno.EBUSY, "Device or resource busy")

        def write(self, path: str, value: str) -> OSError | None:
            return None

    train = group / "t"
    part = Partition(hierarchy=found, base=str(group), home=str(group), train=str(train), data=str(group / "d"),
                     pid=os.getpid(), created=[str(train)], moved=True)
    notes = remove(Busy(), part, tries=4)
    assert calls == [str(train)] * 4
    assert notes == [f"left {train}: EBUSY (Device or resource busy)"]
    assert remove(Busy(), part) == []  # once only


def test_cleanup_in_a_forked_child_does_nothing(tmp_path: Path) -> None:
    group = write_v1(tmp_path)
    found = locate(str(tmp_path))
    assert not isinstance(found, str)
    part = Partition(hierarchy=found, base=str(group), home=str(group), train="t", data="d", pid=os.getpid() + 1,
                     created=["t"], moved=True)
    assert remove(RefusingOps(errno.EPERM), part) == [] and not part.removed


def test_job_tag_and_names() -> None:
    assert job_tag({"SLURM_JOB_ID": "123"}, 9) == "123"
    assert job_tag({"TORCHELASTIC_RUN_ID": "none"}, 9) == "9"
    assert job_tag({"TORCHELASTIC_RUN_ID": "a-b/c d"}, 9) == "a_b_c_d"
    assert job_tag({"TORCHELASTIC_RUN_ID": "---"}, 9) == "9"
    assert group_names("123", 3) == ("loongkit-123-rank3-train", "loongkit-123-rank3-data")


def test_group_sets_stay_within_the_parent(tmp_path: Path) -> None:
    two_cpu_two_node(tmp_path)
    hw = detect(str(tmp_path))
    entry = RankPlan(local_rank=1, gpu="x", gpu_index=1, node=1, training_nodes=(1,), data_nodes=(0, 1),
                     training_cpus=frozenset({1}), data_cpus=frozenset({0, 1}), memory_node=1, data_memory_node=1)
    sets = group_sets(entry, hw, frozenset({0, 1}), frozenset({0}))
    assert sets.train_cpus == {1} and sets.data_cpus == {0, 1}
    assert sets.train_mems == {0} and sets.data_mems == {0}
    assert "training memory nodes 1 are not in this cgroup's mems 0; the group uses 0" in sets.notes
    narrowed = group_sets(entry, hw, frozenset({1}), None)
    assert narrowed.data_cpus == {1} and narrowed.data_mems == {0, 1}
    with pytest.raises(NotApplicable, match="planned training CPUs 1 are outside this cgroup's CPUs 0"):
        group_sets(entry, hw, frozenset({0}), None)


@pytest.mark.parametrize("value", ["relative/path", "/does/not/exist", "   "])
def test_bad_cgroup_root_falls_back_with_a_warning(tmp_path: Path, value: str) -> None:
    options, warnings = load_settings(SubcgroupsOptions, environ={"LOONGKIT_SUBCGROUPS_CGROUP_ROOT": value})
    assert options.cgroup_root is None
    if value.strip():
        assert len(warnings) == 1 and "LOONGKIT_SUBCGROUPS_CGROUP_ROOT" in warnings[0] and "default" in warnings[0]
    else:
        assert warnings == []  # empty means unset


def test_good_cgroup_root_and_bad_numa_option_through_configure(tmp_path: Path) -> None:
    two_cpu_two_node(tmp_path)
    _, ctx, _ = make_ctx(str(tmp_path), {"LOONGKIT_SUBCGROUPS_CGROUP_ROOT": str(tmp_path),
                                         "LOONGKIT_NUMA_AFFINITY_ALLOW_ASYMMETRIC": "maybe"})
    config: Any = ctx.config
    assert config.options.cgroup_root == str(tmp_path)
    assert config.numa.allow_asymmetric is False
    assert any("LOONGKIT_NUMA_AFFINITY_ALLOW_ASYMMETRIC='maybe' is invalid" in w for w in config.warnings)


def test_detect_reasons(tmp_path: Path) -> None:
    two_cpu_two_node(tmp_path)
    impl, ctx, _ = make_ctx(str(tmp_path))
    assert "cannot read" in (impl.detect(ctx.env) or "") and "mountinfo" in (impl.detect(ctx.env) or "")
    write_v2_tree(tmp_path)
    assert impl.detect(ctx.env) is None
    for role in (LAUNCHER, HELPER):
        ctx.env.process.role = role
        assert impl.detect(ctx.env) == f"nothing to place in a {role} process"
    ctx.env.process.role = WORKER
    assert impl.detect(ctx.env) is None
    bare = tmp_path / "nogpu"
    write_v2_tree(bare)
    impl2, ctx2, _ = make_ctx(str(bare))
    assert (impl2.detect(ctx2.env) or "").startswith("no GPU found")


def test_worker_without_or_with_garbled_handoff(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert join_data_group(CgroupOps(), {}) == (False, "no data group from a training process")
    joined, message = join_data_group(CgroupOps(), {WORKER_ENV: "{not json"})
    assert not joined and message.startswith(f"garbled {WORKER_ENV}")
    joined, message = join_data_group(CgroupOps(), {WORKER_ENV: f'{{"group": "{tmp_path}/gone", "version": 1}}'})
    assert not joined and "ENOENT" in message
    two_cpu_two_node(tmp_path)
    impl, ctx, _ = make_ctx(str(tmp_path), role=WORKER)
    with pytest.raises(NotApplicable, match="no data group from a training process"):
        impl.activate(ctx, None)
    monkeypatch.setenv(WORKER_ENV, "[]")
    on_data_worker_start(0)  # logs, never raises


def test_subprocess_fake_v2_without_cpuset_delegation(tmp_path: Path, run_loongkit: Any) -> None:
    """Through the runtime: not applicable with the reason, NUMA_AFFINITY switched off, exit code kept."""
    root = tmp_path / "root"
    two_cpu_two_node(root, cgroup_version=2)
    job = write_v2_tree(root, group="/job", controllers="cpu memory pids", procs=(1,))
    r = run_loongkit("print('trained')", env={"LOONGKIT_SUBCGROUPS": "1", "LOONGKIT_NUMA_AFFINITY": "1",
                                              "LOONGKIT_SYSFS_ROOT": str(root), **gpus_by_index()})
    assert r.returncode == 0 and "trained" in r.stdout, r.stderr
    row = r.feature("subcgroups")
    assert row["state"] == "not applicable"
    assert row["reason"] == (f"cgroup v2: the cpuset controller is not delegated to {job} (cgroup.controllers: "
                             f"cpu memory pids); needs '+cpuset' in {root}/sys/fs/cgroup/cgroup.subtree_control")
    assert r.feature("numa_affinity")["reason"] == "switched off by LOONGKIT_SUBCGROUPS"
    assert sorted(p.name for p in job.iterdir() if p.is_dir()) == []
