"""NUMA-level reading of the core's :class:`~loongkit_core.hardware.Hardware` (pure; no side effects).

Answers the questions the planner asks: which node each GPU hangs off, whether the GPUs are spread
evenly over the nodes (symmetric), which GPU-less nodes belong with which GPU node, and how a CPU
set splits into L3 caches without splitting a physical core.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loongkit_core.hardware import Gpu, Hardware, format_cpulist


def nodes_text(nodes: Iterable[int]) -> str:
    """``NUMA 2,3`` - the seed's way of naming node sets."""
    return "NUMA " + ",".join(str(n) for n in sorted(nodes))


@dataclass(frozen=True)
class NodeLayout:
    cpu_nodes: tuple[int, ...]  # nodes that have CPUs (memory-only nodes cannot run anything)
    gpu_node: dict[str, int | None]  # accelerator PCI address -> its node (None: unknown)
    gpus_per_node: dict[int, int]  # over cpu_nodes, every accelerator of the machine counted
    symmetric: bool
    gpuless_neighbours: dict[int, frozenset[int]]  # GPU node -> the GPU-less nodes attached to it
    notes: tuple[str, ...]

    def describe(self) -> str:
        if not any(self.gpus_per_node.values()):
            return "no GPUs on any NUMA node"
        counts = ", ".join(f"{n}:{self.gpus_per_node.get(n, 0)}" for n in self.cpu_nodes)
        return f"{'symmetric' if self.symmetric else 'asymmetric'} (GPUs per NUMA node {counts})"


def gpu_node(hw: Hardware, gpu: Gpu) -> tuple[int | None, str]:
    """The node of ``gpu`` and, when sysfs had to be second-guessed, how it was inferred."""
    cpu_nodes = [n for n in hw.nodes if n.cpus]
    if gpu.numa_node is not None and hw.node(gpu.numa_node) is not None:
        return gpu.numa_node, ""
    # Firmware often reports numa_node -1; local_cpulist still says which CPUs are close.
    if gpu.local_cpus:
        owners = [n.id for n in cpu_nodes if gpu.local_cpus & n.cpus]
        if len(owners) == 1:
            return owners[0], f"GPU {gpu.pci}: numa_node unknown, NUMA {owners[0]} inferred from local_cpulist"
    if len(cpu_nodes) == 1:
        return cpu_nodes[0].id, ""
    return None, f"GPU {gpu.pci}: NUMA node unknown (numa_node -1, local_cpulist spans several nodes)"


def layout(hw: Hardware) -> NodeLayout:
    notes: list[str] = []
    cpu_nodes = tuple(n.id for n in hw.nodes if n.cpus)
    placed: dict[str, int | None] = {}
    for gpu in hw.accelerators:
        node, how = gpu_node(hw, gpu)
        placed[gpu.pci] = node
        if how:
            notes.append(how)
    counts = {n: 0 for n in cpu_nodes}
    for node in placed.values():
        if node is not None and node in counts:
            counts[node] += 1
    distinct = set(counts.values())
    # Symmetric: every node that can run code carries the same, non-zero number of GPUs.
    symmetric = bool(cpu_nodes) and len(distinct) == 1 and 0 not in distinct and None not in placed.values()
    return NodeLayout(
        cpu_nodes=cpu_nodes,
        gpu_node=placed,
        gpus_per_node=counts,
        symmetric=symmetric,
        gpuless_neighbours=_gpuless_neighbours(hw, counts, notes),
        notes=tuple(notes),
    )


def _gpuless_neighbours(hw: Hardware, counts: dict[int, int], notes: list[str]) -> dict[int, frozenset[int]]:
    """Attach each GPU-less node to the nearest GPU node(s): by SLIT distance, else by socket.

    A GPU-less node on the other socket is no help to a GPU's processes, so "may use GPU-less
    nodes" means the ones nearest to the GPU's node; ties attach a node to every tied GPU node.
    """
    gpu_nodes = [n for n, c in counts.items() if c > 0]
    if not gpu_nodes:
        return {}
    attached: dict[int, set[int]] = {n: set() for n in gpu_nodes}
    for spare in (n for n, c in counts.items() if c == 0):
        node = hw.node(spare)
        assert node is not None
        distances = {g: node.distance_to(g) for g in gpu_nodes}
        if gpu_nodes and all(d is not None for d in distances.values()):
            best = min(d for d in distances.values() if d is not None)
            nearest = [g for g, d in distances.items() if d == best]
        else:
            package = _package(hw, node.cpus)
            nearest = [g for g in gpu_nodes if package is not None and _package(hw, _cpus(hw, g)) == package]
            if not nearest:
                nearest = list(gpu_nodes)
            notes.append(f"NUMA {spare}: no distance table; attached to {nodes_text(nearest)} by socket")
        for g in nearest:
            attached[g].add(spare)
    return {g: frozenset(s) for g, s in attached.items()}


def _cpus(hw: Hardware, node_id: int) -> frozenset[int]:
    node = hw.node(node_id)
    return node.cpus if node is not None else frozenset()


def _package(hw: Hardware, cpus: frozenset[int]) -> int | None:
    for cpu in sorted(cpus):
        info = hw.cpu(cpu)
        if info is not None and info.package_id is not None:
            return info.package_id
    return None


def node_cpus(hw: Hardware, nodes: Iterable[int]) -> frozenset[int]:
    return frozenset().union(*(_cpus(hw, n) for n in nodes))


def l3_units(hw: Hardware, cpus: frozenset[int]) -> tuple[list[frozenset[int]] | None, str]:
    """``cpus`` cut into L3 caches (ordered by lowest CPU), or None and the reason it cannot be.

    An L3 spanning several nodes (Intel sub-NUMA clustering) contributes only its part in ``cpus``.
    Refused when a CPU has no L3 information, or when an L3 boundary would split the SMT threads of a
    physical core (garbled sysfs) - partitioning must hand whole cores to one rank.
    """
    units: dict[int, set[int]] = {}
    unknown: list[int] = []
    for cpu in cpus:
        info = hw.cpu(cpu)
        if info is None or info.l3 is None:
            unknown.append(cpu)
            continue
        units.setdefault(info.l3, set()).add(cpu)
    if unknown:
        return None, f"no L3 information for CPUs {format_cpulist(unknown)}"
    ordered = [frozenset(u) for u in sorted(units.values(), key=min)]
    for unit in ordered:
        for cpu in unit:
            info = hw.cpu(cpu)
            siblings = (info.siblings if info is not None else frozenset()) & cpus
            if not siblings <= unit:
                return None, f"L3 cache {format_cpulist(unit)} splits the SMT threads {format_cpulist(siblings)}"
    return ordered, ""


def physical_cores(hw: Hardware, cpus: frozenset[int]) -> int:
    """How many physical cores ``cpus`` touches (SMT threads of one core count once)."""
    seen: set[frozenset[int]] = set()
    for cpu in cpus:
        info = hw.cpu(cpu)
        seen.add(info.siblings if info is not None and info.siblings else frozenset({cpu}))
    return len(seen)
