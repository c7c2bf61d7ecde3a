"""The ``subcgroups`` feature: per-rank child cpuset cgroups for training and data processes.

At boot, a training (MAIN) process builds the node's NUMA plan with :func:`plan_for_node` (what
``loongkit numa plan`` prints) and creates two children of its own cpuset group::

    loongkit-<job id or main pid>-rank<local rank>-train   cpuset.cpus/mems = the rank's training CPUs/nodes
    loongkit-<job id or main pid>-rank<local rank>-data    cpuset.cpus/mems = its data CPUs/nodes

then moves itself into the train group. DataLoader workers (fork and spawn) move themselves into
the data group when they start; the group travels to them in :data:`WORKER_ENV`. Other tools can
then tune each group (cpu.weight, memory limits) without knowing about ranks. The kernel applies
the cpuset to the process's affinity, so NUMA_AFFINITY's direct binding is off (the declaration's
``disables``).

cgroup v1 (the ``cpuset`` hierarchy): a child needs ``cpuset.cpus`` and ``cpuset.mems`` written
before tasks can join. cgroup v2: ``+cpuset`` must be enabled in the parent's
``cgroup.subtree_control``, and a non-root group with controllers enabled for its children may not
hold processes, so the parent's processes first move into the leaf ``<parent>/loongkit-main``.

At exit the process moves back to where it came from and removes only the groups it created
(rmdir is retried briefly while exiting workers leave; leftovers are logged). A read-only cgroupfs,
a missing cpuset controller, missing delegation, EBUSY or EPERM end as "not applicable" or
"failed" with the reason, never as an exception in training.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BeforeValidator, Field
from pydantic_settings import SettingsConfigDict

from loongkit_core.context import ActivationContext, Environment, NotApplicable
from loongkit_core.feature import PolicyDecision
from loongkit_core.hardware import Hardware, format_cpulist, parse_cpulist
from loongkit_core.kit import FeatureImpl
from loongkit_core.log import get_logger
from loongkit_core.process import HELPER, LAUNCHER, WORKER
from loongkit_core.settings import LoongkitSettings, load_settings
from loongkit_numa.affinity import plan_for_node
from loongkit_numa.cgroup_tree import CgroupOps, Hierarchy, describe, locate, parse_proc_cgroup
from loongkit_numa.options import NumaAffinityOptions
from loongkit_numa.plan import RankPlan
from loongkit_numa.policy import vendor_policy

# Handed from a training process to its DataLoader workers: {"group": dir, "version": 1|2, "pid": main}.
WORKER_ENV = "_LOONGKIT_SUBCGROUPS_WORKER"
LEAF = "loongkit-main"  # v2: where the parent's processes go so the parent may enable +cpuset
GROUP_RE = re.compile(r"^loongkit-.+-rank\d+-(train|data)$")
RMDIR_TRIES = 20
RMDIR_WAIT_S = 0.05  # 1 s in all: long enough for exiting DataLoader workers to leave
ENABLE_TRIES = 3  # v2: processes forked into the parent meanwhile make +cpuset fail with EBUSY

# The core's structlog logger, for calls made without an activation (a worker callback registered by none):
# a feature logs through its ctx.log, which in a DataLoader worker writes to that worker's loongkit log file.
_log = get_logger("loongkit.subcgroups")


def _directory_or_unset(value: object) -> object:
    """An absolute, existing directory; empty means unset (a ValueError falls back to the default)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str) or not os.path.isabs(value):
        raise ValueError("must be an absolute path")
    if not os.path.isdir(value):
        raise ValueError("not a directory")
    return value


class SubcgroupsOptions(LoongkitSettings):
    model_config = SettingsConfigDict(env_prefix="LOONGKIT_SUBCGROUPS_", extra="ignore", case_sensitive=False)

    cgroup_root: Annotated[str | None, BeforeValidator(_directory_or_unset)] = Field(
        None, description="Filesystem root under which proc/self/mountinfo, proc/self/cgroup and the cgroup "
                          "mounts are read (default: LOONGKIT_SYSFS_ROOT, i.e. the real mounts). Lets the "
                          "NUMA topology come from a fake sysfs while the groups are real.")


