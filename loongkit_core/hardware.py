"""Hardware topology from sysfs and procfs, read under an injectable root (tests, dry runs).

Only small text files are read, and nothing here imports torch. A missing, unreadable or garbled
file never raises: the field it feeds stays empty or "unknown" and a line is added to
:attr:`Hardware.notes`, so that a feature can say *why* it has nothing to work with.

The root defaults to the core setting ``LOONGKIT_SYSFS_ROOT`` ("/"). When the root is the real
one, the CPUs this process may use come from ``os.sched_getaffinity(0)`` (a thread's truth); under
a fake root they come from ``<root>/proc/self/status`` like everything else.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

# PCI vendor ids of accelerators we know; anything else with a display class is "other" (e.g. the
# ASPEED BMC VGA chip of most servers, which must never be mistaken for a training GPU).
GPU_VENDORS = {"0x10de": "nvidia", "0x1ded": "ppu", "0x1002": "amd"}
CPU_VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd", "HygonGenuine": "hygon"}
# PCI classes: 0x0300xx VGA-compatible controller, 0x0302xx 3D controller (datacenter GPUs).
_GPU_CLASSES = ("0x0300", "0x0302")
_NODE_DIR = re.compile(r"^node(\d+)$")
_CPU_DIR = re.compile(r"^cpu(\d+)$")
_INDEX_DIR = re.compile(r"^index(\d+)$")
_MAX_CPU = 1 << 16  # a cpulist naming more CPUs than this is garbage, not a machine


# -- cpulists ---------------------------------------------------------------------------------------
def parse_cpulist(text: str) -> frozenset[int]:
    """Parse a kernel cpulist ("0-3,8,10-14:2"); raise ValueError on garbage. Empty text is empty."""
    cpus: set[int] = set()
    text = text.strip()
    if not text:
        return frozenset()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        stride = 1
        if ":" in part:  # "a-b:s" (every s-th CPU), accepted by the kernel's bitmap_parselist
            part, _, step = part.partition(":")
            stride = int(step)
            if stride <= 0:
                raise ValueError(f"bad stride in cpulist {text!r}")
        if "-" in part:
            lo_text, _, hi_text = part.partition("-")
            lo, hi = int(lo_text), int(hi_text)
        else:
            lo = hi = int(part)
        if lo < 0 or hi < lo or hi >= _MAX_CPU:
            raise ValueError(f"bad range {part!r} in cpulist {text!r}")
        cpus.update(range(lo, hi + 1, stride))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int], min_run: int = 2) -> str:
    """The kernel's compact form of a CPU set: ``{0,1,2,3,8}`` -> ``"0-3,8"``; empty -> ``""``. Runs shorter
    than ``min_run`` are listed one by one (the Summary's ranks use 3: ``0,1`` reads better than ``0-1``)."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i + 1 >= max(min_run, 2):
            parts.append(f"{ordered[i]}-{ordered[j]}")
        else:
            parts.extend(str(n) for n in ordered[i:j + 1])
        i = j + 1
    return ",".join(parts)


# -- the model --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cpu:
    """One online logical CPU."""

    id: int
    core_id: int | None = None
    package_id: int | None = None
    siblings: frozenset[int] = frozenset()  # SMT threads of the same physical core, itself included
    l3: int | None = None  # index into Hardware.l3_caches


@dataclass(frozen=True)
class L3Cache:
    """A last-level cache and the CPUs sharing it (AMD: one per CCX/CCD; Intel: one per socket)."""

    index: int  # position in Hardware.l3_caches (stable: ordered by lowest CPU)
    cpus: frozenset[int]
    cache_id: int | None = None  # the kernel's id, when it gives one


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: frozenset[int]
    has_memory: bool = True
    distances: tuple[tuple[int, int], ...] = ()  # (other node, SLIT distance); empty when unknown

    def distance_to(self, other: int) -> int | None:
        for node, dist in self.distances:
            if node == other:
                return dist
        return None


@dataclass(frozen=True)
class Gpu:
    """A display/3D-class PCI device."""

    pci: str  # "0000:3b:00.0"
    vendor: str  # nvidia, ppu, amd or other
    vendor_id: str  # "0x10de"
    device_id: str  # "0x2330" ("" if unreadable)
    pci_class: str  # "0x030200"
    numa_node: int | None  # None when the firmware does not say (-1)
    local_cpus: frozenset[int] = frozenset()

    @property
    def is_accelerator(self) -> bool:
        return self.vendor != "other"


@dataclass(frozen=True)
class Hardware:
    """What ``detect`` found. Everything is plain data; ``notes`` explains what could not be read."""

    root: str = "/"
    cpu_vendor: str = "unknown"  # intel, amd, hygon or unknown
    cpu_vendor_id: str = ""  # the raw vendor_id
    online_cpus: frozenset[int] = frozenset()
    allowed_cpus: frozenset[int] = frozenset()  # CPUs this process may run on
    allowed_mems: frozenset[int] = frozenset()  # memory nodes this process may use (empty: unknown)
    cgroup_cpus: frozenset[int] | None = None  # the cpuset of this process's cgroup, when readable
    nodes: tuple[NumaNode, ...] = ()
    cpus: tuple[Cpu, ...] = ()
    l3_caches: tuple[L3Cache, ...] = ()
    gpus: tuple[Gpu, ...] = ()  # every display-class device, ordered by PCI address
    cgroup_version: int | None = None  # 2, 1 (v1 or hybrid), None when /sys/fs/cgroup is absent
    notes: tuple[str, ...] = ()

    @property
    def accelerators(self) -> tuple[Gpu, ...]:
        """GPUs of a known accelerator vendor, in PCI order (the CUDA order for identical GPUs)."""
        return tuple(g for g in self.gpus if g.is_accelerator)

    @property
    def gpu_vendors(self) -> frozenset[str]:
        return frozenset(g.vendor for g in self.accelerators)

    @property
    def smt(self) -> bool:
        return any(len(c.siblings) > 1 for c in self.cpus)

    def node(self, node_id: int) -> NumaNode | None:
        for n in self.nodes:
            if n.id == node_id:
                return n
        return None

    def node_of_cpu(self, cpu: int) -> int | None:
        for n in self.nodes:
            if cpu in n.cpus:
                return n.id
        return None

    def cpu(self, cpu: int) -> Cpu | None:
        return self._cpu_index.get(cpu)

    @functools.cached_property
    def _cpu_index(self) -> dict[int, Cpu]:  # planners look CPUs up often; build the map once
        return {c.id: c for c in self.cpus}

    def to_json(self) -> dict[str, object]:
        return {
            "root": self.root,
            "cpu_vendor": self.cpu_vendor,
            "online_cpus": format_cpulist(self.online_cpus),
            "allowed_cpus": format_cpulist(self.allowed_cpus),
            "allowed_mems": format_cpulist(self.allowed_mems),
            "cgroup_cpus": None if self.cgroup_cpus is None else format_cpulist(self.cgroup_cpus),
            "cgroup_version": self.cgroup_version,
            "smt": self.smt,
            "nodes": [
                {"id": n.id, "cpus": format_cpulist(n.cpus), "has_memory": n.has_memory} for n in self.nodes
            ],
            "l3_caches": [format_cpulist(c.cpus) for c in self.l3_caches],
            "gpus": [
                {"pci": g.pci, "vendor": g.vendor, "numa_node": g.numa_node,
                 "local_cpus": format_cpulist(g.local_cpus)}
                for g in self.gpus
            ],
            "notes": list(self.notes),
        }


# -- reading ----------------------------------------------------------------------------------------
@dataclass
class _Reader:
    root: str
    notes: list[str] = field(default_factory=list)

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel.lstrip("/"))

    def text(self, rel: str, *, note: bool = True) -> str | None:
        try:
            with open(self.path(rel), encoding="utf-8", errors="replace") as f:
                return f.read(1 << 20)  # sysfs files are small; never slurp a surprise
        except OSError as exc:
            if note:
                self.notes.append(f"cannot read {rel}: {exc.strerror or exc}")
            return None

    def cpulist(self, rel: str, *, note: bool = True) -> frozenset[int] | None:
        raw = self.text(rel, note=note)
        if raw is None:
            return None
        try:
            return parse_cpulist(raw)
        except ValueError:
            self.notes.append(f"garbled cpulist in {rel}: {raw.strip()[:40]!r}")
            return None

    def integer(self, rel: str, *, note: bool = True) -> int | None:
        raw = self.text(rel, note=note)
        if raw is None:
            return None
        try:
            return int(raw.strip(), 0)
        except ValueError:
            self.notes.append(f"garbled number in {rel}: {raw.strip()[:40]!r}")
            return None

    def listdir(self, rel: str, *, note: bool = True) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except OSError as exc:
            if note:
                self.notes.append(f"cannot list {rel}: {exc.strerror or exc}")
            return []


