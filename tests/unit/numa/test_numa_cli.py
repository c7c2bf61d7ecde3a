"""``loongkit numa plan`` on each fixture topology, as text and JSON; and plan == what is applied."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loongkit_numa.affinity import WORKER_PLAN_ENV, NumaAffinity
from loongkit_numa.cli import main
from loongkit_numa.plugin import plugin
from numa_helpers import gpus_by_index, make_ctx, make_env, numa_feature, require_cpus_0_1, run_forked

from loongkit_core.testing.topology import amd_2s_8gpu, asymmetric_4node, intel_2s_8gpu, narrowed_container


@pytest.fixture(autouse=True)
def _no_numa_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("LOONGKIT_", "_LOONGKIT_")) or name in ("LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
            monkeypatch.delenv(name)


@pytest.fixture
def plan_finds_gpus(_no_numa_env: None, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """For tests of the plan's rules and rendering: on torch < 2.5 the documented index fallback (what a
    fake sysfs root gets on newer torch anyway), on newer torch nothing. Returns what it set."""
    environ = gpus_by_index()
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    return environ


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def plan_text(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out.splitlines()


def table(lines: list[str]) -> list[list[str]]:
    start = next(i for i, line in enumerate(lines) if line.startswith("rank  GPU"))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


@pytest.mark.usefixtures("plan_finds_gpus")
def test_intel_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topo = intel_2s_8gpu(tmp_path)
    doc = plan_json(capsys, "--sysfs-root", str(tmp_path))
    assert doc["symmetric"] is True and doc["hardware"]["cpu_vendor"] == "intel"
    assert doc["options"]["partition_per_llc"] is False and "Intel" in doc["policy"]
    assert [(r["local_rank"], r["gpu"], r["node"], r["training_cpus"], r["data_cpus"], r["memory_node"], r["rule"])
            for r in doc["ranks"]] == [
        (i, topo.gpus[i].pci, i // 4, topo.cpulist(i // 4), topo.cpulist(i // 4), i // 4, "node") for i in range(8)]


@pytest.mark.usefixtures("plan_finds_gpus")
def test_intel_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    intel_2s_8gpu(tmp_path)
    lines = plan_text(capsys, "--sysfs-root", str(tmp_path), "--nproc-per-node", "2")
    assert lines[0].startswith("NUMA plan for 2 local rank(s)")
    assert "symmetric (GPUs per NUMA node 0:4, 1:4)" in lines[0]
    assert "rank  GPU           node  training CPUs  data CPUs  memory  data memory  rule" in lines
    assert table(lines) == [
        ["0", "0000:18:00.0", "0", "0-7,16-23", "0-7,16-23", "0", "0", "node"],
        ["1", "0000:28:00.0", "0", "0-7,16-23", "0-7,16-23", "0", "0", "node"],
    ]
    assert "rank 1: symmetric: NUMA 0 of GPU 0000:28:00.0" in lines


@pytest.mark.usefixtures("plan_finds_gpus")
def test_amd_llc_by_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    amd_2s_8gpu(tmp_path)
    lines = plan_text(capsys, "--sysfs-root", str(tmp_path))
    assert "policy: AMD CPU: PARTITION_PER_LLC on by default (segmented L3 caches)" in lines
    rows = table(lines)
    assert [r[3] for r in rows] == ["0-3,32-35", "4-7,36-39", "8-11,40-43", "12-15,44-47",
                                    "16-19,48-51", "20-23,52-55", "24-27,56-59", "28-31,60-63"]
    assert {r[7] for r in rows} == {"node+llc"}


@pytest.mark.usefixtures("plan_finds_gpus")
def test_amd_explicit_off_wins_over_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    topo = amd_2s_8gpu(tmp_path)
    monkeypatch.setenv("LOONGKIT_NUMA_AFFINITY_PARTITION_PER_LLC", "0")
    doc = plan_json(capsys, "--sysfs-root", str(tmp_path))
    assert doc["ranks"][0]["training_cpus"] == topo.cpulist(0) and doc["ranks"][0]["rule"] == "node"


@pytest.mark.usefixtures("plan_finds_gpus")
def test_asymmetric_unbound_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    asymmetric_4node(tmp_path)
    lines = plan_text(capsys, "--sysfs-root", str(tmp_path))
    assert [r[3:] for r in table(lines)] == [["unchanged", "unchanged", "-", "-", "unbound"]] * 3
    assert any(line.startswith("all ranks: asymmetric") and "ALLOW_ASYMMETRIC=1" in line for line in lines)


@pytest.mark.usefixtures("plan_finds_gpus")
def test_asymmetric_row6_json(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    topo = asymmetric_4node(tmp_path)
    for option in ("ALLOW_ASYMMETRIC", "TRAIN_ON_GPULESS", "DATA_WORKER_ON_GPULESS", "DATA_WORKER_GPULESS_ONLY"):
        monkeypatch.setenv(f"LOONGKIT_NUMA_AFFINITY_{option}", "1")
    doc = plan_json(capsys, "--sysfs-root", str(tmp_path))
    gpu2 = doc["ranks"][2]
    assert (gpu2["node"], gpu2["training_cpus"], gpu2["data_cpus"]) == (2, topo.cpulist(2, 3), topo.cpulist(3))
    assert (gpu2["training_nodes"], gpu2["data_nodes"]) == ([2, 3], [3])
    assert (gpu2["memory_node"], gpu2["data_memory_node"]) == (2, 3)


@pytest.mark.usefixtures("plan_finds_gpus")
def test_narrowed_container_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    narrowed_container(tmp_path)
    lines = plan_text(capsys, "--sysfs-root", str(tmp_path))
    assert "allowed CPUs: 4-11,20-27" in lines
    rows = table(lines)
    assert [r[3] for r in rows] == ["4-7,20-23"] * 4 + ["8-11,24-27"] * 4


@pytest.mark.usefixtures("plan_finds_gpus")
def test_bad_option_warns_and_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    intel_2s_8gpu(tmp_path)
    monkeypatch.setenv("LOONGKIT_NUMA_AFFINITY_ALLOW_ASYMMETRIC", "sure")
    assert main(["plan", "--sysfs-root", str(tmp_path), "--nproc-per-node", "1"]) == 0
    captured = capsys.readouterr()
    assert "LOONGKIT_NUMA_AFFINITY_ALLOW_ASYMMETRIC='sure' is invalid" in captured.err
    assert "0000:18:00.0" in captured.out


def test_old_torch_plan_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """On torch < 2.5 (made to look so here) GPUs cannot be identified: every rank unbound, with the remedy."""
    from loongkit_numa import affinity

    intel_2s_8gpu(tmp_path)
    monkeypatch.setattr(affinity, "_torch_version", lambda: (2, 4))
    lines = plan_text(capsys, "--sysfs-root", str(tmp_path), "--nproc-per-node", "2")
    assert [r[1:] for r in table(lines)] == [["-", "-", "unchanged", "unchanged", "-", "-", "unbound"]] * 2
    assert "all ranks: torch 2.4 cannot report the GPU's PCI address (needs torch >= 2.5); set " \
           "LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX=1 to bind by index order (and leave CUDA_VISIBLE_DEVICES unset)" in lines


def test_nproc_from_local_world_size_and_validation(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    intel_2s_8gpu(tmp_path)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert len(plan_json(capsys, "--sysfs-root", str(tmp_path))["ranks"]) == 3
    assert main(["plan", "--sysfs-root", str(tmp_path), "--nproc-per-node", "0"]) == 2


@pytest.mark.usefixtures("plan_finds_gpus")
def test_through_the_plugin_cli_hook(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As the core's ``loongkit`` command wires it: subcommands from the hook, then ``args.func(args)``."""
    intel_2s_8gpu(tmp_path)
    parser = argparse.ArgumentParser(prog="loongkit")
    plugin.loongkit_add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["numa", "plan", "--sysfs-root", str(tmp_path), "--nproc-per-node", "1", "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][0]["node"] == 0
    bare = parser.parse_args(["numa"])
    assert bare.func(bare) == 2


def test_module_entry_runs(tmp_path: Path) -> None:
    asymmetric_4node(tmp_path)
    out = subprocess.run([sys.executable, "-m", "loongkit_numa.cli", "plan", "--sysfs-root", str(tmp_path)],
                         check=True, capture_output=True, text=True).stdout
    assert "asymmetric (GPUs per NUMA node 0:1, 1:1, 2:1, 3:0)" in out


def test_real_machine_plan_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(capsys)  # this machine: no GPU
    assert doc["hardware"]["root"] == "/"
    if not doc["hardware"]["gpus"]:
        assert all(not r["training_cpus"] and "no GPU found" in r["why"] for r in doc["ranks"])


def test_feature_applies_exactly_what_plan_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  plan_finds_gpus: dict[str, str]) -> None:
    from loongkit_core.testing.topology import two_cpu_two_node

    require_cpus_0_1()
    two_cpu_two_node(tmp_path)
    printed = plan_json(capsys, "--sysfs-root", str(tmp_path), "--nproc-per-node", "2")["ranks"]
    for rank in (0, 1):
        env = make_env(str(tmp_path), plan_finds_gpus, local_rank=rank, local_world_size=2)
        impl = NumaAffinity(numa_feature())
        ctx, _ = make_ctx(env, impl.configure(env, None)[0])

        def child(impl: NumaAffinity = impl, ctx: object = ctx) -> dict:
            monkeypatch.delenv(WORKER_PLAN_ENV, raising=False)
            impl.activate(ctx, None)  # type: ignore[arg-type]
            return {"plan": ctx.record.details["plan"], "cpus": sorted(os.sched_getaffinity(0)),  # type: ignore[attr-defined]
                    "data": json.loads(os.environ[WORKER_PLAN_ENV])["cpus"]}

        applied = run_forked(child)
        assert applied["plan"] == printed[rank]
        assert ",".join(map(str, applied["cpus"])) == printed[rank]["training_cpus"]
        assert applied["data"] == printed[rank]["data_cpus"]