# -- names and sets -------------------------------------------------------------------------------------
def job_tag(environ: Mapping[str, str], main_pid: int) -> str:
    """The job id shared by a job's ranks (SLURM, torchrun --rdzv-id), else the main process's pid."""
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        value = environ.get(name, "").strip()
        if value and value.lower() != "none":
            cleaned = re.sub(r"[^A-Za-z0-9_.]", "_", value)[:40]  # no "-": it separates the name's parts
            if cleaned.strip("._"):
                return cleaned
    return str(main_pid)


def group_names(tag: str, local_rank: int) -> tuple[str, str]:
    return f"loongkit-{tag}-rank{local_rank}-train", f"loongkit-{tag}-rank{local_rank}-data"


@dataclass(frozen=True)
class GroupSets:
    train_cpus: frozenset[int]
    train_mems: frozenset[int]
    data_cpus: frozenset[int]
    data_mems: frozenset[int]
    notes: tuple[str, ...] = ()


def _memory_nodes(hw: Hardware, nodes: tuple[int, ...], preferred: int | None) -> frozenset[int]:
    with_memory = frozenset(n for n in nodes if (info := hw.node(n)) is not None and info.has_memory)
    if with_memory:
        return with_memory
    return frozenset() if preferred is None else frozenset({preferred})


def group_sets(entry: RankPlan, hw: Hardware, parent_cpus: frozenset[int] | None,
               parent_mems: frozenset[int] | None) -> GroupSets:
    """The plan's CPUs/nodes for the two groups, within what the parent group may hand out.

    A child's cpuset must be a subset of its parent's: CPUs outside are dropped (none left: not
    applicable); planned memory nodes the parent lacks fall back to the parent's nodes, with a note
    (a fake topology on a one-node machine, or a container limited to some nodes).
    """
    assert entry.training_cpus is not None and entry.data_cpus is not None
    notes: list[str] = []

    def cpus(planned: frozenset[int], role: str) -> frozenset[int]:
        got = planned & parent_cpus if parent_cpus else planned
        if not got:
            raise NotApplicable(f"the planned {role} CPUs {format_cpulist(planned)} are outside this cgroup's "
                                f"CPUs {format_cpulist(parent_cpus or ())}")
        if got != planned:
            notes.append(f"{role} CPUs {format_cpulist(planned - got)} are outside this cgroup's CPUs; left out")
        return got

    def mems(nodes: tuple[int, ...], preferred: int | None, role: str) -> frozenset[int]:
        planned = _memory_nodes(hw, nodes, preferred)
        if not parent_mems:
            return planned
        got = planned & parent_mems
        if not got:
            notes.append(f"{role} memory nodes {format_cpulist(planned) or 'none'} are not in this cgroup's "
                         f"mems {format_cpulist(parent_mems)}; the group uses {format_cpulist(parent_mems)}")
            return parent_mems
        return got

    return GroupSets(
        train_cpus=cpus(entry.training_cpus, "training"),
        train_mems=mems(entry.training_nodes, entry.memory_node, "training"),
        data_cpus=cpus(entry.data_cpus, "data"),
        data_mems=mems(entry.data_nodes, entry.data_memory_node, "data"),
        notes=tuple(notes),
    )


# -- creating and removing --------------------------------------------------------------------------------
class SetupFailed(Exception):
    """A step failed after checks passed (EBUSY, EPERM, EINVAL from the kernel); rolled back already."""


@dataclass
class Partition:
    """The groups one training process made, and how to undo them."""

    hierarchy: Hierarchy
    base: str  # the parent of the train/data groups
    home: str  # where this process goes back to at exit
    train: str
    data: str
    pid: int
    created: list[str] = field(default_factory=list)  # groups this process made (rmdir'ed at exit)
    leaf: str | None = None  # v2: the leaf made for the parent's processes (by this process)
    enabled_cpuset: bool = False  # v2: this process wrote +cpuset into base's subtree_control
    moved: bool = False
    removed: bool = False


def _parse_set(ops: CgroupOps, path: str) -> frozenset[int] | None:
    raw = ops.read(path)
    if raw is None:
        return None
    try:
        return parse_cpulist(raw.strip())
    except ValueError:
        return None


