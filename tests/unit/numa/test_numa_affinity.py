"""The numa_affinity feature applied for real on this machine, in forked children.

The fixtures describe CPUs 0 and 1 as two NUMA nodes, so a 2-CPU machine can really bind: rank 1
ends up on CPU 1, its data worker where the plan says. The parent's mask is never touched.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest
from loongkit_numa import affinity
from loongkit_numa.affinity import (
    MPOL_PREFERRED,
    WORKER_PLAN_ENV,
    NumaAffinity,
    apply_worker_binding,
    get_memory_policy,
    on_data_worker_start,
    plan_for_node,
    set_preferred_memory_node,
    visible_gpus,
)
from loongkit_numa.options import NumaAffinityOptions
from numa_helpers import (
    gpus_by_index,
    make_ctx,
    make_env,
    needs_pci_torch,
    numa_feature,
    require_cpus_0_1,
    run_forked,
    torch_without_gpu_pci,
)

from loongkit_core.context import NotApplicable
from loongkit_core.hardware import detect, format_cpulist
from loongkit_core.process import HELPER, LAUNCHER, WORKER
from loongkit_core.settings import load_settings
from loongkit_core.testing.topology import intel_2s_8gpu, two_cpu_two_node, write_topology

ASYM = {"LOONGKIT_NUMA_AFFINITY_ALLOW_ASYMMETRIC": "1", "LOONGKIT_NUMA_AFFINITY_DATA_WORKER_ON_GPULESS": "1",
        "LOONGKIT_NUMA_AFFINITY_DATA_WORKER_GPULESS_ONLY": "1"}


@pytest.fixture(autouse=True)
def _clean_handoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKER_PLAN_ENV, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def options_for(environ: dict[str, str]) -> NumaAffinityOptions:
    return load_settings(NumaAffinityOptions, environ=environ)[0]


def fake_workers_module(monkeypatch: pytest.MonkeyPatch) -> list:
    """Stand in for the core's loongkit_core.workers: record the callbacks registered."""
    registered: list = []
    module = types.ModuleType("loongkit_core.workers")
    module.on_worker_start = lambda cb, owner="": registered.append(cb)  # type: ignore[attr-defined]
    module.forget = lambda cb: None  # type: ignore[attr-defined]  # what the undo calls
    monkeypatch.setitem(sys.modules, "loongkit_core.workers", module)
    return registered


def test_trainer_binds_rank_and_restores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_cpus_0_1()
    two_cpu_two_node(tmp_path)
    registered = fake_workers_module(monkeypatch)
    env = make_env(str(tmp_path), gpus_by_index(), local_rank=1, local_world_size=2)
    impl = NumaAffinity(numa_feature())
    options, warnings = impl.configure(env, None)
    assert warnings == []
    ctx, log = make_ctx(env, options)

    def child() -> dict:
        before = sorted(os.sched_getaffinity(0))
        impl.activate(ctx, None)
        bound = sorted(os.sched_getaffinity(0))
        handoff = json.loads(os.environ[WORKER_PLAN_ENV])
        hooks = [cb.__name__ for cb in registered]
        impl.deactivate(ctx)
        return {"before": before, "bound": bound, "after": sorted(os.sched_getaffinity(0)), "handoff": handoff,
                "hooks": hooks, "calls": ctx.record.calls, "details": ctx.record.details, "log": log.text(),
                "config": ctx.record.config, "env_after": os.environ.get(WORKER_PLAN_ENV)}

    out = run_forked(child)
    assert out["bound"] == [1]
    assert out["after"] == out["before"]  # deactivate restored the original mask
    assert out["handoff"]["cpus"] == "1" and out["handoff"]["mem"] == 1
    assert out["hooks"] == ["on_data_worker_start"]
    assert out["calls"] == 1
    assert out["details"]["plan"]["training_cpus"] == "1" and out["details"]["plan"]["rule"] == "node"
    assert "index order" in out["details"]["gpu_source"]
    # NUMA 1 does not exist on this machine: the memory policy is skipped with a reason, not an error.
    assert out["details"]["memory"].startswith("skipped: set_mempolicy(MPOL_PREFERRED, node 1) failed")
    assert "memory binding skipped" in out["log"] and "bound to CPUs 1" in out["log"]
    assert out["config"] == {"allow_asymmetric": False, "allow_index": bool(gpus_by_index())}
    assert out["env_after"] is None