def _is_real_root(root: str) -> bool:
    return os.path.realpath(root) == "/"


def _default_root() -> str:
    try:
        from loongkit_core.settings import CoreSettings, load_settings

        settings, _ = load_settings(CoreSettings)
        return settings.sysfs_root or "/"
    except Exception:  # settings must never stop detection; the real root is the safe answer
        return os.environ.get("LOONGKIT_SYSFS_ROOT") or "/"


def _cpu_vendor(r: _Reader) -> tuple[str, str]:
    text = r.text("proc/cpuinfo")
    if text is None:
        return "unknown", ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "vendor_id":
            raw = value.strip()
            return CPU_VENDORS.get(raw, "unknown"), raw
    r.notes.append("no vendor_id in proc/cpuinfo")
    return "unknown", ""


def _status_lists(r: _Reader) -> tuple[frozenset[int] | None, frozenset[int] | None]:
    """Cpus_allowed_list and Mems_allowed_list of <root>/proc/self/status."""
    text = r.text("proc/self/status")
    cpus = mems = None
    if text is None:
        return None, None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep or key not in ("Cpus_allowed_list", "Mems_allowed_list"):
            continue
        try:
            parsed = parse_cpulist(value)
        except ValueError:
            r.notes.append(f"garbled {key} in proc/self/status: {value.strip()[:40]!r}")
            continue
        if key == "Cpus_allowed_list":
            cpus = parsed
        else:
            mems = parsed
    return cpus, mems