def _is_root_group(h: Hierarchy, directory: str) -> bool:
    # The root cgroup is exempt from the no-internal-processes rule; it has no cgroup.type file.
    return os.path.normpath(directory) == os.path.normpath(h.mount_dir) and not os.path.exists(
        os.path.join(directory, "cgroup.type"))


def move_pid(ops: CgroupOps, h: Hierarchy, group: str, pid: int) -> OSError | None:
    """Move process ``pid`` (all its threads) into ``group``.

    v1 also accepts thread ids in ``tasks``: when ``cgroup.procs`` refuses the whole process for
    another reason than permissions or a busy group, each thread of this process is moved there.
    """
    error = ops.write(os.path.join(group, "cgroup.procs"), str(pid))
    if error is None or h.version != 1 or pid != os.getpid():
        return error
    if error.errno in (errno.EPERM, errno.EACCES, errno.EROFS, errno.EBUSY, errno.ESRCH, errno.ENOSPC):
        return error
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return error
    for tid in tids:
        thread_error = ops.write(os.path.join(group, "tasks"), str(tid))
        if thread_error is not None and thread_error.errno != errno.ESRCH:  # ESRCH: the thread ended
            return thread_error
    return None


def in_group(h: Hierarchy, group: str, pid: str = "self") -> bool | None:
    """Whether ``/proc/<pid>/cgroup`` names ``group`` (None when it cannot be told: fake trees)."""
    if os.path.realpath(h.root) != "/":
        return None
    try:
        with open(f"/proc/{pid}/cgroup") as fh:
            text = fh.read()
    except OSError:
        return None
    own = parse_proc_cgroup(text).get("cpuset" if h.version == 1 else "")
    if own is None:
        return None
    rel = os.path.relpath(group, h.mount_dir)
    expected = os.path.normpath(os.path.join(h.mount.root or "/", "" if rel == "." else rel))
    return os.path.normpath(own).endswith(expected) or expected.endswith(os.path.normpath(own))


def _v2_preconditions(ops: CgroupOps, h: Hierarchy, base: str) -> None:
    """Raise NotApplicable naming every missing piece of v2 delegation for ``base``."""
    controllers = (ops.read(os.path.join(base, "cgroup.controllers")) or "").split()
    if "cpuset" not in controllers:
        parent = os.path.dirname(base) if os.path.normpath(base) != os.path.normpath(h.mount_dir) else None
        where = f"'+cpuset' in {os.path.join(parent, 'cgroup.subtree_control')}" if parent else \
            "the cpuset controller (the kernel or a v1 mount holds it)"
        raise NotApplicable(f"cgroup v2: the cpuset controller is not delegated to {base} (cgroup.controllers: "
                            f"{' '.join(controllers) or 'none'}); needs {where}")
    missing = []
    for name in ("cgroup.subtree_control", "cgroup.procs"):
        path = os.path.join(base, name)
        if not ops.writable(path):
            missing.append(f"{path} is not writable")
    if not ops.writable(base):
        missing.append(f"cannot create groups in {base}")
    if missing:
        hint = ("; the mount uses nsdelegate: only groups inside this cgroup namespace can be delegated"
                if "nsdelegate" in h.mount.super_options | h.mount.mount_options else "")
        ro = "; the cgroupfs is mounted read-only" if h.mount.read_only else ""
        raise NotApplicable(f"cgroup v2 delegation of {base} is incomplete: {'; '.join(missing)}{ro}{hint} "
                            "(delegate the group to this user, or run with a writable cgroupfs)")
    kind = (ops.read(os.path.join(base, "cgroup.type")) or "domain").strip()
    if kind not in ("domain", ""):
        raise NotApplicable(f"cgroup v2: {base} is a {kind} group; cpuset children need a domain group")


def _v1_preconditions(ops: CgroupOps, h: Hierarchy, base: str) -> None:
    if h.mount.read_only:
        raise NotApplicable(f"the cgroup v1 cpuset hierarchy at {h.mount_dir} is mounted read-only")
    missing = [f"{p} is not writable" for p in (os.path.join(base, "cgroup.procs"),) if not ops.writable(p)]
    if not ops.writable(base):
        missing.append(f"cannot create groups in {base}")
    if missing:
        raise NotApplicable(f"cgroup v1 cpuset group {base}: {'; '.join(missing)}")


