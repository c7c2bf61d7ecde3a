"""LOONGKIT_MALLOC (level 2, beyond the seed): allocator tuning in the training process itself.

``LOONGKIT_MALLOC_ALLOCATOR``:

* ``glibc`` (default): mallopt tuning (:data:`loongkit_data.allocator.GLIBC_TUNING`) at boot.
  It trades resident memory (bounded by the trim threshold) for fewer page faults.
* ``jemalloc`` / ``tcmalloc``: an allocator library can only replace malloc when it is loaded
  before the process starts. When it is already preloaded (``LD_PRELOAD``), nothing else is done.
  Otherwise, if installed (Debian: libjemalloc2 / libtcmalloc-minimal4), ``LD_PRELOAD`` (and
  jemalloc's ``MALLOC_CONF``, as ``python -m torch.backends.xeon.run_cpu`` sets it) is exported for
  the child processes this one starts (spawned DataLoader workers, subprocesses), and this process
  gets the glibc tuning meanwhile; ``loongkit malloc-env`` prints the variables to start the whole
  job with it. Not installed: glibc tuning, with a warning.
"""

from __future__ import annotations

import ctypes
import os
import resource
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field
from pydantic_settings import SettingsConfigDict

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl
from loongkit_core.settings import LoongkitSettings
from loongkit_data import allocator

# Just above glibc's largest dynamic mmap threshold (32 MiB): always mmapped by default, so the probe
# shows the storm; kept small because its page faults are the feature's own start-up cost.
PROBE_BYTES = 33 << 20


def _lower(value: object) -> object:
    return value.strip().lower() if isinstance(value, str) else value


class MallocOptions(LoongkitSettings):
    model_config = SettingsConfigDict(env_prefix="LOONGKIT_MALLOC_", extra="ignore", case_sensitive=False)

    allocator: Annotated[Literal["glibc", "jemalloc", "tcmalloc"], BeforeValidator(_lower)] = Field(
        "glibc", description="glibc (mallopt tuning), jemalloc or tcmalloc (preloaded).")


def probe_faults(size: int = PROBE_BYTES, cycles: int = 2) -> int:
    """Minor faults of the last of ``cycles`` malloc/touch/free cycles of ``size`` bytes (0 = memory kept).

    Untuned, every cycle of a block above the mmap threshold faults afresh, so one cycle is enough
    there; tuned, the first cycle grows the heap and the second shows the reuse."""
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


def _trim() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing was kept anyway
        pass


class Malloc(FeatureImpl):
    options = MallocOptions

    def __init__(self, feature: Any) -> None:
        super().__init__(feature)
        self.probe: tuple[int, int] | None = None
        self.faults_at_boot = 0
        self._options: MallocOptions | None = None

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        # ctx.config is the parsed options until set_config shows what was done instead: kept for an
        # activation after an undo.
        if isinstance(ctx.config, MallocOptions):
            self._options = ctx.config
        options = self._options or MallocOptions()
        wanted = options.allocator
        if ctx.env.process.role != "main":
            ctx.waiting("not a training process")
            return
        preloaded = allocator.preloaded_allocator(ctx.env.environ)
        if preloaded is not None:
            ctx.set_config({"allocator": preloaded, "preloaded": True, "requested": wanted})
            if preloaded != wanted:
                ctx.log.warning("another allocator is preloaded; kept", preloaded=preloaded, requested=wanted)
            ctx.log.info("allocator library preloaded in this process", allocator=preloaded)
            ctx.count()
            return
        config: dict[str, object] = {"allocator": "glibc"}
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
        default_faults = probe_faults(cycles=1)
        # Not undone by deactivate: glibc has no way to read the values in force, and a fixed
        # mmap threshold turns its dynamic one off for good (nothing to restore it with). The
        # environment changes above are undone (ctx.patcher.set_item).
        result = allocator.apply_glibc()
        tuned_faults = probe_faults()
        _trim()  # give the probe's block back: the tuning keeps later temporaries, not this one
        self.probe = (default_faults, tuned_faults)
        config.update(result.to_config())
        ctx.set_config(config)
        ctx.detail("probe_faults_per_33MiB_temporary", {"default": default_faults, "tuned": tuned_faults})
        ctx.log.info("glibc malloc tuned", **result.to_config(), probe_default=default_faults, probe_tuned=tuned_faults)
        if result.refused:
            ctx.log.warning("glibc refused some mallopt values", refused=result.refused)
        if result.applied:
            ctx.count()

    def summary_lines(self) -> list[str]:
        if self.probe is None:
            return []
        default, tuned = self.probe
        since = allocator.minor_faults() - self.faults_at_boot
        return [f"malloc: a repeated {PROBE_BYTES >> 20} MiB temporary costs {default:,} minor faults with glibc "
                f"defaults, "
                f"{tuned:,} tuned (measured at boot); this process had {since:,} minor faults since boot"]