def _online_cpus(r: _Reader) -> frozenset[int]:
    online = r.cpulist("sys/devices/system/cpu/online")
    if online:
        return online
    # No "online" file (very old kernels, partial fake trees): every cpuN directory counts.
    found = frozenset(
        int(m.group(1)) for name in r.listdir("sys/devices/system/cpu", note=False)
        if (m := _CPU_DIR.match(name))
    )
    if found:
        r.notes.append("online CPUs taken from the cpuN directories")
    return found


def _nodes(r: _Reader) -> tuple[NumaNode, ...]:
    base = "sys/devices/system/node"
    ids = sorted(int(m.group(1)) for name in r.listdir(base) if (m := _NODE_DIR.match(name)))
    if not ids:
        return ()
    with_memory = r.cpulist(f"{base}/has_memory", note=False)
    nodes: list[NumaNode] = []
    for nid in ids:
        cpus = r.cpulist(f"{base}/node{nid}/cpulist")
        # has_memory lists the nodes with memory in one read; per-node meminfo is the fallback.
        has_memory = (nid in with_memory) if with_memory is not None else _meminfo_total(
            r, f"{base}/node{nid}/meminfo")
        distances: tuple[tuple[int, int], ...] = ()
        raw = r.text(f"{base}/node{nid}/distance", note=False)
        if raw is not None:
            try:
                values = [int(v) for v in raw.split()]
            except ValueError:
                values = []
            # The kernel lists distances to the online nodes in id order.
            if len(values) == len(ids):
                distances = tuple(zip(ids, values, strict=True))
            else:
                r.notes.append(f"garbled {base}/node{nid}/distance: {raw.strip()[:40]!r}")
        nodes.append(NumaNode(id=nid, cpus=cpus or frozenset(), has_memory=has_memory, distances=distances))
    return tuple(nodes)