def test_trainer_prefers_its_memory_node(tmp_path: Path) -> None:
    require_cpus_0_1()
    two_cpu_two_node(tmp_path)
    env = make_env(str(tmp_path), gpus_by_index(), local_rank=0, local_world_size=2)
    impl = NumaAffinity(numa_feature())
    ctx, _ = make_ctx(env, impl.configure(env, None)[0])

    def child() -> dict:
        impl.activate(ctx, None)
        policy = get_memory_policy()
        return {"cpus": sorted(os.sched_getaffinity(0)), "policy": policy, "memory": ctx.record.details["memory"]}

    out = run_forked(child)
    assert out["cpus"] == [0]
    if out["memory"].startswith("skipped"):  # a seccomp profile may forbid set_mempolicy: said, not raised
        assert "not permitted" in out["memory"] or "failed" in out["memory"]
    else:
        assert out["memory"] == "preferred node 0"
        assert out["policy"][0] == MPOL_PREFERRED and out["policy"][1] == [0]


def test_default_deactivate_restores_and_reapplies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No deactivate of its own: ctx.patcher.undo() puts back the CPU mask, the memory policy and the
    workers' plan (a value that was there before comes back); activating again binds again."""
    require_cpus_0_1()
    two_cpu_two_node(tmp_path)
    fake_workers_module(monkeypatch)
    monkeypatch.setenv(WORKER_PLAN_ENV, "an older plan")
    env = make_env(str(tmp_path), gpus_by_index(), local_rank=0, local_world_size=2)
    impl = NumaAffinity(numa_feature())
    ctx, _ = make_ctx(env, impl.configure(env, None)[0])

    def state() -> tuple:
        return sorted(os.sched_getaffinity(0)), get_memory_policy(), os.environ.get(WORKER_PLAN_ENV)

    def child() -> list:
        seen = [state()]
        for _ in range(2):
            impl.activate(ctx, None)
            seen.append((state(), ctx.record.details["memory"]))
            impl.deactivate(ctx)
            seen.append((state(), len(ctx.patcher)))
        return seen

    before, *rounds = run_forked(child)
    assert before[0] == [0, 1] and before[2] == "an older plan"
    for during, after in (rounds[0:2], rounds[2:4]):
        (cpus, policy, plan), memory = during
        assert cpus == [0] and json.loads(plan)["cpus"] == "0"
        if memory == "preferred node 0":  # a seccomp profile may forbid set_mempolicy
            assert policy[0] == MPOL_PREFERRED
        assert after == [before, 0]  # run_forked hands back JSON: lists


def test_worker_role_gets_data_cpus(tmp_path: Path) -> None:
    require_cpus_0_1()
    two_cpu_two_node(tmp_path)
    handoff = json.dumps({"cpus": "0", "mem": 0, "rank": 0})
    env = make_env(str(tmp_path), {WORKER_PLAN_ENV: handoff}, role=WORKER)
    impl = NumaAffinity(numa_feature())
    assert impl.detect(env) is None
    ctx, _ = make_ctx(env, impl.configure(env, None)[0])

    def child() -> dict:
        os.sched_setaffinity(0, {1})  # what a fork of a rank-1 trainer inherits
        impl.activate(ctx, None)
        return {"cpus": sorted(os.sched_getaffinity(0)), "calls": ctx.record.calls, "worker": ctx.record.details}

    out = run_forked(child)
    assert out["cpus"] == [0] and out["calls"] == 1
    assert "data worker bound to CPUs 0" in out["worker"]["worker"]


def test_worker_without_handoff_is_not_applicable(tmp_path: Path) -> None:
    two_cpu_two_node(tmp_path)
    env = make_env(str(tmp_path), role=WORKER)
    impl = NumaAffinity(numa_feature())
    ctx, _ = make_ctx(env, impl.configure(env, None)[0])
    with pytest.raises(NotApplicable, match="no NUMA plan from a training process"):
        impl.activate(ctx, None)


