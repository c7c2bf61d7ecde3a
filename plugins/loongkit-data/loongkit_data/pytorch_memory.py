"""LOONGKIT_PYTORCH: DataLoader memory, transparently.

* Forked workers: large list attributes of the dataset holding dicts/tuples (mmdet 2.x
  ``data_infos``, plain torch Dataset subclasses) become a :class:`SerializedList` (one buffer
  plus offsets) when a multi-process iterator is created with the ``fork`` start method, and
  ``gc.freeze()`` runs just before the workers fork so their collector leaves the parent's objects
  (and pages) alone. mmengine's BaseDataset already serializes (``serialize_data``): skipped.
  A list that user code mutates goes back to a real list (logged) and is never converted again.
* Every worker (fork, spawn, forkserver) gets the glibc malloc tuning of
  :data:`loongkit_data.allocator.WORKER_TUNING` at start (skipped with the reason off glibc): a batch's
  large temporaries stay in the heap for the next batch instead of page-faulting in again. What it
  keeps is bounded by :class:`loongkit_data.allocator.HeapBound`, checked after each batch: about what
  one of its batches needs, measured (a heap that grows instead is trimmed). Workers report their
  bound to the main process's Summary through the job's activity directory. A worker on a preloaded
  jemalloc/tcmalloc keeps that allocator (no mallopt, no bound); on jemalloc its arena 0 gets the
  oversize threshold jemalloc's options set (:func:`loongkit_data.allocator.align_jemalloc_arena0`).
* RLIMIT_NOFILE's soft limit is raised to the hard limit: shared-memory tensors travel as fds.
"""

from __future__ import annotations

import functools
import gc
import inspect
import os
import time
from typing import TYPE_CHECKING, Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl
from loongkit_data import allocator

REPORT_PREFIX = "pytorch-heap-"  # a worker's HeapBound report in the job's activity directory
MIN_RECORDS = 1000  # below this a list costs a worker little; not worth a pickle pass
SAMPLE = 32  # records checked for being dicts/tuples (spread over the list)
MAX_DEPTH = 4  # wrapper datasets followed (Subset, ConcatDataset, RepeatDataset...)

# The configuration's note when workers run on a preloaded jemalloc (allocator.align_jemalloc_arena0).
JEMALLOC_WORKERS = "workers on jemalloc: arena 0 gets the oversize_threshold its options set (5.3.0 keeps 8MiB there)"
# Workers that end this share of their batches in a trim lose most of the glibc tuning's gain: the Summary
# then names jemalloc, with what benchmarks/allocator.py measured (docs/benchmarks.md, allocator section).
TRIM_ADVICE_SHARE = 0.1
JEMALLOC_EVIDENCE = ("jemalloc reuses them without growing (benchmarks/allocator.py, mmcv Voxelization in a worker, "
                     "quiet machine: glibc tuned 1.03x the default's speed, 82k faults per call; jemalloc 2.42x, "
                     "1 fault per call, 0.99x the default's peak RSS)")
# What the last worker-start callback applied in this process (tests and the worker's own log).
worker_state: dict[str, Any] = {}


def start_method(loader: Any) -> str:
    context = loader.multiprocessing_context
    if context is None:
        import torch.multiprocessing as tmp

        return tmp.get_start_method(allow_none=False)
    return context.get_start_method()


def mmengine_serialized(obj: Any) -> bool:
    """An mmengine BaseDataset that packs its own data_list (serialize_data=True)."""
    return bool(getattr(obj, "serialize_data", False)) and hasattr(obj, "data_address")