def _into_leaf(ops: CgroupOps, base: str, leaf: str) -> OSError | None:
    """Move every process of ``base`` into ``leaf``; a process that ended meanwhile is no error."""
    for pid in ops.pids(os.path.join(base, "cgroup.procs")):
        error = ops.write(os.path.join(leaf, "cgroup.procs"), str(pid))
        if error is not None and error.errno != errno.ESRCH:
            return OSError(error.errno, f"cannot move pid {pid} into {leaf}: {error.strerror or error}")
    return None


def _enable_cpuset(ops: CgroupOps, h: Hierarchy, part: Partition) -> None:
    """v2: make ``part.base`` able to hand cpusets to children (leaf first when it holds processes)."""
    base = part.base
    subtree = (ops.read(os.path.join(base, "cgroup.subtree_control")) or "").split()
    root = _is_root_group(h, base)
    for _ in range(ENABLE_TRIES):
        if not root and ops.pids(os.path.join(base, "cgroup.procs")):
            leaf = os.path.join(base, LEAF)
            made, error = ops.mkdir(leaf)
            if error is not None:
                raise SetupFailed(describe(error, f"cannot create the leaf {leaf}"))
            if made:
                part.leaf = leaf
            error = _into_leaf(ops, base, leaf)
            if error is not None:
                raise SetupFailed(describe(error, f"no-internal-processes rule: moving {base}'s processes "
                                                  "into a leaf failed"))
            part.home = leaf
        if "cpuset" in subtree:
            return
        error = ops.write(os.path.join(base, "cgroup.subtree_control"), "+cpuset")
        if error is None:
            part.enabled_cpuset = True
            return
        if error.errno != errno.EBUSY or root:
            raise SetupFailed(describe(error, f"cannot enable +cpuset in {base}/cgroup.subtree_control"))
    remaining = ops.pids(os.path.join(base, "cgroup.procs"))
    raise SetupFailed(f"cannot enable +cpuset in {base}/cgroup.subtree_control: EBUSY, it still holds "
                      f"processes {remaining[:8]} (no-internal-processes rule)")


def _make_group(ops: CgroupOps, h: Hierarchy, part: Partition, path: str, cpus: frozenset[int],
                mems: frozenset[int]) -> None:
    made, error = ops.mkdir(path)
    if error is not None:
        raise SetupFailed(describe(error, f"cannot create {path}"))
    if made:
        part.created.append(path)
    # v1: a child starts with empty cpus/mems and refuses tasks until both are set; cpus first.
    for file, value in ((h.cpus_file(path), format_cpulist(cpus)), (h.mems_file(path), format_cpulist(mems))):
        error = ops.write(file, value)
        if error is not None:
            raise SetupFailed(describe(error, f"cannot write {value!r} to {file}"))


def create(ops: CgroupOps, h: Hierarchy, names: tuple[str, str], sets: GroupSets, pid: int) -> Partition:
    """Create the train/data groups and move ``pid`` into the train group; undo everything on failure."""
    base = h.own_dir
    if h.version == 2 and os.path.basename(os.path.normpath(base)) == LEAF:
        base = os.path.dirname(os.path.normpath(base))  # a peer rank already moved us into the leaf
    part = Partition(hierarchy=h, base=base, home=h.own_dir, train=os.path.join(base, names[0]),
                     data=os.path.join(base, names[1]), pid=pid)
    if h.version == 2:
        _v2_preconditions(ops, h, base)
    else:
        _v1_preconditions(ops, h, base)
    try:
        if h.version == 2:
            _enable_cpuset(ops, h, part)
        _make_group(ops, h, part, part.train, sets.train_cpus, sets.train_mems)
        _make_group(ops, h, part, part.data, sets.data_cpus, sets.data_mems)
        error = move_pid(ops, h, part.train, pid)
        if error is not None:
            raise SetupFailed(describe(error, f"cannot move this process into {part.train}"))
        part.moved = True
        if in_group(h, part.train) is False:
            raise SetupFailed(f"wrote pid {pid} to {part.train}/cgroup.procs but /proc/self/cgroup does not name it")
    except SetupFailed as exc:
        notes = remove(ops, part, tries=1)
        raise SetupFailed("; ".join([str(exc), *notes])) from None
    return part