def test_asymmetric_data_worker_moves_to_the_gpuless_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer on CPU 0 (GPU node), its forked DataLoader worker on CPU 1 (GPU-less node), per the plan."""
    require_cpus_0_1()
    write_topology(tmp_path, nodes=2, cores_per_node=1, smt=1, gpus_per_node=(1, 0))
    registered = fake_workers_module(monkeypatch)
    env = make_env(str(tmp_path), {**ASYM, **gpus_by_index()}, local_rank=0, local_world_size=1)
    impl = NumaAffinity(numa_feature())
    ctx, _ = make_ctx(env, impl.configure(env, None)[0])

    def child() -> dict:
        impl.activate(ctx, None)
        trainer = sorted(os.sched_getaffinity(0))
        # A forked DataLoader worker: the core calls the registered callback with its worker id.
        worker = run_forked(lambda: (registered[0](0), sorted(os.sched_getaffinity(0)))[1])
        # A spawned one boots loongkit again in the WORKER role with the inherited environment.
        spawned_env = make_env(str(tmp_path), dict(os.environ), role=WORKER)
        spawned_ctx, _ = make_ctx(spawned_env, impl.configure(spawned_env, None)[0])
        spawned = run_forked(lambda: (NumaAffinity(numa_feature()).activate(spawned_ctx, None),
                                      sorted(os.sched_getaffinity(0)))[1])
        return {"trainer": trainer, "worker": worker, "spawned": spawned, "plan": ctx.record.details["plan"]}

    out = run_forked(child)
    assert out["plan"]["training_cpus"] == "0" and out["plan"]["data_cpus"] == "1"
    assert out["trainer"] == [0] and out["worker"] == [1] and out["spawned"] == [1]


def test_summary_config_shows_the_seed_keys_and_what_is_on() -> None:
    from loongkit_numa.affinity import summary_config

    assert summary_config(options_for({})) == {"allow_asymmetric": False, "allow_index": False}
    assert summary_config(options_for({"LOONGKIT_NUMA_AFFINITY_PARTITION_PER_LLC": "1"})) == {
        "allow_asymmetric": False, "allow_index": False, "partition_per_llc": True}


def test_on_data_worker_start_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKER_PLAN_ENV, "{not json")
    on_data_worker_start(0)  # garbled hand-off: logged, not raised
    assert apply_worker_binding()[0] is False
    assert "garbled" in apply_worker_binding()[1]
    assert apply_worker_binding({WORKER_PLAN_ENV: json.dumps({"cpus": ""})}) == (
        False, "the training process planned no data CPUs")


def test_missing_workers_module_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_cpus_0_1()
    two_cpu_two_node(tmp_path)
    monkeypatch.setitem(sys.modules, "loongkit_core.workers", None)  # import fails
    env = make_env(str(tmp_path), gpus_by_index(), local_rank=0, local_world_size=2)
    impl = NumaAffinity(numa_feature())
    ctx, log = make_ctx(env, impl.configure(env, None)[0])
    out = run_forked(lambda: (impl.activate(ctx, None), sorted(os.sched_getaffinity(0)), log.text())[1:])
    assert out[0] == [0] and "loongkit_core.workers unavailable" in out[1]


def test_planned_cpus_outside_this_process_are_not_applicable(tmp_path: Path) -> None:
    intel_2s_8gpu(tmp_path)  # rank 4 belongs on CPUs 8-15,24-31, which this machine lacks
    env = make_env(str(tmp_path), gpus_by_index(), local_rank=4, local_world_size=8)
    impl = NumaAffinity(numa_feature())
    ctx, _ = make_ctx(env, impl.configure(env, None)[0])
    with pytest.raises(NotApplicable, match="outside this process's CPUs"):
        impl.activate(ctx, None)
    assert ctx.record.calls == 0


def test_unbound_plan_reason_becomes_not_applicable(tmp_path: Path) -> None:
    write_topology(tmp_path, nodes=2, cores_per_node=1, smt=1, gpus_per_node=(1, 0))  # asymmetric
    env = make_env(str(tmp_path), gpus_by_index(), local_rank=0, local_world_size=1)
    impl = NumaAffinity(numa_feature())
    ctx, _ = make_ctx(env, impl.configure(env, None)[0])
    with pytest.raises(NotApplicable, match="ALLOW_ASYMMETRIC=1"):
        impl.activate(ctx, None)
    assert ctx.record.details["plan"]["rule"] == "unbound"


def test_detect(tmp_path: Path) -> None:
    impl = NumaAffinity(numa_feature())
    two_cpu_two_node(tmp_path)
    assert impl.detect(make_env(str(tmp_path))) is None
    assert impl.detect(make_env(str(tmp_path), role=LAUNCHER)) == "nothing to bind in a launcher process"
    assert impl.detect(make_env(str(tmp_path), role=HELPER)) == "nothing to bind in a helper process"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no GPU found under" in (impl.detect(make_env(str(empty))) or "")
    no_gpu = tmp_path / "nogpu"
    write_topology(no_gpu, gpus_per_node=(0, 0))
    assert "no GPU found under" in (impl.detect(make_env(str(no_gpu))) or "")


# -- which GPU each rank uses ------------------------------------------------------------------------------
def test_old_torch_needs_allow_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    intel_2s_8gpu(tmp_path)
    hw = detect(str(tmp_path))
    monkeypatch.setattr(affinity, "_torch_version", lambda: (2, 4))
    with pytest.raises(NotApplicable, match="ALLOW_INDEX=1"):
        visible_gpus(hw, options_for({}), {}, local_world_size=8, use_torch=False)
    plan = plan_for_node(hw, options_for({}), {}, local_world_size=8, use_torch=False)
    assert all(not r.bound and "torch 2.4" in r.why for r in plan.ranks)
    gpus, source = visible_gpus(hw, options_for({"LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX": "1"}),
                                {"CUDA_VISIBLE_DEVICES": "3,2"}, local_world_size=8, use_torch=False)
    assert gpus == list(hw.accelerators)
    assert "LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX=1" in source and "CUDA_VISIBLE_DEVICES is ignored" in source


def test_old_torch_feature_not_applicable_then_allow_index_binds(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the feature, on a torch that cannot report PCI addresses (this one, or one made to look so):
    not applicable with the reason; LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX=1 binds rank N by index order."""
    require_cpus_0_1()
    two_cpu_two_node(tmp_path)
    old = torch_without_gpu_pci() or (2, 4)
    monkeypatch.setattr(affinity, "_torch_version", lambda: old)
    fake_workers_module(monkeypatch)

    def activate(environ: dict[str, str]) -> dict:
        env = make_env(str(tmp_path), environ, local_rank=1, local_world_size=2)
        impl = NumaAffinity(numa_feature())
        ctx, _ = make_ctx(env, impl.configure(env, None)[0])

        def child() -> dict:
            try:
                impl.activate(ctx, None)
            except NotApplicable as exc:
                return {"not_applicable": str(exc), "calls": ctx.record.calls}
            return {"cpus": sorted(os.sched_getaffinity(0)), "details": ctx.record.details,
                    "config": ctx.record.config}

        return run_forked(child)

    refused = activate({})
    assert refused["calls"] == 0
    assert refused["not_applicable"] == (
        f"torch {old[0]}.{old[1]} cannot report the GPU's PCI address (needs torch >= 2.5); set "
        "LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX=1 to bind by index order (and leave CUDA_VISIBLE_DEVICES unset)")
    bound = activate({"LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX": "1"})
    assert bound["cpus"] == [1] and bound["details"]["plan"]["training_cpus"] == "1"
    assert bound["details"]["gpu_source"] == (
        "index order: local rank N uses the N-th GPU in PCI order (LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX=1)")
    assert bound["config"]["allow_index"] is True


