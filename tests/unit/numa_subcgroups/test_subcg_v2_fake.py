"""Sub-cgroups on fake cgroup v2 trees (written by code) through the kernel-rule emulator."""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path

import pytest
from loongkit_numa import affinity
from loongkit_numa.subcgroups import LEAF, WORKER_ENV, join_data_group
from numa_helpers import gpus_by_index
from subcg_helpers import FakeV2Ops, make_ctx, write_v2_tree

from loongkit_core.context import NotApplicable
from loongkit_core.testing.topology import two_cpu_two_node

ME = os.getpid()
OTHER = 4242  # another process of the container (the launcher, a shell)


@pytest.fixture(autouse=True)
def _no_handoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKER_ENV, raising=False)
    monkeypatch.setattr(atexit, "register", lambda fn: fn)  # no exit hooks from in-process tests


def tree(tmp_path: Path, **kw: object) -> tuple[str, Path]:
    """The two-node fixture with a v2 group; the tests' contexts get gpus_by_index(): they are about
    cgroups, not about where the plan's GPU identity comes from (torch < 2.5: by index order)."""
    root = tmp_path / "root"
    two_cpu_two_node(root, cgroup_version=2)
    group = write_v2_tree(root, mems="0-1", **kw)  # type: ignore[arg-type]
    return str(root), group


def children(group: Path) -> list[str]:
    return sorted(c.name for c in group.iterdir() if c.is_dir())


def test_no_internal_processes_leaf_then_groups_then_full_restore(tmp_path: Path) -> None:
    root, job = tree(tmp_path, procs=(OTHER, ME))
    impl, ctx, logger = make_ctx(root, {**gpus_by_index(), "SLURM_JOB_ID": "77"}, local_rank=1, local_world_size=2)
    ops = FakeV2Ops(Path(root) / "sys/fs/cgroup")
    impl.ops = ops
    impl.activate(ctx, None)

    train, data = job / "loongkit-77-rank1-train", job / "loongkit-77-rank1-data"
    assert children(job) == sorted([LEAF, data.name, train.name])
    # The parent's processes went to the leaf before +cpuset (EBUSY otherwise); this one then to train.
    assert ops.procs(job) == [] and ops.procs(job / LEAF) == [OTHER]
    assert (job / "cgroup.subtree_control").read_text().split() == ["cpuset"]
    assert ops.procs(train) == [ME]
    # Rank 1's plan on the two-node fixture: CPU 1, NUMA 1, for training and data alike.
    for g in (train, data):
        assert (g / "cpuset.cpus").read_text().strip() == "1"
        assert (g / "cpuset.mems").read_text().strip() == "1"
    assert ctx.record.details["plan"]["training_cpus"] == "1"
    assert ctx.record.details["leaf"] == str(job / LEAF)
    assert ctx.record.config == {"cgroup": "v2", "train": str(train), "data": str(data)}
    assert any("local rank 1 in" in m for _, m in logger.lines)

    # A DataLoader worker joins the data group through the handed-over environment.
    handoff = json.loads(os.environ[WORKER_ENV])
    assert handoff["group"] == str(data)
    joined, message = join_data_group(ops, {WORKER_ENV: os.environ[WORKER_ENV]})
    assert joined and str(data) in message and ops.procs(data) == [ME]
    ops.write(str(train / "cgroup.procs"), str(ME))  # back to the trainer's group for the cleanup

    impl.deactivate(ctx)
    # Everything as it was: no children, cpuset off again, both processes in the job group.
    assert children(job) == []
    assert (job / "cgroup.subtree_control").read_text().split() == []
    assert sorted(ops.procs(job)) == sorted([OTHER, ME])
    assert WORKER_ENV not in os.environ


def test_peer_rank_already_moved_us_into_the_leaf(tmp_path: Path) -> None:
    root, job = tree(tmp_path, group="/job/" + LEAF)
    (job.parent / "cgroup.subtree_control").write_text("cpuset\n")
    (job / "cgroup.procs").write_text(f"{OTHER}\n{ME}\n")
    impl, ctx, _ = make_ctx(root, {**gpus_by_index(), "TORCHELASTIC_RUN_ID": "none"}, local_rank=0, local_world_size=2)
    impl.ops = ops = FakeV2Ops(Path(root) / "sys/fs/cgroup")
    impl.activate(ctx, None)
    base = job.parent
    train = base / f"loongkit-{ME}-rank0-train"
    assert ops.procs(train) == [ME] and (train / "cpuset.cpus").read_text().strip() == "0"
    impl.deactivate(ctx)
    # Our groups are gone; the leaf and +cpuset were a peer's doing and stay.
    assert children(base) == [LEAF]
    assert sorted(ops.procs(job)) == sorted([OTHER, ME])
    assert (base / "cgroup.subtree_control").read_text().split() == ["cpuset"]