def _rmdir(ops: CgroupOps, path: str, tries: int) -> str | None:
    error: OSError | None = None
    for attempt in range(max(tries, 1)):
        error = ops.rmdir(path)
        if error is None or error.errno == errno.ENOENT:
            return None
        if error.errno not in (errno.EBUSY, errno.ENOTEMPTY) or attempt == tries - 1:
            break
        time.sleep(RMDIR_WAIT_S)
    left = ops.pids(os.path.join(path, "cgroup.procs"))
    still = f" (still holds pids {left[:8]})" if left else ""
    return describe(error, f"left {path}{still}")


def remove(ops: CgroupOps, part: Partition, tries: int = RMDIR_TRIES) -> list[str]:
    """Undo :func:`create`: back home, rmdir what was made, restore a v2 parent. Never raises.

    Returns what could not be undone. Only the creating process acts (a forked child inherits the
    Partition but must not tear down its parent's groups).
    """
    if part.removed or os.getpid() != part.pid:
        return []
    part.removed = True
    notes: list[str] = []
    h = part.hierarchy
    if part.moved:
        error = move_pid(ops, h, part.home, part.pid)
        if error is not None:
            notes.append(describe(error, f"cannot move this process back to {part.home}"))
        part.moved = False
    for path in reversed(part.created):
        # Only this job put processes here: children that outlive the exit hooks (multiprocessing's
        # resource tracker, persistent DataLoader workers) go home with us so the group can go.
        for pid in ops.pids(os.path.join(path, "cgroup.procs")):
            error = move_pid(ops, h, part.home, pid)
            if error is not None and error.errno != errno.ESRCH:
                notes.append(describe(error, f"cannot move pid {pid} from {path} to {part.home}"))
        problem = _rmdir(ops, path, tries)
        if problem:
            notes.append(problem)
    if h.version == 2 and (part.leaf or part.enabled_cpuset):
        notes.extend(_restore_v2_parent(ops, part, tries))
    return notes


def _restore_v2_parent(ops: CgroupOps, part: Partition, tries: int) -> list[str]:
    """Undo the leaf and +cpuset when no rank group of any job is left under the parent."""
    try:
        others = sorted(n for n in os.listdir(part.base) if GROUP_RE.match(n))
    except OSError as exc:
        return [describe(exc, f"cannot list {part.base}")]
    if others:
        return [f"left {part.base} as it is: other ranks' groups remain ({', '.join(others[:4])})"]
    if part.enabled_cpuset:
        error = ops.write(os.path.join(part.base, "cgroup.subtree_control"), "-cpuset")
        if error is not None:
            return [describe(error, f"cannot disable cpuset in {part.base}/cgroup.subtree_control")]
    if part.leaf:
        for pid in ops.pids(os.path.join(part.leaf, "cgroup.procs")):
            error = ops.write(os.path.join(part.base, "cgroup.procs"), str(pid))
            if error is not None and error.errno != errno.ESRCH:
                return [describe(error, f"cannot move pid {pid} back to {part.base}")]
        problem = _rmdir(ops, part.leaf, tries)
        if problem:
            return [problem]
    return []


