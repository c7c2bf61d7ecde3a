"""The ``numa_affinity`` feature: bind each training process, and its data workers, per the NUMA plan.

At boot, in a training (MAIN) process: find the GPUs the local ranks use, build the node's plan with
:func:`plan_for_node` (the very function ``loongkit numa plan`` prints), narrow this process's CPUs
to its rank's training CPUs (``os.sched_setaffinity`` on every thread) and prefer its memory node
(``set_mempolicy(MPOL_PREFERRED)`` through ``ctypes``, no libnuma). The rank's data CPUs travel to
its DataLoader workers in the environment variable :data:`WORKER_PLAN_ENV`; a worker (fork or
spawn) applies them when it starts, through the callback ``ctx.on_worker_start`` registers and through
its own boot in the WORKER role, whichever comes first (applying twice is harmless).

Faults are reasons, never exceptions escaping into training: anything that cannot be done raises
:class:`~loongkit_core.context.NotApplicable` with the reason, or is logged and skipped.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import platform
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

from loongkit_core.context import ActivationContext, Environment, NotApplicable
from loongkit_core.feature import PolicyDecision
from loongkit_core.hardware import Gpu, Hardware, format_cpulist, parse_cpulist
from loongkit_core.kit import FeatureImpl
from loongkit_core.log import get_logger
from loongkit_core.process import HELPER, LAUNCHER, WORKER
from loongkit_numa.options import NumaAffinityOptions
from loongkit_numa.plan import NodePlan, RankPlan, build_plan, unbound_plan

# Handed from a training process to its children: {"cpus": "0-7", "mem": 0, "rank": 0, "pid": 123}.
# The leading underscore keeps it out of the LOONGKIT_* namespace users configure.
WORKER_PLAN_ENV = "_LOONGKIT_NUMA_WORKER"
MIN_TORCH_PCI = (2, 5)  # torch.cuda device properties carry the PCI address from 2.5 on

# The core's structlog logger, for calls made without an activation (``loongkit numa plan``, a worker
# callback registered by none): a feature logs through its ctx.log, which in a DataLoader worker writes to
# that worker's loongkit log file.
_log = get_logger("loongkit.numa_affinity")


# -- memory policy ------------------------------------------------------------------------------------
MPOL_DEFAULT = 0
MPOL_PREFERRED = 1
# (set_mempolicy, get_mempolicy) syscall numbers; the generic table serves arm64, riscv64, loongarch64.
_MEMPOLICY_SYSCALLS = {
    "x86_64": (238, 239),
    "aarch64": (237, 236),
    "arm64": (237, 236),
    "riscv64": (237, 236),
    "loongarch64": (237, 236),
    "ppc64le": (261, 260),
    "ppc64": (261, 260),
    "s390x": (270, 269),
}
_NODEMASK_WORDS = 16  # 1024 nodes; one more zero word is passed to absorb the kernel's maxnode quirk


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def set_preferred_memory_node(node: int | None) -> str | None:
    """Prefer ``node`` for this thread's future allocations (None: back to the default policy).

    Returns None on success, else why it was skipped (EPERM under seccomp, unknown architecture).
    """
    numbers = _MEMPOLICY_SYSCALLS.get(platform.machine())
    if numbers is None or not sys.platform.startswith("linux"):
        return f"set_mempolicy is not known on {sys.platform}/{platform.machine()}"
    if node is not None and not 0 <= node < _NODEMASK_WORDS * 64:
        return f"memory node {node} is out of range"
    mask = (ctypes.c_ulong * (_NODEMASK_WORDS + 1))()
    if node is None:
        mode, maxnode, mask_arg = MPOL_DEFAULT, 0, None
    else:
        mask[node // 64] = 1 << (node % 64)
        # The kernel reads maxnode - 1 bits (a historical off-by-one libnuma also compensates for).
        mode, maxnode, mask_arg = MPOL_PREFERRED, _NODEMASK_WORDS * 64 + 1, mask
    try:
        result = _libc().syscall(ctypes.c_long(numbers[0]), ctypes.c_int(mode), mask_arg, ctypes.c_ulong(maxnode))
    except (OSError, AttributeError) as exc:
        return f"set_mempolicy unavailable: {exc}"
    if result != 0:
        err = ctypes.get_errno()
        what = "not permitted (seccomp or missing CAP_SYS_NICE)" if err == 1 else os.strerror(err)
        call = "MPOL_DEFAULT" if node is None else f"MPOL_PREFERRED, node {node}"
        return f"set_mempolicy({call}) failed: {what}"
    return None


def get_memory_policy() -> tuple[int, frozenset[int]] | None:
    """This thread's (mode, nodes), or None when it cannot be read."""
    numbers = _MEMPOLICY_SYSCALLS.get(platform.machine())
    if numbers is None or not sys.platform.startswith("linux"):
        return None
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * (_NODEMASK_WORDS + 1))()
    try:
        result = _libc().syscall(ctypes.c_long(numbers[1]), ctypes.byref(mode), mask,
                                 ctypes.c_ulong(_NODEMASK_WORDS * 64 + 1), None, ctypes.c_ulong(0))
    except (OSError, AttributeError):
        return None
    if result != 0:
        return None
    nodes = frozenset(w * 64 + b for w in range(_NODEMASK_WORDS + 1) for b in range(64) if mask[w] >> b & 1)
    return mode.value, nodes