def test_old_torch_without_gpus_says_no_gpu_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU to identify: the plan (``loongkit numa plan``) gives the reason the feature's detect gives,
    not torch's version and an ALLOW_INDEX that would change nothing."""
    write_topology(tmp_path, gpus_per_node=(0, 0))
    hw = detect(str(tmp_path))
    monkeypatch.setattr(affinity, "_torch_version", lambda: (2, 4))
    assert visible_gpus(hw, options_for({}), {}, local_world_size=2, use_torch=False)[0] == []
    plan = plan_for_node(hw, options_for({}), {}, local_world_size=2, use_torch=False)
    assert all(not r.bound and r.why.startswith("no GPU found under") for r in plan.ranks)
    assert "torch" not in plan.gpu_source


def test_torch_pci_addresses_honour_device_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    topo = intel_2s_8gpu(tmp_path)
    hw = detect(str(tmp_path))
    monkeypatch.setattr(affinity, "_torch_version", lambda: (2, 6))
    # CUDA_VISIBLE_DEVICES=5,0: torch's cuda:0 is the sixth GPU in PCI order.
    monkeypatch.setattr(affinity, "_torch_pci_addresses",
                        lambda: [topo.gpus[5].pci[:-2], topo.gpus[0].pci[:-2]])
    plan = plan_for_node(hw, options_for({}), {}, local_world_size=2, use_torch=True)
    assert [r.gpu for r in plan.ranks] == [topo.gpus[5].pci, topo.gpus[0].pci]
    assert [r.node for r in plan.ranks] == [1, 0]
    assert "PCI addresses" in plan.gpu_source


