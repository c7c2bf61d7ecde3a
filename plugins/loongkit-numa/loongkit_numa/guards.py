"""LOONGKIT_CONFIG_GUARDS: warn when thread pools, data workers or compile threads exceed the node's CPUs.

The node's CPU budget is the CPU mask this job may use (the process's affinity at boot, narrowed to
its cgroup's cpuset) capped by the cgroup CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` /
``cpu.cfs_period_us``, the tightest along the group's ancestors), all read under
``LOONGKIT_SYSFS_ROOT``. Every local rank of a node shares that budget, so each count is multiplied
by the local world size (``LOCAL_WORLD_SIZE``).

Checks, each one WARNING line with the numbers and the suggested value:

* at ``torch`` import: intra-op threads, inter-op threads, OMP_NUM_THREADS / MKL_NUM_THREADS as the
  user set them (torchrun sets OMP_NUM_THREADS=1 only when the user did not, so "1" under a
  multi-process torchrun is reported as torchrun's default, not the user's);
* the intra-op threads again whenever the job sets them (``torch.set_num_threads``, observed) and
  when a DataLoader iterator is created (the value in force, however it was set);
* at each DataLoader construction: num_workers x local ranks (+ one pin-memory thread per rank);
* at ``torch._inductor.config`` import: compile_threads x local ranks;
* in each DataLoader worker, when cv2 is already imported there: OpenCV threads per worker.

Findings are node-wide (every rank computes the same numbers), so only local rank 0 (or a process
without a rank) logs them, and each distinct line once per process. With
LOONGKIT_CONFIG_GUARDS_APPLY_FIX=1 the suggested values are applied and each change is logged.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from loongkit_core import cgroupfs
from loongkit_core.context import ActivationContext, Environment, NotApplicable
from loongkit_core.hardware import Hardware
from loongkit_core.kit import FeatureImpl
from loongkit_core.process import HELPER, LAUNCHER, WORKER
from loongkit_core.settings import LkBool, LoongkitSettings

# Handed from a training process to its DataLoader workers (fork and spawn): budget, ranks, workers.
WORKER_ENV = "_LOONGKIT_GUARDS_WORKER"
INDUCTOR_TARGET = "torch._inductor.config"
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


class GuardsOptions(LoongkitSettings):
    model_config = SettingsConfigDict(env_prefix="LOONGKIT_CONFIG_GUARDS_", extra="ignore", case_sensitive=False)

    apply_fix: LkBool = Field(False, description="Apply the suggested thread and worker counts.")


# -- the budget ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CpuBudget:
    cpus: int  # whole CPUs this node's job may keep busy
    mask: int  # CPUs in the affinity mask (and cpuset)
    quota: float | None  # the cgroup quota in CPUs, None when unlimited or unknown
    quota_source: str = ""
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.quota is not None and self.cpus < self.mask:
            return f"{self.cpus} CPUs available to this node's job (cgroup quota {self.quota:g} CPUs, " \
                   f"{self.mask} CPUs in the mask)"
        return f"{self.cpus} CPUs available to this node's job"


def cpu_budget(hw: Hardware, root: str) -> CpuBudget:
    """The node's CPU budget: affinity mask (and cgroup cpuset) capped by the cgroup CPU quota."""
    mask_cpus = hw.allowed_cpus or hw.online_cpus
    if hw.cgroup_cpus and mask_cpus and (hw.cgroup_cpus & mask_cpus):
        mask_cpus = mask_cpus & hw.cgroup_cpus
    mask = len(mask_cpus) or os.cpu_count() or 1
    quota, notes = cgroupfs.cpu_quota(root)
    cpus = mask
    if quota is not None:
        # A fractional quota keeps only its whole part busy without throttling; never below one.
        cpus = min(mask, max(1, int(quota.cpus)))
    return CpuBudget(cpus=cpus, mask=mask, quota=None if quota is None else quota.cpus,
                     quota_source="" if quota is None else quota.source, notes=tuple(notes))


