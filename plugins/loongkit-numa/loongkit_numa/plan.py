"""The NUMA plan: for each local rank, its GPU, node, training CPUs, data CPUs and memory node.

Pure: from a :class:`~loongkit_core.hardware.Hardware`, the options, the local world size and the
GPUs the ranks use (device order) to a :class:`NodePlan`. ``loongkit numa plan`` prints it, the
``numa_affinity`` feature applies one rank of it, and sub-cgroups can turn the same sets into
``cpuset.cpus``/``cpuset.mems`` (``training_nodes``/``data_nodes`` give the memory nodes).

The rules, in order:

1. Nothing is bound without a GPU, a known NUMA node for it, or CPUs of that node in the mask.
2. A process already narrowed by its launcher (``torchrun --numa-binding``, ``numactl``) is left
   as it is: its mask is strictly inside its cgroup's cpuset (or, cgroup unknown, inside one node).
3. Symmetric topologies (every node with CPUs has the same, non-zero number of GPUs): each rank
   goes to its GPU's node, training and data alike.
4. Asymmetric ones only with ALLOW_ASYMMETRIC=1, then the seed's table for the GPU-less nodes
   attached to the GPU's node: TRAIN_ON_GPULESS adds them to training; DATA_WORKER_ON_GPULESS adds
   them to data; with DATA_WORKER_GPULESS_ONLY data uses only them.
5. PARTITION_PER_LLC: ranks sharing the same training CPUs split their L3 caches evenly (whole
   caches, so whole physical cores); when the count does not divide, node binding stays, with why.
6. SEPARATE_BY_ROLES: data processes move off the L3 caches their training process uses.
7. Everything is intersected with the CPUs the process may use; binding only ever narrows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from loongkit_core.hardware import Gpu, Hardware, format_cpulist
from loongkit_numa.topology import NodeLayout, l3_units, layout, node_cpus, nodes_text, physical_cores

# rule keywords, combined with "+" (e.g. "node+llc+roles")
NODE = "node"
ASYMMETRIC = "asymmetric"
LLC = "llc"
ROLES = "roles"
UNBOUND = "unbound"
ALREADY_BOUND = "already-bound"


@dataclass(frozen=True)
class PlanOptions:
    """The planner's inputs from LOONGKIT_NUMA_AFFINITY_* (ALLOW_INDEX only picks GPUs, not CPUs)."""

    allow_asymmetric: bool = False
    train_on_gpuless: bool = False
    data_worker_on_gpuless: bool = False
    data_worker_gpuless_only: bool = False
    partition_per_llc: bool = False
    separate_by_roles: bool = False

    @classmethod
    def from_options(cls, options: object) -> PlanOptions:
        """From a NumaAffinityOptions (or anything with the same attributes)."""
        return cls(**{name: bool(getattr(options, name, False)) for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class RankPlan:
    local_rank: int
    gpu: str | None  # PCI address
    gpu_index: int | None  # device index among the GPUs the ranks use
    node: int | None  # the GPU's node
    training_nodes: tuple[int, ...] = ()
    data_nodes: tuple[int, ...] = ()
    training_cpus: frozenset[int] | None = None  # None: leave the process as it is
    data_cpus: frozenset[int] | None = None
    memory_node: int | None = None  # preferred memory node of the training process
    data_memory_node: int | None = None
    rule: str = UNBOUND
    why: str = ""

    @property
    def bound(self) -> bool:
        return self.training_cpus is not None

    def to_json(self) -> dict[str, object]:
        return {
            "local_rank": self.local_rank,
            "gpu": self.gpu,
            "gpu_index": self.gpu_index,
            "node": self.node,
            "training_nodes": list(self.training_nodes),
            "training_cpus": None if self.training_cpus is None else format_cpulist(self.training_cpus),
            "data_nodes": list(self.data_nodes),
            "data_cpus": None if self.data_cpus is None else format_cpulist(self.data_cpus),
            "memory_node": self.memory_node,
            "data_memory_node": self.data_memory_node,
            "rule": self.rule,
            "why": self.why,
        }


@dataclass(frozen=True)
class NodePlan:
    ranks: tuple[RankPlan, ...]
    topology: str  # NodeLayout.describe()
    symmetric: bool
    allowed_cpus: frozenset[int]
    options: PlanOptions
    gpu_source: str = ""  # how ranks were matched to GPUs
    notes: tuple[str, ...] = field(default_factory=tuple)

    def rank(self, local_rank: int) -> RankPlan:
        for r in self.ranks:
            if r.local_rank == local_rank:
                return r
        return RankPlan(local_rank=local_rank, gpu=None, gpu_index=None, node=None,
                        why=f"local rank {local_rank} is outside the plan's {len(self.ranks)} ranks")

    def to_json(self) -> dict[str, object]:
        return {
            "topology": self.topology,
            "symmetric": self.symmetric,
            "allowed_cpus": format_cpulist(self.allowed_cpus),
            "options": {k: getattr(self.options, k) for k in PlanOptions.__dataclass_fields__},
            "gpu_source": self.gpu_source,
            "ranks": [r.to_json() for r in self.ranks],
            "notes": list(self.notes),
        }


@dataclass
class _Draft:
    """A rank while it is being planned (mutable; frozen into a RankPlan at the end)."""

    local_rank: int
    gpu: Gpu | None
    node: int | None
    training_nodes: tuple[int, ...] = ()
    data_nodes: tuple[int, ...] = ()
    training: frozenset[int] | None = None
    data: frozenset[int] | None = None
    rules: list[str] = field(default_factory=list)
    why: list[str] = field(default_factory=list)


def prebound(hw: Hardware, allowed: frozenset[int], lay: NodeLayout) -> str | None:
    """Why this process counts as already bound by its launcher, or None.

    A container's cpuset narrows every process alike, so the reference is the cgroup's CPUs (the
    online ones when the cgroup cannot be read). A mask strictly inside it that also spans fewer
    NUMA nodes was chosen for this process (torchrun --numa-binding, numactl, taskset) and is
    respected; a mask that merely lacks a few CPUs (isolcpus) still spans every node and is not.
    """
    if len(lay.cpu_nodes) < 2 or not allowed:
        return None
    reference = hw.cgroup_cpus if hw.cgroup_cpus is not None else hw.online_cpus

    def span(cpus: frozenset[int]) -> list[int]:
        return [n for n in lay.cpu_nodes if cpus & node_cpus(hw, [n])]

    mine = span(allowed)
    if allowed < reference and len(mine) < len(span(reference)):
        whose = "its cgroup's" if hw.cgroup_cpus is not None else "the online"
        return (f"this process was already narrowed to {nodes_text(mine)} (CPUs {format_cpulist(allowed)}, "
                f"within {whose} CPUs {format_cpulist(reference)}) by torchrun --numa-binding, numactl or "
                "taskset; left as is")
    return None


def build_plan(
    hw: Hardware,
    options: PlanOptions | object,
    local_world_size: int,
    gpus: Sequence[Gpu | None] | None = None,
    *,
    allowed: frozenset[int] | None = None,
    gpu_source: str = "",
) -> NodePlan:
    """Plan every local rank. ``gpus[i]`` is the GPU of local rank i (default: PCI order; None: unknown).

    ``allowed`` is the mask to stay within (default: the CPUs the hardware says this process may use).
    """
    opts = options if isinstance(options, PlanOptions) else PlanOptions.from_options(options)
    lay = layout(hw)
    gpus = list(hw.accelerators if gpus is None else gpus)
    if allowed is None:
        allowed = hw.allowed_cpus or hw.online_cpus
    notes = list(lay.notes)
    drafts: list[_Draft] = []
    for r in range(max(local_world_size, 1)):
        gpu = gpus[r] if r < len(gpus) else None
        drafts.append(_Draft(local_rank=r, gpu=gpu, node=lay.gpu_node.get(gpu.pci) if gpu is not None else None))

    # Rules 1-2 and the asymmetric gate decide for every rank at once.
    blanket: tuple[str, str] | None = None
    if not hw.accelerators:
        blanket = (UNBOUND, "no GPU found under " + hw.root.rstrip("/") + "/sys/bus/pci/devices")
    elif not lay.cpu_nodes:
        blanket = (UNBOUND, "no NUMA node with CPUs under " + hw.root.rstrip("/") + "/sys/devices/system/node")
    elif (why := prebound(hw, allowed, lay)) is not None:
        blanket = (ALREADY_BOUND, why)
    elif not lay.symmetric and not opts.allow_asymmetric:
        blanket = (UNBOUND, f"{lay.describe()}: set LOONGKIT_NUMA_AFFINITY_ALLOW_ASYMMETRIC=1 to bind")
    if blanket is not None:
        return _freeze(hw, drafts, lay, allowed, opts, gpu_source, notes, blanket)

    for d in drafts:
        _node_binding(hw, d, lay, allowed, opts, sum(g is not None for g in gpus))
    if opts.partition_per_llc:
        _partition_per_llc(hw, drafts)
    if opts.separate_by_roles:
        for d in drafts:
            if d.training is not None:
                _separate_roles(hw, d)
    return _freeze(hw, drafts, lay, allowed, opts, gpu_source, notes, None)


def unbound_plan(hw: Hardware, options: PlanOptions | object, local_world_size: int, why: str,
                 gpu_source: str = "") -> NodePlan:
    """A plan that binds no rank, for a reason found before planning (e.g. torch too old)."""
    opts = options if isinstance(options, PlanOptions) else PlanOptions.from_options(options)
    lay = layout(hw)
    ranks = tuple(RankPlan(local_rank=r, gpu=None, gpu_index=None, node=None, why=why)
                  for r in range(max(local_world_size, 1)))
    return NodePlan(ranks=ranks, topology=lay.describe() if lay.cpu_nodes else "no NUMA nodes",
                    symmetric=lay.symmetric, allowed_cpus=hw.allowed_cpus, options=opts, gpu_source=gpu_source,
                    notes=lay.notes)


def _node_binding(hw: Hardware, d: _Draft, lay: NodeLayout, allowed: frozenset[int], opts: PlanOptions,
                  n_gpus: int) -> None:
    """Rules 3-4 and 7 for one rank."""
    if d.gpu is None:
        d.rules.append(UNBOUND)
        d.why.append(f"no GPU for local rank {d.local_rank} ({n_gpus} GPUs in use)")
        return
    if d.node is None:
        d.rules.append(UNBOUND)
        d.why.append(f"the NUMA node of GPU {d.gpu.pci} is unknown")
        return
    node = d.node
    train_nodes = {node}
    data_nodes = {node}
    if lay.symmetric:
        d.rules.append(NODE)
        d.why.append(f"symmetric: {nodes_text([node])} of GPU {d.gpu.pci}")
    else:
        d.rules.append(ASYMMETRIC)
        spare = lay.gpuless_neighbours.get(node, frozenset())
        text = f"asymmetric, GPU on {nodes_text([node])}, GPU-less neighbours: "
        d.why.append(text + (nodes_text(spare) if spare else "none"))
        if opts.train_on_gpuless:
            train_nodes |= spare
        if opts.data_worker_on_gpuless:
            if opts.data_worker_gpuless_only and spare:
                data_nodes = set(spare)
            else:
                data_nodes |= spare
                if opts.data_worker_gpuless_only:
                    d.why.append("DATA_WORKER_GPULESS_ONLY: no GPU-less node next to it, data stays on the GPU's node")
    d.training_nodes = tuple(sorted(train_nodes))
    d.data_nodes = tuple(sorted(data_nodes))
    if not lay.symmetric:
        d.why.append(f"training {nodes_text(train_nodes)}, data {nodes_text(data_nodes)}")
    training = node_cpus(hw, train_nodes) & allowed
    if not training:
        d.rules[-1] = UNBOUND
        d.why.append(f"none of the CPUs of {nodes_text(train_nodes)} is allowed "
                     f"(allowed: {format_cpulist(allowed)})")
        return
    data = node_cpus(hw, data_nodes) & allowed
    if not data:
        d.why.append(f"none of the CPUs of {nodes_text(data_nodes)} is allowed; data uses the training CPUs")
        data = training
        d.data_nodes = d.training_nodes
    narrowed = node_cpus(hw, train_nodes) - allowed
    if narrowed:
        d.why.append(f"CPUs {format_cpulist(narrowed)} of {nodes_text(train_nodes)} are outside the allowed mask")
    d.training, d.data = training, data


def _partition_per_llc(hw: Hardware, drafts: list[_Draft]) -> None:
    """Rule 5: ranks with identical training CPUs share out that set's L3 caches evenly."""
    groups: dict[frozenset[int], list[_Draft]] = {}
    for d in drafts:
        if d.training is not None:
            groups.setdefault(d.training, []).append(d)
    for cpus, members in groups.items():
        where = nodes_text(members[0].training_nodes)
        units, problem = l3_units(hw, cpus)
        k = len(members)
        if units is None or len(units) % k:
            reason = problem or (f"{_count(len(units or ()), 'L3 cache')} on {where} cannot be split evenly "
                                 f"among {k} ranks")
            for d in members:
                d.why.append(f"PARTITION_PER_LLC not applied: {reason}; bound to the node")
            continue
        per = len(units) // k
        for j, d in enumerate(members):
            share = frozenset().union(*units[j * per:(j + 1) * per])
            others = cpus - share
            d.rules.append(LLC)
            which = str(j * per) if per == 1 else f"{j * per}-{(j + 1) * per - 1}"
            d.why.append(f"PARTITION_PER_LLC: L3 #{which} of {len(units)} on {where}, "
                         f"{physical_cores(hw, share)} physical cores")
            d.training = share
            assert d.data is not None
            # Data workers stay off the caches of the node's other ranks; GPU-less extras remain.
            d.data = (d.data - others) or share


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _separate_roles(hw: Hardware, d: _Draft) -> None:
    """Rule 6: training and data on different L3 caches."""
    assert d.training is not None and d.data is not None
    train_units, problem = l3_units(hw, d.training)
    if train_units is None:
        d.why.append(f"SEPARATE_BY_ROLES not applied: {problem}")
        return
    touched = {info.l3 for c in d.training if (info := hw.cpu(c)) is not None}
    elsewhere = frozenset(c for c in d.data if (info := hw.cpu(c)) is not None and info.l3 not in touched)
    if elsewhere:
        if elsewhere != d.data:
            d.data = elsewhere
        d.rules.append(ROLES)
        d.why.append(f"SEPARATE_BY_ROLES: data on other L3 caches ({format_cpulist(elsewhere)})")
        return
    if len(train_units) < 2:
        d.why.append(f"SEPARATE_BY_ROLES not applied: a single L3 cache ({format_cpulist(d.training)}) "
                     "cannot be split between training and data")
        return
    keep = len(train_units) - len(train_units) // 2  # training keeps the larger half
    d.training = frozenset().union(*train_units[:keep])
    d.data = frozenset().union(*train_units[keep:])
    d.rules.append(ROLES)
    d.why.append(f"SEPARATE_BY_ROLES: training on {keep} L3 caches, data on {len(train_units) - keep}")


def _memory_node(hw: Hardware, preferred: int | None, nodes: Sequence[int]) -> int | None:
    """The first node with memory the process may use: the GPU's node first, then the others."""
    order = ([preferred] if preferred is not None and preferred in nodes else []) + [n for n in nodes
                                                                                      if n != preferred]
    for n in order:
        info = hw.node(n)
        if info is not None and info.has_memory and (not hw.allowed_mems or n in hw.allowed_mems):
            return n
    return None


def _freeze(hw: Hardware, drafts: list[_Draft], lay: NodeLayout, allowed: frozenset[int], opts: PlanOptions,
            gpu_source: str, notes: list[str], blanket: tuple[str, str] | None) -> NodePlan:
    ranks: list[RankPlan] = []
    for i, d in enumerate(drafts):
        gpu_index = i if d.gpu is not None else None
        if blanket is not None:
            ranks.append(RankPlan(local_rank=d.local_rank, gpu=d.gpu.pci if d.gpu else None, gpu_index=gpu_index,
                                  node=d.node, rule=blanket[0], why=blanket[1]))
            continue
        bound = d.training is not None
        memory = _memory_node(hw, d.node, d.training_nodes) if bound else None
        data_memory = _memory_node(hw, d.node, d.data_nodes) if bound else None
        if bound and memory is None:
            d.why.append(f"no allowed memory node in {nodes_text(d.training_nodes)}; memory policy left as is")
        ranks.append(RankPlan(
            local_rank=d.local_rank,
            gpu=d.gpu.pci if d.gpu else None,
            gpu_index=gpu_index,
            node=d.node,
            training_nodes=d.training_nodes if bound else (),
            data_nodes=d.data_nodes if bound else (),
            training_cpus=d.training,
            data_cpus=d.data if bound else None,
            memory_node=memory,
            data_memory_node=data_memory,
            rule="+".join(d.rules) if bound else UNBOUND,
            why="; ".join(d.why),
        ))
    return NodePlan(ranks=tuple(ranks), topology=lay.describe() if lay.cpu_nodes else "no NUMA nodes",
                    symmetric=lay.symmetric, allowed_cpus=allowed, options=opts, gpu_source=gpu_source,
                    notes=tuple(notes))
