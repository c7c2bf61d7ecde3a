"""Generate fake sysfs/procfs trees describing a machine, for tests and dry runs.

The trees are produced by code (never hand-made), so each fixture states its shape in one call and
its expected answers come back in the returned :class:`Topology`. Point the core at one with
``LOONGKIT_SYSFS_ROOT=<root>`` or ``loongkit numa plan --sysfs-root <root>``.

CPU numbering follows Linux on x86 servers: the first SMT thread of every core comes first, node by
node, then the second threads in the same order (2 nodes x 8 cores x 2: node 0 is ``0-7,16-23``).

Presets (also from the shell: ``python -m loongkit_core.testing.topology PRESET DIR``):

* :func:`intel_2s_8gpu` - 8 GPUs on 2 Intel sockets, one L3 per socket;
* :func:`amd_2s_8gpu` - 8 GPUs on 2 AMD sockets, 4 L3 caches (CCDs) per node, SMT;
* :func:`asymmetric_4node` - the product documentation's asymmetric example: GPU 2 lives on
  NUMA 2, NUMA 3 has no GPU and is NUMA 2's neighbour on the same socket;
* :func:`narrowed_container` - GPUs on both nodes, the container's cpuset covers only part of them;
* :func:`two_cpu_two_node` - 2 CPUs as 2 nodes with one GPU each: real bindings on a 2-CPU box.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loongkit_core.hardware import format_cpulist

GPU_DEVICE_ID = "0x2330"  # H100 SXM; any value works, the core reads the vendor and class only


@dataclass(frozen=True)
class FakeGpu:
    index: int  # position in PCI order (what index-order binding calls GPU <index>)
    pci: str
    node: int  # the node it is attached to (even when the tree hides it as numa_node -1)


@dataclass(frozen=True)
class Topology:
    """What was written, to assert against."""

    root: str
    vendor_id: str
    online_cpus: frozenset[int]
    node_cpus: dict[int, frozenset[int]]
    l3_groups: tuple[frozenset[int], ...]
    siblings: dict[int, frozenset[int]]
    gpus: tuple[FakeGpu, ...]
    allowed_cpus: frozenset[int]
    cgroup_cpus: frozenset[int]
    memory_nodes: frozenset[int]
    cgroup_version: int
    sockets: int
    package_of_node: dict[int, int] = field(default_factory=dict)

    def cpus(self, *nodes: int) -> frozenset[int]:
        """The CPUs of these nodes."""
        return frozenset().union(*(self.node_cpus[n] for n in nodes))

    def cpulist(self, *nodes: int) -> str:
        return format_cpulist(self.cpus(*nodes))

    def gpus_on(self, node: int) -> tuple[FakeGpu, ...]:
        return tuple(g for g in self.gpus if g.node == node)

    def l3_of(self, cpu: int) -> frozenset[int]:
        for group in self.l3_groups:
            if cpu in group:
                return group
        raise KeyError(cpu)


def _write(root: str, rel: str, text: str) -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text if text.endswith("\n") else text + "\n")


def write_topology(
    root: str | os.PathLike[str],
    *,
    vendor: str = "GenuineIntel",
    nodes: int = 2,
    sockets: int | None = None,
    cores_per_node: int = 8,
    smt: int = 2,
    l3_per_node: int = 1,
    gpus_per_node: Sequence[int] = (4, 4),
    gpu_vendor: str = "0x10de",
    allowed_cpus: str | frozenset[int] | None = None,
    cgroup_cpus: str | frozenset[int] | None = None,
    cgroup_version: int = 1,
    memory_nodes: Sequence[int] | None = None,
    gpu_numa_unknown: bool = False,
    bmc_vga: bool = True,
) -> Topology:
    """Write a machine under ``root`` and describe it.

    ``allowed_cpus`` is this process's mask (``Cpus_allowed_list``); ``cgroup_cpus`` the
    container's cpuset (defaults to ``allowed_cpus``: a container that narrowed every process).
    A mask narrower than the cgroup's is what a launcher's own binding looks like
    (``torchrun --numa-binding``, ``numactl``, ``taskset``). ``memory_nodes`` lists nodes with memory
    (default: all). ``gpu_numa_unknown`` writes ``numa_node`` -1, as some firmware does.
    ``bmc_vga`` adds the ASPEED VGA controller most servers carry (a display device that is no GPU).
    """
    from loongkit_core.hardware import parse_cpulist

    root = os.fspath(root)
    if len(gpus_per_node) != nodes:
        raise ValueError(f"gpus_per_node has {len(gpus_per_node)} entries for {nodes} nodes")
    if cores_per_node % l3_per_node:
        raise ValueError(f"{cores_per_node} cores per node do not split into {l3_per_node} L3 caches")
    if sockets is None:
        sockets = 1 if nodes == 1 else (2 if nodes % 2 == 0 else nodes)
    if nodes % sockets:
        raise ValueError(f"{nodes} nodes do not split over {sockets} sockets")
    nodes_per_socket = nodes // sockets
    total_cores = nodes * cores_per_node

    # -- CPUs --------------------------------------------------------------------------------------
    def cpu_id(node: int, core: int, thread: int) -> int:
        return thread * total_cores + node * cores_per_node + core

    node_cpus: dict[int, frozenset[int]] = {}
    siblings: dict[int, frozenset[int]] = {}
    l3_groups: list[frozenset[int]] = []
    package_of_node = {n: n // nodes_per_socket for n in range(nodes)}
    cpuinfo: list[str] = []
    cores_per_l3 = cores_per_node // l3_per_node
    for node in range(nodes):
        node_cpus[node] = frozenset(cpu_id(node, c, t) for c in range(cores_per_node) for t in range(smt))
        for chunk in range(l3_per_node):
            l3_groups.append(frozenset(
                cpu_id(node, c, t) for c in range(chunk * cores_per_l3, (chunk + 1) * cores_per_l3)
                for t in range(smt)
            ))
        for core in range(cores_per_node):
            sib = frozenset(cpu_id(node, core, t) for t in range(smt))
            for cpu in sib:
                siblings[cpu] = sib
    online = frozenset(siblings)
    l3_groups.sort(key=min)
    base = "sys/devices/system/cpu"
    for cpu in sorted(online):
        node = next(n for n, cpus in node_cpus.items() if cpu in cpus)
        core_in_node = (cpu % total_cores) - node * cores_per_node
        package = package_of_node[node]
        core_id = (node % nodes_per_socket) * cores_per_node + core_in_node  # unique within the package
        topo = f"{base}/cpu{cpu}/topology"
        _write(root, f"{topo}/core_id", str(core_id))
        _write(root, f"{topo}/physical_package_id", str(package))
        _write(root, f"{topo}/thread_siblings_list", format_cpulist(siblings[cpu]))
        _write(root, f"{topo}/core_cpus_list", format_cpulist(siblings[cpu]))
        cache = f"{base}/cpu{cpu}/cache"
        for index, level, shared in ((0, 1, siblings[cpu]), (2, 2, siblings[cpu])):
            _write(root, f"{cache}/index{index}/level", str(level))
            _write(root, f"{cache}/index{index}/shared_cpu_list", format_cpulist(shared))
        l3 = next(g for g in l3_groups if cpu in g)
        _write(root, f"{cache}/index3/level", "3")
        _write(root, f"{cache}/index3/shared_cpu_list", format_cpulist(l3))
        _write(root, f"{cache}/index3/id", str(l3_groups.index(l3)))
        cpuinfo.append(
            f"processor\t: {cpu}\nvendor_id\t: {vendor}\nmodel name\t: fake {vendor} CPU\n"
            f"physical id\t: {package}\ncore id\t\t: {core_id}\n"
        )
    _write(root, f"{base}/online", format_cpulist(online))
    _write(root, f"{base}/possible", format_cpulist(online))
    _write(root, "proc/cpuinfo", "\n".join(cpuinfo))

    # -- NUMA nodes --------------------------------------------------------------------------------
    mem_nodes = frozenset(range(nodes) if memory_nodes is None else memory_nodes)
    nbase = "sys/devices/system/node"
    for node in range(nodes):
        _write(root, f"{nbase}/node{node}/cpulist", format_cpulist(node_cpus[node]))
        total_kb = 64 * 1024 * 1024 if node in mem_nodes else 0
        _write(root, f"{nbase}/node{node}/meminfo", f"Node {node} MemTotal:       {total_kb} kB")
        dist = [
            10 if other == node else 12 if package_of_node[other] == package_of_node[node] else 32
            for other in range(nodes)
        ]
        _write(root, f"{nbase}/node{node}/distance", " ".join(map(str, dist)))
    _write(root, f"{nbase}/online", format_cpulist(range(nodes)))
    _write(root, f"{nbase}/possible", format_cpulist(range(nodes)))
    _write(root, f"{nbase}/has_cpu", format_cpulist(range(nodes)))
    _write(root, f"{nbase}/has_memory", format_cpulist(mem_nodes))

    # -- PCI devices -------------------------------------------------------------------------------
    pci = "sys/bus/pci/devices"

    def device(address: str, pci_class: str, vendor_id: str, node: int | None, local: frozenset[int]) -> None:
        _write(root, f"{pci}/{address}/class", pci_class)
        _write(root, f"{pci}/{address}/vendor", vendor_id)
        _write(root, f"{pci}/{address}/device", GPU_DEVICE_ID)
        _write(root, f"{pci}/{address}/numa_node", str(-1 if node is None else node))
        _write(root, f"{pci}/{address}/local_cpulist", format_cpulist(local))

    device("0000:00:00.0", "0x060000", "0x8086", 0, node_cpus[0])  # host bridge
    if bmc_vga:
        device("0000:02:00.0", "0x030000", "0x1a03", 0, node_cpus[0])  # ASPEED BMC graphics
    gpus: list[FakeGpu] = []
    for node, count in enumerate(gpus_per_node):
        for _ in range(count):
            k = len(gpus)
            address = f"0000:{0x18 + 0x10 * k:02x}:00.0"
            device(address, "0x030200", gpu_vendor, None if gpu_numa_unknown else node, node_cpus[node])
            gpus.append(FakeGpu(index=k, pci=address, node=node))
    if gpus:  # an NVSwitch-like bridge of the GPU vendor: same vendor, not a display class
        device("0000:f0:00.0", "0x068000", gpu_vendor, 0, node_cpus[0])

    # -- this process and its cgroup ---------------------------------------------------------------
    def as_set(value: str | frozenset[int] | None, default: frozenset[int]) -> frozenset[int]:
        if value is None:
            return default
        return parse_cpulist(value) if isinstance(value, str) else frozenset(value)

    allowed = as_set(allowed_cpus, online)
    cgroup = as_set(cgroup_cpus, allowed)
    mems = format_cpulist(mem_nodes)
    _write(root, "proc/self/status",
           f"Name:\tpython\nCpus_allowed_list:\t{format_cpulist(allowed)}\nMems_allowed_list:\t{mems}\n")
    if cgroup_version == 2:
        _write(root, "sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids")
        _write(root, "sys/fs/cgroup/cpuset.cpus.effective", format_cpulist(cgroup))
        _write(root, "sys/fs/cgroup/cpuset.mems.effective", mems)
        _write(root, "proc/self/cgroup", "0::/")
    else:
        _write(root, "sys/fs/cgroup/cpuset/cpuset.cpus", format_cpulist(cgroup))
        _write(root, "sys/fs/cgroup/cpuset/cpuset.effective_cpus", format_cpulist(cgroup))
        _write(root, "sys/fs/cgroup/cpuset/cpuset.mems", mems)
        _write(root, "sys/fs/cgroup/unified/cgroup.controllers", "")  # hybrid, as on many hosts
        _write(root, "proc/self/cgroup", "12:cpuset:/\n11:memory:/\n0::/")

    return Topology(
        root=root, vendor_id=vendor, online_cpus=online, node_cpus=node_cpus, l3_groups=tuple(l3_groups),
        siblings=siblings, gpus=tuple(gpus), allowed_cpus=allowed, cgroup_cpus=cgroup, memory_nodes=mem_nodes,
        cgroup_version=cgroup_version, sockets=sockets, package_of_node=package_of_node,
    )


# -- presets ------------------------------------------------------------------------------------------
def intel_2s_8gpu(root: str | os.PathLike[str], **overrides: object) -> Topology:
    """2 Intel sockets (one node each), 8 cores x 2 threads per node, one L3 per socket, 4+4 GPUs."""
    kw: dict[str, object] = dict(vendor="GenuineIntel", nodes=2, cores_per_node=8, smt=2, l3_per_node=1,
                                 gpus_per_node=(4, 4))
    kw.update(overrides)
    return write_topology(root, **kw)  # type: ignore[arg-type]


def amd_2s_8gpu(root: str | os.PathLike[str], **overrides: object) -> Topology:
    """2 AMD sockets (one node each), 16 cores x 2 threads and 4 L3 caches per node, 4+4 GPUs."""
    kw: dict[str, object] = dict(vendor="AuthenticAMD", nodes=2, cores_per_node=16, smt=2, l3_per_node=4,
                                 gpus_per_node=(4, 4))
    kw.update(overrides)
    return write_topology(root, **kw)  # type: ignore[arg-type]


def asymmetric_4node(root: str | os.PathLike[str], **overrides: object) -> Topology:
    """The documentation's asymmetric example: 2 sockets x 2 nodes, GPUs 0, 1, 2 on NUMA 0, 1, 2.

    NUMA 3 has CPUs and memory but no GPU; it shares socket 1 with NUMA 2 (distance 12, against
    32 to NUMA 0 and 1), so it is the GPU-less node that GPU 2's processes may use.
    """
    kw: dict[str, object] = dict(vendor="GenuineIntel", nodes=4, sockets=2, cores_per_node=4, smt=2,
                                 l3_per_node=1, gpus_per_node=(1, 1, 1, 0))
    kw.update(overrides)
    return write_topology(root, **kw)  # type: ignore[arg-type]


def narrowed_container(root: str | os.PathLike[str], **overrides: object) -> Topology:
    """:func:`intel_2s_8gpu` whose container cpuset is cores 4-11 (half of each node, with siblings)."""
    kw: dict[str, object] = dict(allowed_cpus="4-11,20-27")
    kw.update(overrides)
    return intel_2s_8gpu(root, **kw)


def two_cpu_two_node(root: str | os.PathLike[str], **overrides: object) -> Topology:
    """CPUs 0 and 1 as NUMA 0 and 1, one GPU each: lets a 2-CPU machine really bind 2 ranks."""
    kw: dict[str, object] = dict(vendor="GenuineIntel", nodes=2, cores_per_node=1, smt=1, l3_per_node=1,
                                 gpus_per_node=(1, 1))
    kw.update(overrides)
    return write_topology(root, **kw)  # type: ignore[arg-type]


PRESETS: dict[str, Callable[..., Topology]] = {
    "intel-2s-8gpu": intel_2s_8gpu,
    "amd-2s-8gpu": amd_2s_8gpu,
    "asymmetric-4node": asymmetric_4node,
    "narrowed-container": narrowed_container,
    "two-cpu-two-node": two_cpu_two_node,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] not in PRESETS:
        print(f"usage: python -m loongkit_core.testing.topology {{{','.join(PRESETS)}}} DIR", file=sys.stderr)
        return 2
    topo = PRESETS[args[0]](args[1])
    print(f"{args[0]} written under {topo.root}: {len(topo.node_cpus)} nodes, {len(topo.gpus)} GPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