def record_list(value: Any) -> bool:
    """A plain list of at least MIN_RECORDS dicts/tuples (checked on a spread sample)."""
    if type(value) is not list or len(value) < MIN_RECORDS:
        return False
    step = max(1, len(value) // SAMPLE)
    return all(isinstance(value[i], (dict, tuple)) for i in [*range(0, len(value), step), len(value) - 1])


def child_datasets(obj: Any) -> list[Any]:
    found = []
    inner = getattr(obj, "__dict__", {})
    if "dataset" in inner and hasattr(inner["dataset"], "__getitem__"):
        found.append(inner["dataset"])
    if "datasets" in inner and isinstance(inner["datasets"], (list, tuple)):
        found.extend(d for d in inner["datasets"] if hasattr(d, "__getitem__"))
    return found


if TYPE_CHECKING:
    from loongkit_data.serialize import SerializedList


class PytorchMemory(FeatureImpl):
    def __init__(self, feature: Any) -> None:
        super().__init__(feature)
        self.ctx: ActivationContext | None = None
        self.mutated: set[tuple[int, str]] = set()  # (id(dataset), attribute): never convert again
        self.serialized: dict[str, dict[str, int]] = {}
        self.skipped: dict[str, str] = {}
        self.iterators = 0
        self.config: dict[str, Any] = {}

    # -- activation ----------------------------------------------------------------------------
    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        self.ctx = ctx
        reason = allocator.glibc_reason()
        self.config = {"worker_malloc": {**{k: allocator._human(v) if k != "arena_max" else v
                                            for k, v in allocator.WORKER_TUNING.items()},
                                         "bound": f"each worker holds <= its size after a clean batch "
                                                  f"+{allocator.BOUND_SLACK:.0%} of that batch "
                                                  f"(>= {allocator.BOUND_FLOOR // allocator.MiB}MiB), else trimmed"}
                       if reason is None else f"skipped: {reason}",
                       "serialize": f"fork workers, lists of >= {MIN_RECORDS} dicts/tuples"}
        if reason is not None:
            if allocator.preloaded_allocator() == "jemalloc":
                self.config["worker_malloc"] += f"; {JEMALLOC_WORKERS}"
            ctx.log.info("worker malloc tuning skipped", reason=reason)
        ctx.on_worker_start(self._worker_start)  # unregistered by the default deactivate
        if ctx.env.process.role != "main":
            ctx.set_config(self.config)
            return  # a spawned worker: the callback above is all it needs
        try:
            changed = allocator.raise_nofile()
        except (OSError, ValueError) as exc:
            changed = None
            ctx.log.warning("cannot raise RLIMIT_NOFILE", error=str(exc))
            self.config["nofile"] = f"unchanged ({exc})"
        else:
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if changed is not None:
                self.config["nofile"] = f"{changed[0]}->{changed[1]}"
                ctx.log.info("raised RLIMIT_NOFILE soft limit", before=changed[0], after=changed[1], hard=changed[2])
                # Undo lowers the soft limit back (always allowed; fds already open stay open).
                ctx.patcher.defer(functools.partial(resource.setrlimit, resource.RLIMIT_NOFILE,
                                                    (changed[0], changed[2])))
                ctx.count()
            else:
                self.config["nofile"] = f"{soft} (already the hard limit)"
                ctx.log.info("RLIMIT_NOFILE soft limit already at the hard limit", soft=soft, hard=hard)
        self._patch_iterator(ctx)
        ctx.set_config(self.config)

    def _patch_iterator(self, ctx: ActivationContext) -> None:
        from torch.utils.data import dataloader

        cls = getattr(dataloader, "_MultiProcessingDataLoaderIter", None)
        if cls is None:
            raise NotApplicable("torch.utils.data.dataloader has no _MultiProcessingDataLoaderIter")
        original = cls.__init__
        if list(inspect.signature(original).parameters) != ["self", "loader"]:
            raise NotApplicable(f"_MultiProcessingDataLoaderIter.__init__{inspect.signature(original)} "
                                "is not (self, loader)")
        feature = self

        def __init__(it: Any, loader: Any) -> None:
            frozen = False
            try:
                frozen = feature.before_workers(loader)
            except Exception as exc:  # never break the user's DataLoader
                ctx.log.warning("DataLoader memory preparation failed; workers start unchanged", error=repr(exc))
            try:
                original(it, loader)
            finally:
                if frozen:
                    # The workers have forked with the parent's objects frozen (their collector
                    # will not touch them); the parent collects them again as before.
                    gc.unfreeze()

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        ctx.patcher.patch(cls, "__init__", __init__)

    # -- before the workers start ----------------------------------------------------------------
    def before_workers(self, loader: Any) -> bool:
        """Prepare the dataset for the workers about to start; True when gc was frozen."""
        ctx = self.ctx
        assert ctx is not None
        self.iterators += 1
        if allocator.glibc_reason() is None:
            ctx.count()  # these workers get the malloc tuning
        method = start_method(loader)
        if method != "fork":
            self._skip("dataset", f"start method {method}: workers get a pickled copy, no copy-on-read")
            return False
        live = self.convert(loader.dataset)
        if live:
            gc.freeze()
            ctx.count()
            return True
        return False

    def convert(self, dataset: Any) -> int:
        """Serialize the record lists of ``dataset`` and its wrapped datasets; how many are serialized."""
        live = 0
        seen: set[int] = set()
        stack = [(dataset, 0, type(dataset).__name__)]
        while stack:
            obj, depth, path = stack.pop()
            if id(obj) in seen or depth > MAX_DEPTH:
                continue
            seen.add(id(obj))
            if mmengine_serialized(obj):
                self._skip(path, "mmengine BaseDataset serializes its data_list itself (serialize_data=True)")
            else:
                live += self._convert_attributes(obj, path)
            for i, child in enumerate(child_datasets(obj)):
                stack.append((child, depth + 1, f"{path}.{type(child).__name__}[{i}]"))
        return live

    def _convert_attributes(self, obj: Any, path: str) -> int:
        from loongkit_data.serialize import SerializedList  # numpy: only once a DataLoader starts workers

        live = 0
        attributes = getattr(obj, "__dict__", None)
        if not isinstance(attributes, dict):
            return 0
        for name, value in list(attributes.items()):
            where = f"{path}.{name}"
            if isinstance(value, SerializedList) and not value.materialised:
                live += 1
                continue
            if not record_list(value):
                continue
            if (id(obj), name) in self.mutated:
                self._skip(where, "mutated by user code")
                continue
            start = time.perf_counter()
            try:
                proxy = SerializedList(value, owner=obj, attr=name, on_mutate=self._mutation_callback(obj, name, where))
            except Exception as exc:  # unpicklable records: keep the list
                self._skip(where, f"records not picklable ({type(exc).__name__}: {exc})")
                continue
            try:
                # Not through ctx.patcher: undo would need the original list kept alive in the parent,
                # which is what serializing frees; the proxy behaves as the list did (and turns back
                # into a real one when user code mutates it).
                setattr(obj, name, proxy)
            except Exception as exc:
                self._skip(where, f"cannot set the attribute ({type(exc).__name__})")
                continue
            live += 1
            self.serialized[where] = {"records": len(proxy), "bytes": proxy.nbytes}
            assert self.ctx is not None
            self.ctx.detail("serialized", dict(self.serialized))
            self.ctx.log.info("serialized a dataset list for forked workers", attribute=where, records=len(proxy),
                              bytes=proxy.nbytes, seconds=round(time.perf_counter() - start, 3))
        return live

    def _mutation_callback(self, obj: Any, name: str, where: str) -> Any:
        def mutated(proxy: SerializedList, operation: str) -> None:
            self.mutated.add((id(obj), name))
            self.serialized.pop(where, None)
            self._skip(where, f"mutated by user code ({operation}); turned back into a list")
            if self.ctx is not None:
                self.ctx.detail("serialized", dict(self.serialized))
                self.ctx.log.warning("dataset list mutated: turned back into a list, not serialized again",
                                     attribute=where, operation=operation)

        return mutated

    def _skip(self, where: str, reason: str) -> None:
        if self.skipped.get(where) != reason:
            self.skipped[where] = reason
            if self.ctx is not None:
                self.ctx.detail("not_serialized", dict(self.skipped))
                self.ctx.log.info("dataset list not serialized", attribute=where, reason=reason)

    # -- in each worker ----------------------------------------------------------------------------
    def _worker_start(self, worker_id: int) -> None:
        result = allocator.apply_glibc(allocator.WORKER_TUNING)
        worker_state.clear()
        worker_state.update(worker_id=worker_id, malloc=result.to_config())
        if self.ctx is not None:
            self.ctx.count()
            if result.skipped:
                self.ctx.log.info("worker malloc tuning skipped", worker=worker_id, reason=result.skipped)
            else:
                self.ctx.log.debug("worker malloc tuned", worker=worker_id, **result.to_config())
        if result.skipped:
            self._worker_jemalloc(worker_id)
        else:
            try:
                self._bound_batches(worker_id)
            except Exception as exc:  # the tuning stays; only its bound is missing (logged)
                if self.ctx is not None:
                    self.ctx.log.warning("worker heap bound not installed", worker=worker_id, error=repr(exc))

    def _worker_jemalloc(self, worker_id: int) -> None:
        """In a worker on jemalloc: its arena 0 gets the oversize threshold jemalloc's options set
        (:func:`~loongkit_data.allocator.align_jemalloc_arena0`); no glibc tuning, no heap bound (jemalloc
        returns freed memory by its own decay)."""
        found = allocator.jemalloc_arena0_threshold()
        if found is None:
            return
        changed = allocator.align_jemalloc_arena0()
        after = allocator.describe_oversize(found[1])
        worker_state["jemalloc"] = (f"arena 0 oversize_threshold {allocator.describe_oversize(found[0])} -> {after}"
                                    if changed else f"arena 0 oversize_threshold {after} (already)")
        if self.ctx is not None:
            self.ctx.log.debug("worker on jemalloc", worker=worker_id, detail=worker_state["jemalloc"])

    def _bound_batches(self, worker_id: int) -> None:
        """In this worker: check :class:`~loongkit_data.allocator.HeapBound` after each batch (each fetch
        of the worker loop), and report it to the main process when it changes."""
        from torch.utils.data._utils import fetch

        from loongkit_core import activity

        bound = allocator.HeapBound()
        if not bound.available or self.ctx is None:  # the patch needs the feature's undo (set at activation)
            return
        worker_state["heap_bound"] = bound
        job = activity.job_directory()
        path = os.path.join(job[0], f"{REPORT_PREFIX}{job[1]}-{os.getpid()}.json") if job is not None else None
        reported: list[tuple[int, int]] = []

        def report(force: bool = False) -> None:
            state = (bound.working_set, bound.trims)
            if path is not None and (force or not reported or reported[-1] != state):
                reported[:] = [state]
                try:
                    activity.write_report(path, {"worker_id": worker_id, **bound.to_json()})
                except OSError:
                    pass

        def after() -> None:
            bound.after_batch()
            report()

        # The batch count only needs to be right at the end: the loop's return writes the last state.
        self.ctx.on_worker_exit(lambda _worker_id: report(force=True))

        for cls in (fetch._MapDatasetFetcher, fetch._IterableDatasetFetcher):
            original = cls.fetch

            def bounded(fetcher: Any, possibly_batched_index: Any, _original: Any = original) -> Any:
                try:
                    return _original(fetcher, possibly_batched_index)
                finally:
                    after()

            bounded.__wrapped__ = original  # type: ignore[attr-defined]
            self.ctx.patcher.patch(cls, "fetch", bounded)

    def worker_bounds(self) -> list[dict[str, int]]:
        """The HeapBound reports of this main process's DataLoader workers (their last state)."""
        from loongkit_core import activity

        job = activity.job_directory()
        if job is None or job[1] != os.getpid():
            return []
        prefix = f"{REPORT_PREFIX}{job[1]}-"
        try:
            names = sorted(n for n in os.listdir(job[0]) if n.startswith(prefix) and n.endswith(".json"))
        except OSError:
            return []
        found = []
        for name in names:
            data = activity.read_report(os.path.join(job[0], name))
            keys = ("held", "working_set", "trims", "batches")
            if data is not None and all(isinstance(data.get(k), int) for k in keys):
                found.append({k: int(data[k]) for k in keys})
        return found

    def summary_lines(self) -> list[str]:
        import resource

        lines = []
        bounds = self.worker_bounds()
        if bounds:
            def span(key: str) -> str:
                values = sorted(b[key] / 2**20 for b in bounds)
                return f"{values[0]:,.0f}" + (f"-{values[-1]:,.0f}" if round(values[-1]) != round(values[0]) else "")

            trims, batches = sum(b["trims"] for b in bounds), sum(b["batches"] for b in bounds)
            lines.append(f"pytorch: worker memory bound in force: {len(bounds)} worker(s) each held at most its size "
                         f"after a clean batch ({span('held')} MiB, of which one batch {span('working_set')} MiB) "
                         f"+{allocator.BOUND_SLACK:.0%}; trimmed {trims:,} time(s) in {batches:,} batches")
            if trims >= 2 and trims >= TRIM_ADVICE_SHARE * batches:
                missing = "" if allocator.find_library("jemalloc") else " (install it first: Debian libjemalloc2)"
                lines.append(f"pytorch: workers trimmed after {trims:,} of {batches:,} batches: each trim faults the "
                             f"next batch's temporaries in again. {JEMALLOC_EVIDENCE}: start the job with "
                             f"LOONGKIT_MALLOC=1 LOONGKIT_MALLOC_ALLOCATOR=jemalloc under loongkit-run{missing}")
        if self.serialized:
            total = sum(v["records"] for v in self.serialized.values())
            size = sum(v["bytes"] for v in self.serialized.values()) / 2**20
            lines.append(f"pytorch: serialized {total:,} dataset records ({size:.1f} MiB buffer) for forked workers")
        if self.iterators:
            faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
            lines.append(f"pytorch: {self.iterators} multi-worker DataLoader iterator(s); minor page faults of "
                         f"reaped child processes (getrusage RUSAGE_CHILDREN): {faults:,}. Faults saved by the "
                         "malloc tuning need a run without it: benchmarks/allocator.py")
        return lines