# -- the data-worker side -----------------------------------------------------------------------------
def join_data_group(ops: CgroupOps, environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Move this (data worker) process into the data group its training process made."""
    raw = (os.environ if environ is None else environ).get(WORKER_ENV)
    if not raw:
        return False, "no data group from a training process"
    try:
        handoff = json.loads(raw)
        group = str(handoff["group"])
        version = int(handoff["version"])
    except (ValueError, KeyError, TypeError) as exc:
        return False, f"garbled {WORKER_ENV}={raw[:60]!r}: {exc}"
    error = ops.write(os.path.join(group, "cgroup.procs"), str(os.getpid()))
    if error is not None:
        return False, describe(error, f"cannot join {group}")
    return True, f"data worker joined {group} (cgroup v{version})"


def on_data_worker_start(worker_id: int, ops: CgroupOps | None = None, log: Any = None) -> None:
    """The DataLoader worker callback (``ctx.on_worker_start``): runs first thing in every worker, with the
    registering activation's ``ops`` and ``ctx.log``."""
    try:
        joined, message = join_data_group(ops if ops is not None else CgroupOps())
    except Exception as exc:  # never break a DataLoader worker
        joined, message = False, f"{type(exc).__name__}: {exc}"
    log = log if log is not None else _log
    (log.info if joined else log.warning)(f"subcgroups: worker {worker_id}: {message}")


def _register_worker_hook(ctx: ActivationContext, ops: CgroupOps) -> None:
    """Once per activation; the default deactivate unregisters it."""
    scratch = ctx.scratch
    if getattr(scratch, "worker_hook", False):
        return
    callback = functools.update_wrapper(functools.partial(on_data_worker_start, ops=ops, log=ctx.log),
                                        on_data_worker_start)
    try:
        ctx.on_worker_start(callback)
    except ImportError as exc:
        ctx.log.warning(f"subcgroups: loongkit_core.workers unavailable ({exc}); forked DataLoader workers "
                        "stay in the training group")
        return
    scratch.worker_hook = True


# -- the feature ------------------------------------------------------------------------------------------
@dataclass
class _Config:
    options: SubcgroupsOptions
    numa: NumaAffinityOptions
    warnings: list[str]


class Subcgroups(FeatureImpl):
    """The groups' removal (processes moved home, groups removed) is deferred on ``ctx.patcher`` and
    also runs at exit, whichever comes first; the workers' handoff is set with ``set_item``: the
    default ``deactivate`` undoes the feature. The worker callback (registered once per process) finds
    no handoff after that."""

    options = SubcgroupsOptions
    ops: CgroupOps = CgroupOps()  # tests put a kernel emulator here for fake v2 trees

    def __init__(self, feature: Any) -> None:
        super().__init__(feature)
        self.partition: Partition | None = None
        self._ctx: ActivationContext | None = None

    def _root(self, env: Environment, options: SubcgroupsOptions) -> str:
        return options.cgroup_root or env.settings.sysfs_root or "/"

    def detect(self, env: Environment) -> str | None:
        role = env.process.role
        if role in (LAUNCHER, HELPER):
            return f"nothing to place in a {role} process"
        if role == WORKER:
            return None  # a worker follows its training process's handoff
        options, _ = load_settings(SubcgroupsOptions, environ=env.environ)
        found = locate(self._root(env, options))
        if isinstance(found, str):
            return found
        hw = env.hardware
        if not hw.accelerators:
            return f"no GPU found under {os.path.join(hw.root, 'sys/bus/pci/devices')}"
        return None

    def configure(self, env: Environment, policy: PolicyDecision | None) -> tuple[object, list[str]]:
        options, warnings = super().configure(env, policy)
        # The plan follows LOONGKIT_NUMA_AFFINITY_* and the vendor policy's defaults, as NUMA_AFFINITY would.
        numa_policy = None
        if env.process.role not in (WORKER, LAUNCHER, HELPER):
            try:
                numa_policy = vendor_policy(env.hardware, [_numa_feature()]).get("numa_affinity")
            except Exception:  # a policy problem must not stop the feature; defaults stay
                numa_policy = None
        numa, numa_warnings = load_settings(
            NumaAffinityOptions, defaults=numa_policy.option_defaults if numa_policy else None, environ=env.environ)
        warnings = [*warnings, *numa_warnings, *numa.consistency_warnings()]
        assert isinstance(options, SubcgroupsOptions)
        return _Config(options, numa, warnings), warnings

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        config = ctx.config
        if not isinstance(config, _Config):
            built, _ = self.configure(ctx.env, None)
            assert isinstance(built, _Config)
            config = built
        root = self._root(ctx.env, config.options)
        ctx.set_config({"cgroup_root": root})
        if ctx.env.process.role == WORKER:
            joined, message = join_data_group(self.ops, ctx.env.environ)
            ctx.detail("worker", message)
            if not joined:
                raise NotApplicable(message)
            ctx.log.info(f"subcgroups: {message}")
            ctx.count()
            return
        self._activate_trainer(ctx, config, root)

    def _activate_trainer(self, ctx: ActivationContext, config: _Config, root: str) -> None:
        process = ctx.env.process
        local_rank = process.local_rank or 0
        local_world_size = process.local_world_size or max(local_rank + 1, 1)
        found = locate(root)
        if isinstance(found, str):
            raise NotApplicable(found)
        h = found
        plan = plan_for_node(ctx.env.hardware, config.numa, ctx.env.environ,
                             local_world_size=local_world_size, local_rank=local_rank, log=ctx.log)
        entry = plan.rank(local_rank)
        ctx.detail("plan", entry.to_json())
        if not entry.bound:
            raise NotApplicable(f"the NUMA plan leaves local rank {local_rank} unbound: {entry.why or 'no reason'}")
        parent = h.own_dir
        sets = group_sets(entry, ctx.env.hardware, _parse_set(self.ops, h.cpus_file(parent, effective=True))
                          or _parse_set(self.ops, h.cpus_file(parent)),
                          _parse_set(self.ops, h.mems_file(parent, effective=True))
                          or _parse_set(self.ops, h.mems_file(parent)))
        for note in sets.notes:
            ctx.log.info(f"subcgroups: {note}")
        names = group_names(job_tag(ctx.env.environ, process.pid), local_rank)
        try:
            part = create(self.ops, h, names, sets, os.getpid())
        except SetupFailed as exc:
            raise RuntimeError(f"cgroup {h.label}: {exc}") from None
        self.partition = part
        self._ctx = ctx
        ctx.patcher.defer(functools.partial(self._cleanup_and_log, ctx.log))
        ctx.at_exit(self._cleanup_at_exit)  # before the Summary, and on SIGTERM too
        ctx.set_config({"cgroup": h.label, "train": part.train, "data": part.data})
        ctx.detail("train_cpuset", f"cpus {format_cpulist(sets.train_cpus)} mems {format_cpulist(sets.train_mems)}")
        ctx.detail("data_cpuset", f"cpus {format_cpulist(sets.data_cpus)} mems {format_cpulist(sets.data_mems)}")
        if part.leaf or part.home != h.own_dir:
            ctx.detail("leaf", part.home)
        handoff = json.dumps({"group": part.data, "version": h.version, "pid": os.getpid()})
        environ: MutableMapping[str, str] = os.environ  # forked and spawned workers inherit it
        ctx.patcher.set_item(environ, WORKER_ENV, handoff)
        _register_worker_hook(ctx, self.ops)
        ctx.log.info(f"subcgroups: local rank {local_rank} in {part.train} (CPUs {format_cpulist(sets.train_cpus)}, "
                     f"mems {format_cpulist(sets.train_mems)}); data workers go to {part.data} "
                     f"(CPUs {format_cpulist(sets.data_cpus)}) [{entry.rule}: {entry.why}]")
        ctx.count()

    def _cleanup_at_exit(self) -> None:
        log = self._ctx.log if self._ctx is not None else _log
        try:
            self._cleanup_and_log(log)
        except Exception as exc:  # exit must stay quiet whatever cgroupfs does
            log.warning(f"subcgroups: cleanup: {type(exc).__name__}: {exc}")

    def _cleanup_and_log(self, logger: Any) -> None:
        for note in self._cleanup():  # at exit: before the Summary, the log is still open
            logger.warning(f"subcgroups: cleanup: {note}")

    def _cleanup(self) -> list[str]:
        """Remove this process's groups, once (at undo or at exit, whichever comes first)."""
        part = self.partition
        if part is None or os.getpid() != part.pid:
            return []
        self.partition = None
        notes = remove(self.ops, part)
        if self._ctx is not None:
            self._ctx.detail("cleanup", "; ".join(notes) if notes else f"removed {len(part.created)} group(s)")
        return notes


def _numa_feature() -> Any:
    from loongkit_numa.plugin import plugin

    return next(f for f in plugin.loongkit_declare_features() if f.name == "numa_affinity")