def test_torch_one_visible_gpu_per_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    topo = intel_2s_8gpu(tmp_path)
    hw = detect(str(tmp_path))
    monkeypatch.setattr(affinity, "_torch_version", lambda: (2, 6))
    monkeypatch.setattr(affinity, "_torch_pci_addresses", lambda: [topo.gpus[6].pci[:-2]])
    plan = plan_for_node(hw, options_for({}), {}, local_world_size=8, local_rank=6, use_torch=True)
    assert plan.rank(6).gpu == topo.gpus[6].pci and plan.rank(6).training_cpus == topo.cpus(1)
    assert not plan.rank(0).bound


def test_torch_gpu_missing_from_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    intel_2s_8gpu(tmp_path)
    monkeypatch.setattr(affinity, "_torch_version", lambda: (2, 6))
    monkeypatch.setattr(affinity, "_torch_pci_addresses", lambda: ["0000:ee:00"])
    with pytest.raises(NotApplicable, match="0000:ee:00 not found"):
        visible_gpus(detect(str(tmp_path)), options_for({}), {}, local_world_size=1, use_torch=True)


def test_torch_without_cuda_falls_back_to_index_order(tmp_path: Path) -> None:
    """The real torch here is a CPU build: asking it yields nothing, and index order is used, said so."""
    needs_pci_torch()
    intel_2s_8gpu(tmp_path)
    hw = detect(str(tmp_path))
    gpus, source = visible_gpus(hw, options_for({}), {}, local_world_size=8, use_torch=True)
    assert gpus == list(hw.accelerators)
    assert source.startswith("index order") and "no CUDA device visible to torch" in source


def test_set_and_reset_memory_policy_in_child() -> None:
    def child() -> list:
        first = set_preferred_memory_node(0)
        state = get_memory_policy()
        reset = set_preferred_memory_node(None)
        return [first, state, reset, get_memory_policy()]

    first, state, reset, after = run_forked(child)
    if first is None:
        assert state == [MPOL_PREFERRED, [0]]
    else:
        assert "set_mempolicy" in first
    assert reset is None and after == [0, []]
    assert "out of range" in (set_preferred_memory_node(1 << 20) or "")


def test_cpulist_of_handoff_matches_plan(tmp_path: Path) -> None:
    """The data CPUs a worker receives are the plan's data CPUs within the trainer's original mask."""
    require_cpus_0_1()
    two_cpu_two_node(tmp_path)
    env = make_env(str(tmp_path), gpus_by_index(), local_rank=1, local_world_size=2)
    impl = NumaAffinity(numa_feature())
    ctx, _ = make_ctx(env, impl.configure(env, None)[0])
    out = run_forked(lambda: (impl.activate(ctx, None), os.environ[WORKER_PLAN_ENV])[1])
    plan = plan_for_node(env.hardware, options_for(gpus_by_index()), {}, local_world_size=2, use_torch=False)
    assert json.loads(out)["cpus"] == format_cpulist(plan.rank(1).data_cpus or ())
