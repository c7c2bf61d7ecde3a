"""LOONGKIT_MALLOC (level 2, beyond the seed): allocator tuning in the training process itself.

``LOONGKIT_MALLOC_ALLOCATOR``:

* ``glibc`` (default): mallopt tuning (:data:`loongkit_data.allocator.GLIBC_TUNING`) at boot.
  It trades resident memory (bounded by the trim threshold) for fewer page faults.
* ``jemalloc`` / ``tcmalloc``: an allocator library can only replace malloc when it is loaded
  before the process starts. When it is already preloaded (``LD_PRELOAD``), glibc is left alone; on
  jemalloc, arena 0 gets the oversize threshold its options set (jemalloc 5.3.0 keeps 8 MiB there, so
  every large temporary of the main thread faulted in again: :func:`allocator.align_jemalloc_arena0`).
  Otherwise, if installed (Debian: libjemalloc2 / libtcmalloc-minimal4), ``LD_PRELOAD`` (and
  jemalloc's ``MALLOC_CONF``, as ``python -m torch.backends.xeon.run_cpu`` sets it) is exported for
  the child processes this one starts (spawned DataLoader workers, subprocesses), and this process
  gets the glibc tuning meanwhile; ``loongkit malloc-env`` prints the variables to start the whole
  job with it. Not installed: glibc tuning, with a warning.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl
from loongkit_data import allocator

if TYPE_CHECKING:
    from loongkit_core.settings import LoongkitSettings

# Just above glibc's largest dynamic mmap threshold (32 MiB): always mmapped by default, so the probe
# shows the storm. Not run at boot (a page-fault storm and a 33 MiB temporary in every process: start-up
# in docs/benchmarks.md): the benchmarks and tests run it.
PROBE_BYTES = 33 << 20
ALLOCATOR_ENV = "LOONGKIT_MALLOC_ALLOCATOR"
DEFAULT_ALLOCATOR = "glibc"


def _lower(value: object) -> object:
    return value.strip().lower() if isinstance(value, str) else value


def _options_model() -> type[LoongkitSettings]:
    """``MallocOptions``, built (pydantic-settings imported) at its first use: only a process with
    LOONGKIT_MALLOC_ALLOCATOR set validates it."""
    found = globals().get("MallocOptions")
    if found is not None:
        return found  # type: ignore[no-any-return]
    from typing import Annotated, Literal

    from pydantic import BeforeValidator, Field
    from pydantic_settings import SettingsConfigDict

    from loongkit_core.settings import LoongkitSettings

    class MallocOptions(LoongkitSettings):
        model_config = SettingsConfigDict(env_prefix="LOONGKIT_MALLOC_", extra="ignore", case_sensitive=False)

        allocator: Annotated[Literal["glibc", "jemalloc", "tcmalloc"], BeforeValidator(_lower)] = Field(
            DEFAULT_ALLOCATOR, description="glibc (mallopt tuning), jemalloc or tcmalloc (preloaded).")

    MallocOptions.__qualname__ = "MallocOptions"
    globals()["MallocOptions"] = MallocOptions
    return MallocOptions


def __getattr__(name: str) -> Any:  # ``from loongkit_data.malloc import MallocOptions`` builds it
    if name == "MallocOptions":
        return _options_model()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_options(value: object) -> bool:
    model = globals().get("MallocOptions")  # never built: nothing can be one
    return model is not None and isinstance(value, model)


def probe_faults(size: int = PROBE_BYTES, cycles: int = 2) -> int:
    """Minor faults of the last of ``cycles`` malloc/touch/free cycles of ``size`` bytes (0 = memory kept).

    Untuned, every cycle of a block above the mmap threshold faults afresh, so one cycle is enough
    there; tuned, the first cycle grows the heap and the second shows the reuse."""
    import ctypes
    import resource

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    faults = 0
    for _ in range(cycles):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        if not block:
            return -1
        ctypes.memset(block, 1, size)
        libc.free(block)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return faults


class Malloc(FeatureImpl):
    # Validated only when LOONGKIT_MALLOC_ALLOCATOR is set; else None: the default allocator, glibc.
    lazy_options = "loongkit_data.malloc:MallocOptions"  # built at first access (module __getattr__)

    def __init__(self, feature: Any) -> None:
        super().__init__(feature)
        self.tuning: dict[str, object] | None = None  # what apply_glibc did in this process
        self.faults_at_boot = 0
        self._options: Any = None

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        # ctx.config is the parsed options until set_config shows what was done instead: kept for an
        # activation after an undo.
        if _is_options(ctx.config):
            self._options = ctx.config
        wanted = self._options.allocator if self._options is not None else DEFAULT_ALLOCATOR
        if ctx.env.process.role != "main":
            ctx.waiting("not a training process")
            return
        preloaded = allocator.preloaded_allocator(ctx.env.environ)
        if preloaded is not None:
            config: dict[str, object] = {"allocator": preloaded, "preloaded": True, "requested": wanted}
            changed = allocator.align_jemalloc_arena0() if preloaded == "jemalloc" else None
            if changed is not None:
                before, after = (allocator.describe_oversize(v) for v in changed)
                config["arena0_oversize_threshold"] = f"{before}->{after}"
                # Undone: arena 0 gets its threshold back (forked children keep what they inherited).
                ctx.patcher.defer(functools.partial(allocator.set_jemalloc_arena0_threshold, changed[0]))
                ctx.log.info("jemalloc arena 0 given the oversize_threshold its options set "
                             "(jemalloc 5.3.0 keeps 8MiB there)", before=before, after=after)
            ctx.set_config(config)
            if preloaded != wanted:
                ctx.log.warning("another allocator is preloaded; kept", preloaded=preloaded, requested=wanted)
            ctx.log.info("allocator library preloaded in this process", allocator=preloaded)
            ctx.count()
            return
        config = {"allocator": "glibc"}
        if wanted != "glibc":
            path = allocator.find_library(wanted)
            if path is None:
                package = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}[wanted]
                ctx.log.warning(f"{wanted} is not installed (Debian package {package}); using glibc tuning")
                config["requested"] = f"{wanted} (not installed)"
            else:
                changes = allocator.preload_environ(path, wanted, os.environ)
                for key, value in changes.items():  # inherited by every child this process starts
                    ctx.patcher.set_item(os.environ, key, value)
                config["children"] = {"allocator": wanted, **changes}
                ctx.waiting(f"{wanted} takes effect in child processes; to preload it here, start "
                            "with LD_PRELOAD (see `loongkit malloc-env`)")
                ctx.log.info("allocator preloaded for child processes; this process keeps glibc (tuned)",
                             allocator=wanted, **changes)
        reason = allocator.glibc_reason()
        if reason is not None:
            raise NotApplicable(reason)
        self.faults_at_boot = allocator.minor_faults()
        # Not undone by deactivate: glibc has no way to read the values in force, and a fixed
        # mmap threshold turns its dynamic one off for good (nothing to restore it with). The
        # environment changes above are undone (ctx.patcher.set_item).
        result = allocator.apply_glibc()
        self.tuning = result.to_config()
        config.update(self.tuning)
        ctx.set_config(config)
        ctx.log.info("glibc malloc tuned", **self.tuning)
        if result.refused:
            ctx.log.warning("glibc refused some mallopt values", refused=result.refused)
        if result.applied:
            ctx.count()

    def summary_lines(self) -> list[str]:
        if self.tuning is None or "skipped" in self.tuning:
            return []
        since = allocator.minor_faults() - self.faults_at_boot
        tuned = ", ".join(f"{k} {v}" for k, v in self.tuning.items() if k != "refused")
        return [f"malloc: glibc tuned in this process ({tuned}); {since:,} minor faults since boot "
                f"(faults saved per repeated {PROBE_BYTES >> 20} MiB temporary: probe_faults(), "
                "benchmarks/allocator.py)"]
