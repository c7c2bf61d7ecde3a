"""The NUMA plan for each fixture topology, the seed's asymmetric table row by row, LLC partitioning."""

from __future__ import annotations

from pathlib import Path

import pytest
from loongkit_numa.options import NumaAffinityOptions
from loongkit_numa.plan import ALREADY_BOUND, UNBOUND, NodePlan, PlanOptions, build_plan

from loongkit_core.hardware import detect, parse_cpulist
from loongkit_core.testing.topology import (
    Topology,
    amd_2s_8gpu,
    asymmetric_4node,
    intel_2s_8gpu,
    narrowed_container,
    write_topology,
)


def plan_of(topo: Topology, nproc: int | None = None, **options: bool) -> NodePlan:
    hw = detect(topo.root)
    return build_plan(hw, PlanOptions(**options), len(topo.gpus) if nproc is None else nproc)


# -- 8 GPUs on 2 Intel sockets --------------------------------------------------------------------------
def test_intel_symmetric_node_binding(tmp_path: Path) -> None:
    topo = intel_2s_8gpu(tmp_path)
    plan = plan_of(topo)
    assert plan.symmetric and len(plan.ranks) == 8
    for r in plan.ranks:
        node = r.local_rank // 4
        assert r.gpu == topo.gpus[r.local_rank].pci and r.node == node
        assert r.training_cpus == r.data_cpus == topo.cpus(node)
        assert r.training_nodes == r.data_nodes == (node,)
        assert r.memory_node == r.data_memory_node == node
        assert r.rule == "node" and "symmetric" in r.why