# -- the checks (pure: numbers in, finding out) -------------------------------------------------------
@dataclass(frozen=True)
class Finding:
    check: str
    message: str
    value: int
    suggested: int


def _ranks(lws: int) -> str:
    return f"{lws} local rank{'s' if lws != 1 else ''}"


def check_threads(what: str, value: int, lws: int, budget: CpuBudget, advice: str) -> Finding | None:
    """``value`` threads per rank x ``lws`` ranks against the budget; ``advice`` formats the suggestion."""
    total = value * lws
    if value <= 1 or total <= budget.cpus:
        return None
    suggested = max(1, budget.cpus // lws)
    return Finding(what.split("=")[0].split(" (")[0], f"{what}={value} x {_ranks(lws)} = {total} > "
                   f"{budget.describe()}; suggest {advice.format(suggested)}", value, suggested)


def check_dataloader(num_workers: int, pin_threads: int, lws: int, budget: CpuBudget) -> Finding | None:
    """num_workers x local ranks (+ one pin-memory thread per rank) against the budget."""
    if num_workers <= 0:
        return None
    total = num_workers * lws + pin_threads * lws
    if total <= budget.cpus:
        return None
    suggested = max(0, budget.cpus // lws - pin_threads)
    pins = f" + {pin_threads * lws} pin-memory thread{'s' if pin_threads * lws != 1 else ''}" if pin_threads else ""
    return Finding("dataloader_num_workers",
                   f"DataLoader num_workers={num_workers} x {_ranks(lws)}{pins} = {total} > {budget.describe()}; "
                   f"suggest num_workers={suggested}", num_workers, suggested)


def check_cv2(threads: int, workers: int, lws: int, budget: CpuBudget) -> Finding | None:
    """OpenCV threads in each DataLoader worker: all workers of all ranks share the budget."""
    processes = max(1, workers) * lws
    total = threads * processes
    if threads <= 1 or total <= budget.cpus:
        return None
    suggested = max(1, budget.cpus // processes)
    if threads <= suggested:
        return None
    return Finding("cv2_threads", f"OpenCV threads={threads} in each of {workers} DataLoader workers x {_ranks(lws)} "
                   f"= {total} > {budget.describe()}; suggest cv2.setNumThreads({suggested}) in workers",
                   threads, suggested)


def user_thread_vars(environ: dict[str, str] | Any, lws: int) -> dict[str, tuple[int | None, str]]:
    """OMP/MKL thread variables as the user set them: {name: (value or None, origin)}.

    torchrun (``torch.distributed.run``) sets OMP_NUM_THREADS=1 only when it is unset and
    nproc-per-node > 1, so a "1" in a rank of such a run is taken as torchrun's default.
    """
    out: dict[str, tuple[int | None, str]] = {}
    under_torchrun = "TORCHELASTIC_RUN_ID" in environ and lws > 1
    for name in THREAD_VARS:
        raw = environ.get(name)
        if raw is None:
            out[name] = (None, "unset")
            continue
        if name == "OMP_NUM_THREADS" and raw.strip() == "1" and under_torchrun:
            out[name] = (None, "torchrun default 1 (unset by the user)")
            continue
        try:
            out[name] = (int(raw.strip()), "user")
        except ValueError:
            out[name] = (None, f"not a number: {raw[:20]!r}")
    return out


# -- the worker side ------------------------------------------------------------------------------------
def _local_rank_zero() -> bool:
    raw = os.environ.get("LOCAL_RANK")
    return raw is None or raw.strip() in ("", "0")


def on_worker_start(worker_id: int, log: Any = None) -> Finding | None:
    """In a DataLoader worker: check (and with apply_fix, set) OpenCV's threads if cv2 is imported."""
    cv2 = sys.modules.get("cv2")
    raw = os.environ.get(WORKER_ENV)
    if cv2 is None or not raw or not hasattr(cv2, "getNumThreads"):
        return None
    try:
        handoff = json.loads(raw)
        budget = CpuBudget(cpus=int(handoff["cpus"]), mask=int(handoff["mask"]), quota=handoff.get("quota"))
        lws, workers, apply_fix = int(handoff["lws"]), int(handoff["workers"]), bool(handoff["apply_fix"])
    except (ValueError, KeyError, TypeError):
        return None
    finding = check_cv2(int(cv2.getNumThreads()), workers, lws, budget)
    if finding is None:
        return None
    loud = worker_id == 0 and _local_rank_zero() and not handoff.get("logged")
    if log is not None and loud:
        log.warning(f"config_guards: {finding.message}")
    if apply_fix and hasattr(cv2, "setNumThreads"):
        cv2.setNumThreads(finding.suggested)
        if log is not None:
            (log.warning if loud else log.debug)(
                f"config_guards: set OpenCV threads {finding.value} -> {finding.suggested} in DataLoader workers")
    return finding


def _mark_logged() -> None:
    raw = os.environ.get(WORKER_ENV)
    if not raw:
        return
    try:
        handoff = json.loads(raw)
    except ValueError:
        return
    if isinstance(handoff, dict):
        handoff["logged"] = True
        os.environ[WORKER_ENV] = json.dumps(handoff)


def _put_env(name: str, value: str | None) -> None:
    """Set ``name`` back to ``value`` (None: remove it)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


# -- the feature ------------------------------------------------------------------------------------------
class ConfigGuards(FeatureImpl):
    """Every change goes through ``ctx.patcher`` (the patched functions, ``assign`` for the inductor
    config, ``set_item`` for thread variables, ``defer`` for the intra-op pool, the workers' handoff
    variable and the worker callback's switch), so the default ``deactivate`` undoes the feature. Not
    undone: ``torch.set_num_interop_threads`` (torch accepts one call per process)."""

    options = GuardsOptions

    def __init__(self, feature: Any) -> None:
        super().__init__(feature)
        self._budget: CpuBudget | None = None
        self._user_vars: dict[str, tuple[int | None, str]] | None = None
        self._logged: set[str] = set()
        self._config: dict[str, Any] = {}
        self._workers_started = False  # a worker set has already started: later ones stay quiet

    def detect(self, env: Environment) -> str | None:
        if env.process.role in (LAUNCHER, HELPER):
            return f"nothing to check in a {env.process.role} process"
        return None

    def configure(self, env: Environment, policy: Any) -> tuple[object, list[str]]:
        options, warnings = super().configure(env, policy)
        # Recorded at boot, before the user's script or a library changes the environment.
        self._user_vars = user_thread_vars(env.environ, env.process.local_world_size or 1)
        return options, warnings

    # -- helpers ----------------------------------------------------------------------------------------
    def _apply_fix(self, ctx: ActivationContext) -> bool:
        return bool(self._config.get("apply_fix"))  # the options, copied into the Summary config at activation

    def budget(self, ctx: ActivationContext) -> CpuBudget:
        if self._budget is None:
            self._budget = cpu_budget(ctx.env.hardware, ctx.env.hardware.root or ctx.env.settings.sysfs_root)
            for note in self._budget.notes:
                ctx.log.info(f"config_guards: {note}")
        return self._budget

    def _lws(self, ctx: ActivationContext) -> int:
        return max(1, ctx.env.process.local_world_size or 1)

    def _loud(self, ctx: ActivationContext) -> bool:
        return ctx.env.process.local_rank in (None, 0)

    def report(self, ctx: ActivationContext, finding: Finding) -> bool:
        """Record ``finding`` (Summary) and log it once per node; True if it was new in this process."""
        if finding.message in self._logged:
            return False
        self._logged.add(finding.message)
        self._config.setdefault("findings", []).append(finding.message)
        if self._loud(ctx):
            ctx.log.warning(f"config_guards: {finding.message}")
        return True

    def changed(self, ctx: ActivationContext, message: str) -> None:
        changes = self._config.setdefault("changes", [])
        if message not in changes:
            changes.append(message)
        (ctx.log.warning if self._loud(ctx) else ctx.log.info)(f"config_guards: {message}")

    # -- activation -------------------------------------------------------------------------------------
    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        if not self._config:
            options = ctx.config if isinstance(ctx.config, GuardsOptions) else GuardsOptions()
            self._config.update({"apply_fix": options.apply_fix, "cpu_budget": None, "findings": []})
        ctx.set_config(self._config)
        if self._user_vars is None:
            self._user_vars = user_thread_vars(ctx.env.environ, self._lws(ctx))
        if ctx.env.process.role == WORKER:
            self._register_worker_hook(ctx)  # spawned workers: the training process did the node checks
            return
        budget = self.budget(ctx)
        self._config["cpu_budget"] = budget.cpus
        ctx.detail("cpu_budget", {"cpus": budget.cpus, "mask": budget.mask, "quota": budget.quota,
                                  "quota_source": budget.quota_source})
        if target == INDUCTOR_TARGET:
            self._check_inductor(ctx, sys.modules[INDUCTOR_TARGET])
            return
        import torch

        recheck = self._check_threads(ctx, torch)
        self._patch_dataloader(ctx, torch, recheck)
        self._register_worker_hook(ctx)

    def _check_threads(self, ctx: ActivationContext, torch: Any) -> Callable[[str], None]:
        """The thread checks at torch's import; returns the intra-op pool's re-check (see _watch_intra_op)."""
        budget, lws, fix = self.budget(ctx), self._lws(ctx), self._apply_fix(ctx)
        assert self._user_vars is not None
        user = self._user_vars
        ctx.detail("user_thread_vars", {k: (v if v is not None else origin) for k, (v, origin) in user.items()})
        intra = int(torch.get_num_threads())
        omp = user["OMP_NUM_THREADS"][0]
        reported_omp = False
        for name in THREAD_VARS:
            value = user[name][0]
            if value is None:
                continue
            finding = check_threads(name, value, lws, budget, f"{name}={{}}")
            if finding is None:
                continue
            self.report(ctx, finding)
            reported_omp = reported_omp or name == "OMP_NUM_THREADS"
            if fix:
                ctx.patcher.set_item(os.environ, name, str(finding.suggested))  # for the processes this one starts
                self.changed(ctx, f"set {name} {value} -> {finding.suggested} for child processes")
        # torch's pool follows OMP_NUM_THREADS: one finding for both when they agree.
        from_omp = omp is not None and omp == intra
        recheck = self._watch_intra_op(ctx, torch, 'from OMP_NUM_THREADS' if from_omp else 'torch default',
                                       report=not (from_omp and reported_omp))
        interop = int(torch.get_num_interop_threads())
        finding = check_threads("torch inter-op threads", interop, lws, budget, "torch.set_num_interop_threads({})")
        if finding is not None:
            self.report(ctx, finding)
            if fix:
                try:
                    torch.set_num_interop_threads(finding.suggested)
                except RuntimeError as exc:  # only allowed before the inter-op pool starts
                    ctx.log.info(f"config_guards: cannot change inter-op threads now: {exc}")
                else:
                    self.changed(ctx, f"torch.set_num_interop_threads({finding.suggested}) (was {interop})")
                    self._tolerate_second_interop_call(ctx, torch)
        ctx.count()
        return recheck

    def _watch_intra_op(self, ctx: ActivationContext, torch: Any, origin: str, report: bool) -> Callable[[str], None]:
        """Check the intra-op pool now, and again whenever the job changes it: ``torch.set_num_threads``
        is observed through the patcher, and the returned ``recheck(where)`` (run when a DataLoader
        iterator is created) catches a pool set behind it. With APPLY_FIX the suggestion is set; undo
        puts back what the job asked for."""
        original = torch.set_num_threads
        budget, lws, fix = self.budget(ctx), self._lws(ctx), self._apply_fix(ctx)
        checked = [int(torch.get_num_threads())]  # the pool as last checked (after any fix)
        wanted = [checked[0]]  # what the job asked for
        fixed = [False]

        def check(value: int, where: str, log_it: bool = True) -> None:
            checked[0] = wanted[0] = value
            finding = check_threads(f"torch intra-op threads ({where})", value, lws, budget,
                                    "torch.set_num_threads({})")
            if finding is None:
                return
            if log_it:
                self.report(ctx, finding)
            if fix:
                original(finding.suggested)
                checked[0], fixed[0] = finding.suggested, True
                self.changed(ctx, f"torch.set_num_threads({finding.suggested}) (was {value})")

        def recheck(where: str) -> None:
            value = int(torch.get_num_threads())
            if value != checked[0]:  # unchanged since the last check (or our fix): nothing new to say
                check(value, where)

        check(checked[0], origin, report)
        if fix:
            ctx.patcher.defer(lambda: original(wanted[0]) if fixed[0] else None)

        def set_num_threads(n: int) -> None:
            original(n)  # the job's call first: its errors are torch's own
            try:
                wanted[0] = int(torch.get_num_threads())
                recheck("torch.set_num_threads")
            except Exception as exc:  # a guard must never break the job's call
                ctx.log.info(f"config_guards: intra-op check skipped: {type(exc).__name__}: {exc}")

        set_num_threads.__wrapped__ = original  # type: ignore[attr-defined]
        set_num_threads.__doc__ = getattr(original, "__doc__", None)
        ctx.patcher.patch(torch, "set_num_threads", set_num_threads)
        return recheck

    def _tolerate_second_interop_call(self, ctx: ActivationContext, torch: Any) -> None:
        """torch allows set_num_interop_threads once per process; after our fix, a user's own call
        would raise. Keep the fixed value and say so instead of breaking the user's script."""
        original = torch.set_num_interop_threads

        def set_num_interop_threads(n: int) -> None:
            try:
                original(n)
            except RuntimeError as exc:
                ctx.log.warning(f"config_guards: torch.set_num_interop_threads({n}) ignored: LOONGKIT_CONFIG_GUARDS_"
                                f"APPLY_FIX already set {torch.get_num_interop_threads()} ({exc})")

        set_num_interop_threads.__wrapped__ = original  # type: ignore[attr-defined]
        ctx.patcher.patch(torch, "set_num_interop_threads", set_num_interop_threads)

    def _check_inductor(self, ctx: ActivationContext, config: Any) -> None:
        value = getattr(config, "compile_threads", None)
        if not isinstance(value, int):
            raise NotApplicable(f"torch._inductor.config.compile_threads is {value!r}, not a number")
        budget, lws = self.budget(ctx), self._lws(ctx)
        finding = check_threads("inductor compile_threads", value, lws, budget,
                                "torch._inductor.config.compile_threads={}")
        ctx.count()
        if finding is None:
            return
        self.report(ctx, finding)
        if self._apply_fix(ctx):
            ctx.patcher.assign(config, "compile_threads", finding.suggested)
            self.changed(ctx, f"torch._inductor.config.compile_threads {value} -> {finding.suggested}")

    def _pin_threads(self, torch: Any, pin_memory: bool) -> int:
        if not pin_memory:
            return 0
        accelerator = getattr(torch, "accelerator", None)
        try:  # the same test as torch's loader iterator: no accelerator, no pin-memory thread
            available = accelerator.is_available() if accelerator is not None else torch.cuda.is_available()
        except Exception:
            available = False
        return 1 if available else 0

    def _patch_dataloader(self, ctx: ActivationContext, torch: Any,
                          recheck: Callable[[str], None] = lambda where: None) -> None:
        loader_cls = getattr(getattr(torch.utils, "data", None), "DataLoader", None)
        if loader_cls is None or any(owner is loader_cls for owner, _ in ctx.patcher.patched):
            return
        original = loader_cls.__init__
        try:
            signature = inspect.signature(original)
        except (TypeError, ValueError) as exc:
            raise NotApplicable(f"DataLoader.__init__ has no readable signature: {exc}") from exc
        if "num_workers" not in signature.parameters:
            raise NotApplicable("DataLoader.__init__ has no num_workers parameter")
        guards = self
        # The handoff to the workers (written per DataLoader, and when the first workers start): undo
        # puts back what was there before.
        ctx.patcher.defer(functools.partial(_put_env, WORKER_ENV, os.environ.get(WORKER_ENV)))

        def __init__(loader: Any, *args: Any, **kwargs: Any) -> None:
            try:
                args, kwargs = guards._on_dataloader(ctx, torch, signature, loader, args, kwargs)
            except Exception as exc:  # a guard must never stop the user's DataLoader
                ctx.log.info(f"config_guards: DataLoader check skipped: {type(exc).__name__}: {exc}")
            original(loader, *args, **kwargs)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        __init__.__qualname__ = original.__qualname__
        __init__.__doc__ = original.__doc__
        ctx.patcher.patch(loader_cls, "__init__", __init__)
        original_iter = loader_cls.__iter__

        def __iter__(loader: Any) -> Any:
            try:  # the pool in force now, as the job left it (set behind torch.set_num_threads, too)
                recheck("in force when a DataLoader iterated")
            except Exception as exc:  # a guard must never stop the user's DataLoader
                ctx.log.info(f"config_guards: intra-op check skipped: {type(exc).__name__}: {exc}")
            iterator = original_iter(loader)
            if not guards._workers_started and getattr(loader, "num_workers", 0) > 0:
                # The first set of workers has started (and logged): later epochs and loaders stay quiet.
                guards._workers_started = True
                _mark_logged()
            return iterator

        __iter__.__wrapped__ = original_iter  # type: ignore[attr-defined]
        __iter__.__qualname__ = original_iter.__qualname__
        ctx.patcher.patch(loader_cls, "__iter__", __iter__)

    def _on_dataloader(self, ctx: ActivationContext, torch: Any, signature: inspect.Signature, loader: Any,
                       args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        bound = signature.bind(loader, *args, **kwargs)
        num_workers = bound.arguments.get("num_workers", 0)
        if not isinstance(num_workers, int):
            return args, kwargs
        pin = self._pin_threads(torch, bool(bound.arguments.get("pin_memory", False)))
        budget, lws = self.budget(ctx), self._lws(ctx)
        ctx.count()
        finding = check_dataloader(num_workers, pin, lws, budget)
        workers = num_workers
        if finding is not None:
            self.report(ctx, finding)
            if self._apply_fix(ctx):
                workers = finding.suggested
                # These options are errors without workers: keep one worker rather than break the loader.
                needs_workers = bound.arguments.get("persistent_workers") or bound.arguments.get(
                    "prefetch_factor") is not None or bound.arguments.get("multiprocessing_context") is not None
                if workers == 0 and needs_workers:
                    workers = 1
                if workers != num_workers:
                    bound.arguments["num_workers"] = workers
                    self.changed(ctx, f"DataLoader num_workers {num_workers} -> {workers}")
        os.environ[WORKER_ENV] = json.dumps({
            "cpus": budget.cpus, "mask": budget.mask, "quota": budget.quota, "lws": lws, "workers": workers,
            "apply_fix": self._apply_fix(ctx), "logged": self._workers_started,
        })
        return tuple(bound.args[1:]), dict(bound.kwargs)

    def _register_worker_hook(self, ctx: ActivationContext) -> None:
        scratch = ctx.scratch  # once per activation: the default deactivate unregisters the callback
        if getattr(scratch, "worker_hook", False):
            return
        scratch.worker_hook = True
        log, count = ctx.log, ctx.count

        def callback(worker_id: int) -> None:
            if on_worker_start(worker_id, log) is not None:
                count()

        ctx.on_worker_start(callback)