def test_old_torch_without_allow_index_is_not_applicable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch < 2.5 (made to look so here) cannot say which GPU is whose: no plan, no group made."""
    root, job = tree(tmp_path, procs=(ME,))
    monkeypatch.setattr(affinity, "_torch_version", lambda: (2, 4))
    impl, ctx, _ = make_ctx(root)
    impl.ops = FakeV2Ops(Path(root) / "sys/fs/cgroup")
    with pytest.raises(NotApplicable) as info:
        impl.activate(ctx, None)
    assert str(info.value) == (
        "the NUMA plan leaves local rank 0 unbound: torch 2.4 cannot report the GPU's PCI address (needs torch "
        ">= 2.5); set LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX=1 to bind by index order (and leave CUDA_VISIBLE_DEVICES "
        "unset)")
    assert children(job) == [] and WORKER_ENV not in os.environ


def test_missing_delegation_names_every_missing_piece(tmp_path: Path) -> None:
    root, job = tree(tmp_path, procs=(ME,))
    impl, ctx, _ = make_ctx(root, gpus_by_index())
    impl.ops = FakeV2Ops(Path(root) / "sys/fs/cgroup",
                         deny=(str(job / "cgroup.subtree_control"), str(job / "cgroup.procs"), str(job)))
    with pytest.raises(NotApplicable) as info:
        impl.activate(ctx, None)
    reason = str(info.value)
    assert f"{job}/cgroup.subtree_control is not writable" in reason
    assert f"{job}/cgroup.procs is not writable" in reason
    assert f"cannot create groups in {job}" in reason
    assert "nsdelegate" in reason
    assert children(job) == []


def test_cpuset_controller_not_delegated(tmp_path: Path) -> None:
    root, _job = tree(tmp_path, controllers="cpu memory pids", procs=(ME,))
    impl, ctx, _ = make_ctx(root, gpus_by_index())
    impl.ops = FakeV2Ops(Path(root) / "sys/fs/cgroup")
    with pytest.raises(NotApplicable, match=r"cpuset controller is not delegated to .*/job \(cgroup.controllers: "
                                            r"cpu memory pids\); needs '\+cpuset' in .*/sys/fs/cgroup/cgroup"):
        impl.activate(ctx, None)


def test_a_process_that_cannot_move_fails_with_the_reason_and_rolls_back(tmp_path: Path) -> None:
    root, job = tree(tmp_path, procs=(ME, OTHER))
    impl, ctx, _ = make_ctx(root, gpus_by_index())
    impl.ops = ops = FakeV2Ops(Path(root) / "sys/fs/cgroup", refuse_pids=(OTHER,))
    with pytest.raises(RuntimeError, match=r"cgroup v2: no-internal-processes rule: .*EPERM \(cannot move pid 4242"):
        impl.activate(ctx, None)
    assert children(job) == [] and sorted(ops.procs(job)) == sorted([ME, OTHER])
    assert (job / "cgroup.subtree_control").read_text().split() == []
    assert WORKER_ENV not in os.environ


def test_plan_cpus_outside_the_group_are_not_applicable(tmp_path: Path) -> None:
    root, job = tree(tmp_path, cpus="0", procs=(ME,))  # the container's cpuset holds CPU 0 only
    impl, ctx, _ = make_ctx(root, gpus_by_index(), local_rank=1, local_world_size=2)
    impl.ops = FakeV2Ops(Path(root) / "sys/fs/cgroup")
    with pytest.raises(NotApplicable, match="planned training CPUs 1 are outside this cgroup's CPUs 0"):
        impl.activate(ctx, None)
    assert children(job) == []


def test_invalid_cpuset_write_fails_and_removes_what_it_made(tmp_path: Path) -> None:
    root, job = tree(tmp_path, procs=(ME,))
    impl, ctx, _ = make_ctx(root, {**gpus_by_index(), "SLURM_JOB_ID": "9"})
    impl.ops = ops = FakeV2Ops(Path(root) / "sys/fs/cgroup")
    real_write = ops.write

    def busy_mems(path: str, value: str) -> OSError | None:
        if path.endswith("-data/cpuset.mems"):
            return OSError(16, "Device or resource busy")
        return real_write(path, value)

    ops.write = busy_mems  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=r"cannot write '0' to .*loongkit-9-rank0-data/cpuset.mems: EBUSY"):
        impl.activate(ctx, None)
    assert children(job) == [] and ops.procs(job) == [ME]


def test_default_deactivate_restores_and_reapplies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No deactivate of its own: ctx.patcher.undo() moves the processes home, removes the groups, the
    leaf and +cpuset, and puts back the handoff variable found; activating again makes them again.
    The exit hook that follows finds nothing left to do."""
    monkeypatch.setenv(WORKER_ENV, "an older handoff")
    root, job = tree(tmp_path, procs=(OTHER, ME))
    impl, ctx, _ = make_ctx(root, {**gpus_by_index(), "SLURM_JOB_ID": "78"}, local_rank=0, local_world_size=2)
    impl.ops = ops = FakeV2Ops(Path(root) / "sys/fs/cgroup")

    def state() -> tuple[object, ...]:
        return (children(job), (job / "cgroup.subtree_control").read_text().split(), sorted(ops.procs(job)),
                os.environ.get(WORKER_ENV))

    before = state()
    assert before == ([], [], sorted([OTHER, ME]), "an older handoff")
    for _ in range(2):
        impl.activate(ctx, None)
        train = job / "loongkit-78-rank0-train"
        assert children(job) == sorted([LEAF, "loongkit-78-rank0-data", train.name]) and ops.procs(train) == [ME]
        assert json.loads(os.environ[WORKER_ENV])["group"] == str(job / "loongkit-78-rank0-data")
        impl.deactivate(ctx)
        assert state() == before and len(ctx.patcher) == 0
    impl._cleanup_at_exit()  # the exit hook after an undo: nothing left, nothing touched
    assert state() == before