def test_intel_llc_partition_falls_back_with_reason(tmp_path: Path) -> None:
    topo = intel_2s_8gpu(tmp_path)
    plan = plan_of(topo, partition_per_llc=True)
    for r in plan.ranks:
        assert r.training_cpus == topo.cpus(r.local_rank // 4)
        assert r.rule == "node"
        assert "PARTITION_PER_LLC not applied: 1 L3 cache on NUMA" in r.why and "4 ranks" in r.why


def test_more_ranks_than_gpus(tmp_path: Path) -> None:
    topo = intel_2s_8gpu(tmp_path)
    plan = plan_of(topo, nproc=9)
    assert plan.ranks[7].bound
    assert not plan.ranks[8].bound and plan.ranks[8].rule == UNBOUND and "no GPU for local rank 8" in plan.ranks[8].why


def test_memoryless_gpu_node_keeps_cpus_and_skips_memory(tmp_path: Path) -> None:
    topo = intel_2s_8gpu(tmp_path, memory_nodes=(1,))
    plan = plan_of(topo)
    assert plan.ranks[0].training_cpus == topo.cpus(0)
    assert plan.ranks[0].memory_node is None and "no allowed memory node" in plan.ranks[0].why
    assert plan.ranks[4].memory_node == 1


def test_gpu_node_inferred_from_local_cpulist(tmp_path: Path) -> None:
    topo = intel_2s_8gpu(tmp_path, gpu_numa_unknown=True)
    plan = plan_of(topo)
    assert [r.node for r in plan.ranks] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert any("inferred from local_cpulist" in n for n in plan.notes)


def test_single_node_machine(tmp_path: Path) -> None:
    topo = write_topology(tmp_path, nodes=1, cores_per_node=4, smt=1, gpus_per_node=(2,), gpu_numa_unknown=True)
    plan = plan_of(topo)
    assert plan.symmetric
    assert [r.training_cpus for r in plan.ranks] == [topo.cpus(0)] * 2


def test_no_gpu_no_binding(tmp_path: Path) -> None:
    topo = write_topology(tmp_path, gpus_per_node=(0, 0))
    plan = plan_of(topo, nproc=2)
    assert all(r.rule == UNBOUND and "no GPU found" in r.why for r in plan.ranks)


# -- 8 GPUs on 2 AMD sockets, 4 L3 caches per node, SMT ---------------------------------------------------
def test_amd_llc_partition_whole_l3_per_rank(tmp_path: Path) -> None:
    topo = amd_2s_8gpu(tmp_path)
    plan = plan_of(topo, partition_per_llc=True)
    seen: set[int] = set()
    for r in plan.ranks:
        assert r.rule == "node+llc"
        assert r.training_cpus == topo.l3_groups[r.local_rank]  # one whole L3 each, in order
        assert r.data_cpus == r.training_cpus
        assert r.memory_node == r.local_rank // 4
        assert r.training_cpus is not None and not (r.training_cpus & seen)  # disjoint across ranks
        seen |= r.training_cpus
        for cpu in r.training_cpus:  # SMT siblings never split across ranks
            assert topo.siblings[cpu] <= r.training_cpus
        assert "4 physical cores" in r.why
    assert seen == topo.online_cpus


def test_amd_llc_two_ranks_per_node_get_two_l3_each(tmp_path: Path) -> None:
    topo = amd_2s_8gpu(tmp_path, gpus_per_node=(2, 2))
    plan = plan_of(topo, partition_per_llc=True)
    assert plan.ranks[0].training_cpus == topo.l3_groups[0] | topo.l3_groups[1]
    assert plan.ranks[1].training_cpus == topo.l3_groups[2] | topo.l3_groups[3]
    assert plan.ranks[3].training_cpus == topo.l3_groups[6] | topo.l3_groups[7]
    assert "L3 #2-3 of 4 on NUMA 1" in plan.ranks[3].why


def test_amd_llc_uneven_falls_back_to_node(tmp_path: Path) -> None:
    topo = amd_2s_8gpu(tmp_path, gpus_per_node=(3, 3))
    plan = plan_of(topo, partition_per_llc=True)
    for r in plan.ranks:
        assert r.rule == "node" and r.training_cpus == topo.cpus(r.local_rank // 3)
        assert "4 L3 caches on NUMA" in r.why and "cannot be split evenly among 3 ranks" in r.why


def test_amd_llc_refused_when_l3_splits_smt_siblings(tmp_path: Path) -> None:
    topo = amd_2s_8gpu(tmp_path)
    cache = tmp_path / "sys/devices/system/cpu"
    for cpu in range(4):  # garbled sysfs: the first L3 claims CPUs 0-3 but not their siblings 32-35
        (cache / f"cpu{cpu}/cache/index3/shared_cpu_list").write_text("0-3\n")
    for cpu in range(32, 36):
        (cache / f"cpu{cpu}/cache/index3/shared_cpu_list").write_text("32-35\n")
    plan = plan_of(topo, partition_per_llc=True)
    assert plan.ranks[0].training_cpus == topo.cpus(0) and plan.ranks[0].rule == "node"
    assert "splits the SMT threads" in plan.ranks[0].why
    assert plan.ranks[4].rule == "node+llc"  # node 1 is intact


def test_amd_llc_and_separate_roles(tmp_path: Path) -> None:
    topo = amd_2s_8gpu(tmp_path, gpus_per_node=(2, 2))
    plan = plan_of(topo, partition_per_llc=True, separate_by_roles=True)
    r0, r1 = plan.ranks[0], plan.ranks[1]
    assert r0.rule == "node+llc+roles"
    assert r0.training_cpus == topo.l3_groups[0] and r0.data_cpus == topo.l3_groups[1]
    assert r1.training_cpus == topo.l3_groups[2] and r1.data_cpus == topo.l3_groups[3]


def test_separate_roles_without_partition_splits_the_node(tmp_path: Path) -> None:
    topo = amd_2s_8gpu(tmp_path)
    plan = plan_of(topo, separate_by_roles=True)
    r = plan.ranks[5]
    assert r.rule == "node+roles"
    assert r.training_cpus == topo.l3_groups[4] | topo.l3_groups[5]
    assert r.data_cpus == topo.l3_groups[6] | topo.l3_groups[7]


def test_separate_roles_impossible_with_one_l3(tmp_path: Path) -> None:
    topo = amd_2s_8gpu(tmp_path)
    plan = plan_of(topo, partition_per_llc=True, separate_by_roles=True)  # 1 L3 per rank
    assert plan.ranks[0].rule == "node+llc"
    assert plan.ranks[0].data_cpus == plan.ranks[0].training_cpus
    assert "SEPARATE_BY_ROLES not applied: a single L3 cache" in plan.ranks[0].why


# -- the seed's asymmetric example -------------------------------------------------------------------------
# Seed table, for the training and data processes of GPU 2 (NUMA 2; NUMA 3 has no GPU).
# (TRAIN_ON_GPULESS, DATA_WORKER_ON_GPULESS, DATA_WORKER_GPULESS_ONLY) -> (training nodes, data nodes);
# "Ignored" rows are checked with both values of DATA_WORKER_GPULESS_ONLY.
SEED_TABLE = [
    pytest.param(0, 0, 0, (2,), (2,), id="row1-only0"),
    pytest.param(0, 0, 1, (2,), (2,), id="row1-only1-ignored"),
    pytest.param(0, 1, 0, (2,), (2, 3), id="row2"),
    pytest.param(0, 1, 1, (2,), (3,), id="row3"),
    pytest.param(1, 0, 0, (2, 3), (2,), id="row4-only0"),
    pytest.param(1, 0, 1, (2, 3), (2,), id="row4-only1-ignored"),
    pytest.param(1, 1, 0, (2, 3), (2, 3), id="row5"),
    pytest.param(1, 1, 1, (2, 3), (3,), id="row6"),
]


@pytest.mark.parametrize(("train", "data_on", "only", "train_nodes", "data_nodes"), SEED_TABLE)
def test_seed_asymmetric_table(tmp_path: Path, train: int, data_on: int, only: int,
                               train_nodes: tuple[int, ...], data_nodes: tuple[int, ...]) -> None:
    topo = asymmetric_4node(tmp_path)
    assert topo.gpus[2].node == 2 and topo.gpus_on(3) == ()
    plan = plan_of(topo, allow_asymmetric=True, train_on_gpuless=bool(train), data_worker_on_gpuless=bool(data_on),
                   data_worker_gpuless_only=bool(only))
    assert not plan.symmetric
    gpu2 = plan.ranks[2]
    assert gpu2.gpu == topo.gpus[2].pci and gpu2.node == 2 and gpu2.rule == "asymmetric"
    assert gpu2.training_nodes == train_nodes and gpu2.training_cpus == topo.cpus(*train_nodes)
    assert gpu2.data_nodes == data_nodes and gpu2.data_cpus == topo.cpus(*data_nodes)
    assert gpu2.memory_node == 2  # the GPU's own node stays the preferred memory
    assert gpu2.data_memory_node == (3 if data_nodes == (3,) else 2)
    # GPUs 0 and 1 have no GPU-less node on their socket: the options do not move them.
    for rank in (0, 1):
        assert plan.ranks[rank].training_cpus == plan.ranks[rank].data_cpus == topo.cpus(rank)


def test_asymmetric_needs_allow_asymmetric(tmp_path: Path) -> None:
    topo = asymmetric_4node(tmp_path)
    plan = plan_of(topo, train_on_gpuless=True, data_worker_on_gpuless=True)
    assert not plan.symmetric
    for r in plan.ranks:
        assert r.rule == UNBOUND and r.training_cpus is None and r.data_cpus is None
        assert "LOONGKIT_NUMA_AFFINITY_ALLOW_ASYMMETRIC=1" in r.why and "0:1, 1:1, 2:1, 3:0" in r.why


def test_asymmetric_gpuless_node_attached_by_socket_without_distances(tmp_path: Path) -> None:
    topo = asymmetric_4node(tmp_path)
    for node in range(4):
        (tmp_path / f"sys/devices/system/node/node{node}/distance").unlink()
    plan = plan_of(topo, allow_asymmetric=True, train_on_gpuless=True)
    assert plan.ranks[2].training_nodes == (2, 3)
    assert plan.ranks[0].training_nodes == (0,)
    assert any("attached to NUMA 2 by socket" in n for n in plan.notes)


# -- a container that narrowed the CPU mask -----------------------------------------------------------------
def test_narrowed_container_intersects(tmp_path: Path) -> None:
    topo = narrowed_container(tmp_path)
    plan = plan_of(topo)
    assert plan.allowed_cpus == parse_cpulist("4-11,20-27")
    for r in plan.ranks:
        node = r.local_rank // 4
        assert r.rule == "node"
        assert r.training_cpus == topo.cpus(node) & topo.allowed_cpus
        assert r.training_cpus == parse_cpulist("4-7,20-23" if node == 0 else "8-11,24-27")
        assert "outside the allowed mask" in r.why


def test_container_without_a_node_leaves_its_ranks_alone(tmp_path: Path) -> None:
    topo = narrowed_container(tmp_path, allowed_cpus="0-7,16-23")  # the container got node 0 only
    plan = plan_of(topo)
    assert [r.training_cpus for r in plan.ranks[:4]] == [topo.cpus(0)] * 4
    for r in plan.ranks[4:]:
        assert r.rule == UNBOUND and "none of the CPUs of NUMA 1 is allowed" in r.why


def test_launcher_binding_is_respected(tmp_path: Path) -> None:
    # torchrun --numa-binding=node: this process's mask is node 1, its cgroup has every CPU.
    topo = intel_2s_8gpu(tmp_path, allowed_cpus="8-15,24-31", cgroup_cpus="0-31")
    plan = plan_of(topo)
    for r in plan.ranks:
        assert r.rule == ALREADY_BOUND and r.training_cpus is None
        assert "NUMA 1" in r.why and "torchrun --numa-binding" in r.why


def test_launcher_binding_detected_without_cgroup_info(tmp_path: Path) -> None:
    topo = intel_2s_8gpu(tmp_path, allowed_cpus="0-7")
    for rel in ("sys/fs/cgroup/cpuset/cpuset.cpus", "sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        (tmp_path / rel).unlink()
    plan = plan_of(topo)
    assert all(r.rule == ALREADY_BOUND for r in plan.ranks)


def test_a_mask_missing_a_few_cpus_is_not_a_launcher_binding(tmp_path: Path) -> None:
    # isolcpus-like: the default mask lacks CPUs 15 and 31 but still spans both nodes.
    topo = intel_2s_8gpu(tmp_path, allowed_cpus="0-14,16-30", cgroup_cpus="0-31")
    plan = plan_of(topo)
    assert [r.rule for r in plan.ranks] == ["node"] * 8
    assert plan.ranks[4].training_cpus == parse_cpulist("8-14,24-30")


def test_plan_options_from_settings() -> None:
    opts, _ = load_opts({"LOONGKIT_NUMA_AFFINITY_PARTITION_PER_LLC": "on", "LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX": "1"})
    assert PlanOptions.from_options(opts) == PlanOptions(partition_per_llc=True)


def load_opts(environ: dict[str, str]) -> tuple[NumaAffinityOptions, list[str]]:
    from loongkit_core.settings import load_settings

    return load_settings(NumaAffinityOptions, environ=environ)


def test_plan_json_is_plain(tmp_path: Path) -> None:
    import json

    topo = asymmetric_4node(tmp_path)
    doc = plan_of(topo, allow_asymmetric=True, data_worker_on_gpuless=True, data_worker_gpuless_only=True).to_json()
    json.dumps(doc)
    assert doc["ranks"][2]["data_cpus"] == "12-15,28-31" and doc["ranks"][2]["training_cpus"] == "8-11,24-27"