def _meminfo_total(r: _Reader, rel: str) -> bool:
    text = r.text(rel, note=False)
    if text is None:
        r.notes.append(f"cannot tell whether {rel.rsplit('/', 2)[-2]} has memory; assuming it does")
        return True
    for line in text.splitlines():
        if "MemTotal:" in line:
            try:
                return int(line.split("MemTotal:")[1].split()[0]) > 0
            except (IndexError, ValueError):
                break
    r.notes.append(f"garbled {rel}; assuming the node has memory")
    return True


def _cpus_and_l3(r: _Reader, online: frozenset[int]) -> tuple[tuple[Cpu, ...], tuple[L3Cache, ...]]:
    """Per-CPU core/package/siblings and the L3 groups, reading each sibling group and L3 once."""
    base = "sys/devices/system/cpu"
    core: dict[int, tuple[int | None, int | None, frozenset[int]]] = {}
    l3_of: dict[int, int] = {}
    groups: list[tuple[frozenset[int], int | None]] = []
    no_topology: list[int] = []
    no_l3: list[int] = []
    for cpu in sorted(online):
        if cpu not in core:
            topo = f"{base}/cpu{cpu}/topology"
            core_id = r.integer(f"{topo}/core_id", note=False)
            package = r.integer(f"{topo}/physical_package_id", note=False)
            siblings = r.cpulist(f"{topo}/thread_siblings_list", note=False)
            if siblings is None:
                siblings = r.cpulist(f"{topo}/core_cpus_list", note=False)
            if core_id is None and package is None and siblings is None:
                no_topology.append(cpu)
            siblings = (siblings or frozenset()) & online | {cpu}
            for sib in siblings:  # siblings share core and package: one read per physical core
                core.setdefault(sib, (core_id, package, frozenset(siblings)))
        if cpu not in l3_of:
            shared, cache_id = _l3_of_cpu(r, f"{base}/cpu{cpu}/cache")
            if shared is None:
                no_l3.append(cpu)
                continue
            shared = (shared & online) | {cpu}
            index = len(groups)
            groups.append((shared, cache_id))
            for member in shared:
                l3_of.setdefault(member, index)
    if no_topology:
        r.notes.append(f"no core/package topology for CPUs {format_cpulist(no_topology)}")
    if no_l3:
        r.notes.append(f"no L3 cache information for CPUs {format_cpulist(no_l3)}")
    # Order L3 groups by their lowest CPU so indexes do not depend on which CPU was read first.
    order = sorted(range(len(groups)), key=lambda i: min(groups[i][0]))
    renumber = {old: new for new, old in enumerate(order)}
    l3s = tuple(
        L3Cache(index=renumber[old], cpus=frozenset(c for c, g in l3_of.items() if g == old),
                cache_id=groups[old][1])
        for old in order
    )
    cpus = tuple(
        Cpu(id=cpu, core_id=core[cpu][0], package_id=core[cpu][1], siblings=core[cpu][2],
            l3=renumber[l3_of[cpu]] if cpu in l3_of else None)
        for cpu in sorted(online)
    )
    return cpus, l3s


def _l3_of_cpu(r: _Reader, cache_dir: str) -> tuple[frozenset[int] | None, int | None]:
    # index3 is the L3 on x86; check it first, then the others (some ARM parts number differently).
    names = ["index3"] + [n for n in r.listdir(cache_dir, note=False) if _INDEX_DIR.match(n) and n != "index3"]
    for name in names:
        if r.integer(f"{cache_dir}/{name}/level", note=False) == 3:
            shared = r.cpulist(f"{cache_dir}/{name}/shared_cpu_list", note=False)
            if shared is not None:
                return shared, r.integer(f"{cache_dir}/{name}/id", note=False)
    return None, None