# -- CPU affinity -------------------------------------------------------------------------------------
def set_process_affinity(cpus: frozenset[int]) -> str | None:
    """Move every thread of this process onto ``cpus``; None on success, else why not.

    ``sched_setaffinity(0)`` moves only the calling thread, and threads inherit the mask when they
    are created; threads started before us (OpenMP pools, loaders) are moved one by one.
    """
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, AttributeError, ValueError) as exc:
        return f"sched_setaffinity({format_cpulist(cpus)}) failed: {exc}"
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return None
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass  # the thread ended meanwhile, or belongs to a sandbox we may not touch
    return None


# -- which GPU each local rank uses -------------------------------------------------------------------
def _cuda_present() -> bool:
    """A GPU driver is loaded on this machine (checked on the real root, whatever the sysfs root)."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/kfd"))


def _torch_version() -> tuple[int, int] | None:
    version = Environment.version("torch")
    if not version:
        return None
    try:
        major, minor = version.split(".")[:2]
        return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)
    except ValueError:
        return None


def _torch_pci_addresses() -> list[str] | None:
    """PCI address (domain:bus:device) of each CUDA device torch sees, in device order; None if none."""
    import torch  # only reached when torch is already imported or a GPU driver is present

    if not torch.cuda.is_available():
        return None
    found: list[str] = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        bus = getattr(props, "pci_bus_id", None)
        device = getattr(props, "pci_device_id", None)
        if bus is None or device is None:
            return None
        found.append(f"{getattr(props, 'pci_domain_id', 0) or 0:04x}:{bus:02x}:{device:02x}")
    return found


def visible_gpus(hw: Hardware, options: NumaAffinityOptions, environ: Mapping[str, str], *,
                 local_world_size: int, local_rank: int = 0,
                 use_torch: bool | None = None, log: Any = None) -> tuple[list[Gpu | None], str]:
    """The GPU of each local rank (device index = local rank) and how that was found (``log``: the
    feature's ctx.log).

    Raises NotApplicable when this torch cannot say, ALLOW_INDEX is off and there is a GPU to identify
    (with none, the plan's own reason, "no GPU found", is the one to give, as the feature's detect gives it).
    """
    version = _torch_version()
    if use_torch is None:
        use_torch = "torch" in sys.modules or _cuda_present()
    if version is not None and version >= MIN_TORCH_PCI and use_torch:
        try:
            addresses = _torch_pci_addresses()
        except Exception as exc:  # a broken CUDA setup must not stop training
            addresses = None
            (log or _log).info(f"numa_affinity: torch could not report GPU PCI addresses "
                               f"({type(exc).__name__}: {exc})")
        if addresses:
            by_address = {g.pci.rsplit(".", 1)[0].lower(): g for g in hw.accelerators}
            missing = [a for a in addresses if a not in by_address]
            if missing:
                where = os.path.join(hw.root, "sys/bus/pci/devices")
                raise NotApplicable(f"torch's GPU(s) {', '.join(missing)} not found under {where}")
            gpus: list[Gpu | None] = [by_address[a] for a in addresses]
            source = "torch device PCI addresses (CUDA_VISIBLE_DEVICES honoured)"
            if len(gpus) == 1 and local_world_size > 1:
                # One visible device per process (launcher-set CUDA_VISIBLE_DEVICES): cuda:0 is ours,
                # the other ranks' GPUs are unknown here.
                only = gpus[0]
                gpus = [only if r == local_rank else None for r in range(local_world_size)]
                source += "; one GPU visible per process"
            return gpus, source
    old_torch = version if version is not None and version < MIN_TORCH_PCI else None
    if old_torch is not None and not options.allow_index and hw.accelerators:
        raise NotApplicable(
            f"torch {old_torch[0]}.{old_torch[1]} cannot report the GPU's PCI address (needs torch >= 2.5); "
            "set LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX=1 to bind by index order (and leave CUDA_VISIBLE_DEVICES unset)")
    if old_torch is not None:
        why = "LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX=1" if options.allow_index else "no GPU to identify"
    else:
        why = "no CUDA device visible to torch in this process"
    source = f"index order: local rank N uses the N-th GPU in PCI order ({why})"
    if environ.get("CUDA_VISIBLE_DEVICES") is not None:
        source += "; CUDA_VISIBLE_DEVICES is ignored in index order and may make the binding wrong"
    return list(hw.accelerators), source


def plan_for_node(hw: Hardware, options: NumaAffinityOptions, environ: Mapping[str, str], *,
                  local_world_size: int, local_rank: int = 0, use_torch: bool | None = None,
                  log: Any = None) -> NodePlan:
    """The plan of every local rank on this node: what ``loongkit numa plan`` prints and what is applied
    (``log``: the feature's ctx.log)."""
    try:
        gpus, source = visible_gpus(hw, options, environ, local_world_size=local_world_size,
                                    local_rank=local_rank, use_torch=use_torch, log=log)
    except NotApplicable as exc:
        return unbound_plan(hw, options, local_world_size, str(exc))
    return build_plan(hw, options, local_world_size, gpus, gpu_source=source)


# -- the data-worker side -----------------------------------------------------------------------------
def apply_worker_binding(environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Bind this (data worker) process to the data CPUs its training process planned.

    Returns (applied, message). Used by the worker-start callback and by WORKER-role activation.
    """
    raw = (os.environ if environ is None else environ).get(WORKER_PLAN_ENV)
    if not raw:
        return False, "no NUMA plan from a training process (it was not bound)"
    try:
        handoff = json.loads(raw)
        cpus = parse_cpulist(str(handoff["cpus"]))
        mem = handoff.get("mem")
    except (ValueError, KeyError, TypeError) as exc:
        return False, f"garbled {WORKER_PLAN_ENV}={raw[:60]!r}: {exc}"
    if not cpus:
        return False, "the training process planned no data CPUs"
    problem = set_process_affinity(cpus)
    if problem:
        return False, problem
    message = f"data worker bound to CPUs {format_cpulist(cpus)}"
    if isinstance(mem, int):
        mem_problem = set_preferred_memory_node(mem)
        message += f", memory skipped: {mem_problem}" if mem_problem else f", preferred memory node {mem}"
    return True, message


def on_data_worker_start(worker_id: int, log: Any = None) -> None:
    """The DataLoader worker callback (``ctx.on_worker_start``): runs first thing in every worker, logging
    to ``log`` (the registering activation's ``ctx.log``)."""
    try:
        applied, message = apply_worker_binding()
    except Exception as exc:  # never break a DataLoader worker
        applied, message = False, f"{type(exc).__name__}: {exc}"
    log = log if log is not None else _log
    (log.info if applied else log.debug)(f"numa_affinity: worker {worker_id}: {message}")


def _register_worker_hook(ctx: ActivationContext) -> None:
    """Once per activation; the default deactivate unregisters it."""
    scratch = ctx.scratch
    if getattr(scratch, "worker_hook", False):
        return
    callback = functools.update_wrapper(functools.partial(on_data_worker_start, log=ctx.log), on_data_worker_start)
    try:
        ctx.on_worker_start(callback)
    except ImportError as exc:
        ctx.log.warning(f"numa_affinity: loongkit_core.workers unavailable ({exc}); forked DataLoader workers "
                        "keep the training CPUs")
        return
    scratch.worker_hook = True


# -- the feature ------------------------------------------------------------------------------------
def summary_config(options: NumaAffinityOptions) -> dict[str, bool]:
    """What the Summary's Configurations column shows.

    The seed's form, ``{'allow_asymmetric': False, 'allow_index': False}``, plus every other option
    that is on (so the line stays short, and a policy-enabled PARTITION_PER_LLC is visible).
    """
    shown = {"allow_asymmetric": options.allow_asymmetric, "allow_index": options.allow_index}
    shown.update({name: True for name in NumaAffinityOptions.model_fields if getattr(options, name)})
    return shown


class NumaAffinity(FeatureImpl):
    """The CPU mask's restore and the memory policy's reset are deferred on ``ctx.patcher``, the
    workers' plan is set with ``set_item``: the default ``deactivate`` undoes the binding. The worker
    callback (registered once per process) does nothing once the plan is gone from the environment."""

    options = NumaAffinityOptions

    def detect(self, env: Environment) -> str | None:
        if not hasattr(os, "sched_setaffinity"):
            return "os.sched_setaffinity is not available on this platform"
        role = env.process.role
        if role in (LAUNCHER, HELPER):
            return f"nothing to bind in a {role} process"
        if role == WORKER:
            return None  # a worker follows its training process's plan, handed over in the environment
        hw = env.hardware
        if not hw.accelerators:
            return f"no GPU found under {os.path.join(hw.root, 'sys/bus/pci/devices')}"
        if not any(n.cpus for n in hw.nodes):
            return f"no NUMA node with CPUs under {os.path.join(hw.root, 'sys/devices/system/node')}"
        return None

    def configure(self, env: Environment, policy: PolicyDecision | None) -> tuple[object, list[str]]:
        options, warnings = super().configure(env, policy)
        if isinstance(options, NumaAffinityOptions):
            warnings = [*warnings, *options.consistency_warnings()]
        return options, warnings

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        options = ctx.config
        if not isinstance(options, NumaAffinityOptions):
            options, _ = self.configure(ctx.env, None)
            assert isinstance(options, NumaAffinityOptions)
        ctx.set_config(summary_config(options))
        if ctx.env.process.role == WORKER:
            applied, message = apply_worker_binding(ctx.env.environ)
            ctx.detail("worker", message)
            if not applied:
                raise NotApplicable(message)
            ctx.log.info(f"numa_affinity: {message}")
            ctx.count()
            return
        self._activate_trainer(ctx, options)

    def _activate_trainer(self, ctx: ActivationContext, options: NumaAffinityOptions) -> None:
        process = ctx.env.process
        local_rank = process.local_rank or 0
        local_world_size = process.local_world_size or max(local_rank + 1, 1)
        plan = plan_for_node(ctx.env.hardware, options, ctx.env.environ,
                             local_world_size=local_world_size, local_rank=local_rank, log=ctx.log)
        entry = plan.rank(local_rank)
        ctx.detail("plan", entry.to_json())
        ctx.detail("gpu_source", plan.gpu_source)
        if plan.gpu_source:
            ctx.log.info(f"numa_affinity: GPUs by {plan.gpu_source}")
        for note in plan.notes:
            ctx.log.info(f"numa_affinity: {note}")
        if not entry.bound:
            raise NotApplicable(entry.why or "nothing to bind")
        self._bind_trainer(ctx, entry)

    def _bind_trainer(self, ctx: ActivationContext, entry: RankPlan) -> None:
        assert entry.training_cpus is not None and entry.data_cpus is not None
        current = frozenset(os.sched_getaffinity(0))
        target = entry.training_cpus & current  # never widen what this process was given
        if not target:
            raise NotApplicable(f"planned CPUs {format_cpulist(entry.training_cpus)} are outside this "
                                f"process's CPUs {format_cpulist(current)}")
        problem = set_process_affinity(target)
        if problem:
            raise NotApplicable(problem)
        ctx.patcher.defer(functools.partial(set_process_affinity, current))
        ctx.detail("cpus", format_cpulist(target))
        ctx.log.info(f"numa_affinity: local rank {entry.local_rank} (GPU {entry.gpu}, NUMA {entry.node}) bound to "
                     f"CPUs {format_cpulist(target)} [{entry.rule}: {entry.why}]")
        if entry.memory_node is not None:
            mem_problem = set_preferred_memory_node(entry.memory_node)
            if mem_problem:
                ctx.log.warning(f"numa_affinity: memory binding skipped: {mem_problem}")
                ctx.detail("memory", f"skipped: {mem_problem}")
            else:
                # Undo goes back to the default policy (what a process has unless started under numactl).
                ctx.patcher.defer(functools.partial(set_preferred_memory_node, None))
                ctx.detail("memory", f"preferred node {entry.memory_node}")
        data = entry.data_cpus & current
        if data:
            handoff = json.dumps({"cpus": format_cpulist(data), "mem": entry.data_memory_node,
                                  "rank": entry.local_rank, "pid": os.getpid()})
            # Workers, forked or spawned, inherit the environment: the plan travels with them.
            environ: MutableMapping[str, str] = os.environ
            ctx.patcher.set_item(environ, WORKER_PLAN_ENV, handoff)
            ctx.detail("data_cpus", format_cpulist(data))
            _register_worker_hook(ctx)
        ctx.count()