def _gpus(r: _Reader) -> tuple[Gpu, ...]:
    base = "sys/bus/pci/devices"
    found: list[Gpu] = []
    for address in r.listdir(base):
        dev = f"{base}/{address}"
        pci_class = (r.text(f"{dev}/class", note=False) or "").strip().lower()
        if not pci_class.startswith(_GPU_CLASSES):
            continue
        vendor_id = (r.text(f"{dev}/vendor") or "").strip().lower()
        device_id = (r.text(f"{dev}/device", note=False) or "").strip().lower()
        node = r.integer(f"{dev}/numa_node", note=False)
        local = r.cpulist(f"{dev}/local_cpulist", note=False)
        found.append(Gpu(
            pci=address,
            vendor=GPU_VENDORS.get(vendor_id, "other"),
            vendor_id=vendor_id,
            device_id=device_id,
            pci_class=pci_class,
            numa_node=node if node is not None and node >= 0 else None,
            local_cpus=local or frozenset(),
        ))
    return tuple(found)


def _cgroup(r: _Reader) -> tuple[int | None, frozenset[int] | None]:
    """cgroup version, and the effective cpuset of this process's cgroup when it can be read (located
    and read by the core's cgroup reader, :mod:`loongkit_core.cgroupfs`)."""
    from loongkit_core import cgroupfs

    version, files = cgroupfs.cpuset_files(r.root)
    if version is None:
        r.notes.append("no sys/fs/cgroup")
        return None, None
    for path in files:
        raw = cgroupfs.read_text(path, 1 << 20)
        if raw is None:
            continue
        try:
            cpus = parse_cpulist(raw)
        except ValueError:
            r.notes.append(f"garbled cpulist in {os.path.relpath(path, r.root)}: {raw.strip()[:40]!r}")
            continue
        if cpus:
            return version, cpus
    return version, None


def detect(root: str | None = None) -> Hardware:
    """Read the topology under ``root`` (default: ``LOONGKIT_SYSFS_ROOT`` or "/"). Never raises."""
    root = root or _default_root()
    r = _Reader(root)
    try:
        vendor, vendor_id = _cpu_vendor(r)
        online = _online_cpus(r)
        nodes = _nodes(r)
        if not online:
            online = frozenset().union(*(n.cpus for n in nodes)) if nodes else frozenset()
        cpus, l3s = _cpus_and_l3(r, online)
        allowed, mems = _status_lists(r)
        if _is_real_root(root):
            try:
                allowed = frozenset(os.sched_getaffinity(0))
            except (AttributeError, OSError) as exc:  # not Linux: keep what status said
                r.notes.append(f"os.sched_getaffinity unavailable: {exc}")
        if allowed is None:
            r.notes.append("allowed CPUs unknown; assuming all online CPUs")
            allowed = online
        gpus = tuple(sorted(_gpus(r), key=lambda g: g.pci))
        cgroup_version, cgroup_cpus = _cgroup(r)
    except Exception as exc:  # a bug here must not stop training; report what little we know
        r.notes.append(f"hardware detection failed: {type(exc).__name__}: {exc}")
        return Hardware(root=root, notes=tuple(r.notes))
    return Hardware(
        root=root,
        cpu_vendor=vendor,
        cpu_vendor_id=vendor_id,
        online_cpus=online,
        allowed_cpus=allowed,
        allowed_mems=mems or frozenset(),
        cgroup_cpus=cgroup_cpus,
        nodes=nodes,
        cpus=cpus,
        l3_caches=l3s,
        gpus=gpus,
        cgroup_version=cgroup_version,
        notes=tuple(r.notes),
    )
