"""glibc malloc tuning through ctypes, and allocator-library preloading; no torch import.

Why: with glibc's defaults a large temporary (an image, a loss tensor) is served by mmap or from
the top of the heap, and freeing it hands the pages back to the kernel (munmap, or a trim once
the free top exceeds the trim threshold). The next call page-faults every page in again. Raising
the mmap threshold (fixed, which also stops glibc's dynamic threshold), the trim threshold and
the top pad keeps those pages in the process; an arena cap bounds how many heaps threads spread
that retained memory over. Values: see ``GLIBC_TUNING`` and docs/benchmarks.md.

What is kept is bounded: :class:`HeapBound` lets a DataLoader worker hold about what one batch needs,
as measured on its own batches (a heap that grows instead is trimmed), so a tuned worker's peak RSS
stays near an untuned one's.
"""

from __future__ import annotations

import ctypes
import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loongkit_core.resident import resident_bytes

# <malloc.h> parameter numbers (identical in every glibc since 2.x).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
PARAMS = {"mmap_threshold": M_MMAP_THRESHOLD, "trim_threshold": M_TRIM_THRESHOLD,
          "top_pad": M_TOP_PAD, "arena_max": M_ARENA_MAX}

MiB = 1 << 20
# Chosen from a sweep of the thresholds on the OpenMMLab calls that fault (docs/benchmarks.md, "Allocator
# tuning in DataLoader workers": the sweep's table and the runs behind each value):
# * mmap_threshold 256 MiB: the temporaries of those calls (a loss tensor, Voxelization's index table)
#   come from the heap; a fixed value also stops glibc's dynamic threshold. Larger bought nothing.
# * trim_threshold 512 MiB: the free heap top kept is bounded by it; at 256 MiB Voxelization's table was
#   still released on every call. The cost is peak RSS, which HeapBound (below) bounds per worker.
# * top_pad 0: padding each heap extension fragmented the heap of a call with large temporaries, which
#   then grew on each of its first calls; without padding it is reused from the second call.
# * arena_max 4: DataLoader workers run Python in one thread plus a few library threads; more arenas only
#   multiply retained memory, and a single arena made Voxelization slower.
GLIBC_TUNING: dict[str, int] = {
    "mmap_threshold": 256 * MiB,
    "trim_threshold": 512 * MiB,
    "top_pad": 0,
    "arena_max": 4,
}
# LOONGKIT_PYTORCH's workers (level 1: a worker may not hold memory it did not hold untuned): blocks
# above 64 MiB stay mmap'ed, as with glibc's defaults. At 256 MiB, tables that posix_memalign cannot
# reuse (HeapBound) stayed in the heap and raised a worker's peak RSS well above the untuned one
# (docs/benchmarks.md, "The worker threshold"); jemalloc (LOONGKIT_MALLOC_ALLOCATOR) serves them without it.
WORKER_TUNING: dict[str, int] = {**GLIBC_TUNING, "mmap_threshold": 64 * MiB}
# HeapBound trims only when a worker holds more than after a clean batch by a quarter of that batch's
# working set, and never for less than this: small drifts (a few MiB of Python objects, a cache filling)
# are not heap growth worth a trim and the faults after it.
BOUND_FLOOR = 64 * MiB
BOUND_SLACK = 0.25

# Debian/Ubuntu names first (libjemalloc2, libtcmalloc-minimal4), then what run_cpu looks for.
LIBRARY_NAMES = {
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"),
}
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib/loongarch64-linux-gnu",
                "/usr/local/lib", "/usr/local/lib64", "/usr/lib", "/usr/lib64", "/lib/x86_64-linux-gnu")
# What torch.backends.xeon.run_cpu sets for a preloaded jemalloc.
JEMALLOC_CONF = "oversize_threshold:1,background_thread:true,metadata_thp:auto"


def libc_name() -> tuple[str, str]:
    """("glibc", "2.36") / ("musl", "") / ("", "") from the interpreter's own libc, without spawning."""
    try:  # what platform.libc_ver() finds by scanning the interpreter binary, from glibc itself
        name, _, version = os.confstr("CS_GNU_LIBC_VERSION").partition(" ")
    except (AttributeError, ValueError, OSError):
        name, version = "", ""
    if name:
        return name, version
    try:  # musl's loader shows up in the process's maps
        with open("/proc/self/maps") as fh:
            if "musl" in fh.read():
                return "musl", ""
    except OSError:
        pass
    return "", ""


def glibc_reason() -> str | None:
    """None when this process runs on glibc with mallopt; else why tuning cannot apply."""
    name, _ = libc_name()
    if name != "glibc":
        return f"libc is {name or 'unknown'}, not glibc: mallopt tuning does not apply"
    if _mallopt() is None:
        return "glibc without a mallopt symbol"
    other = preloaded_allocator()
    if other is not None:
        return f"{other} is preloaded: glibc malloc is not in use"
    return None


def _mallopt() -> object | None:
    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


@dataclass
class TuningResult:
    applied: dict[str, int]
    refused: dict[str, int]
    skipped: str | None = None  # why nothing was applied

    def to_config(self) -> dict[str, object]:
        if self.skipped:
            return {"skipped": self.skipped}
        out: dict[str, object] = {k: _human(v) if k != "arena_max" else v for k, v in self.applied.items()}
        if self.refused:
            out["refused"] = sorted(self.refused)
        return out


def apply_glibc(values: Mapping[str, int] | None = None) -> TuningResult:
    """mallopt each value in this process; a parameter glibc refuses is reported, never raised."""
    values = GLIBC_TUNING if values is None else values
    reason = glibc_reason()
    if reason is not None:
        return TuningResult({}, {}, reason)
    fn = _mallopt()
    applied: dict[str, int] = {}
    refused: dict[str, int] = {}
    for name, value in values.items():
        ok = fn(PARAMS[name], int(value))  # type: ignore[operator]
        (applied if ok == 1 else refused)[name] = int(value)
    return TuningResult(applied, refused)


def preloaded_allocator(environ: Mapping[str, str] | None = None) -> str | None:
    """jemalloc / tcmalloc when one is loaded in this process (LD_PRELOAD'ed), else None."""
    try:
        with open("/proc/self/maps") as fh:
            maps = fh.read()
    except OSError:
        maps = (environ or os.environ).get("LD_PRELOAD", "")
    for kind in ("jemalloc", "tcmalloc"):
        if f"lib{kind}" in maps:
            return kind
    return None


def _mallctl() -> Any | None:
    """jemalloc's ``mallctl`` when jemalloc is this process's malloc (in the global symbol scope), else None."""
    if preloaded_allocator() != "jemalloc":
        return None
    try:
        fn = ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):  # a private (RTLD_LOCAL or prefixed) copy is not the process's malloc
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def _ctl_read(fn: Any, name: str, ctype: Any = ctypes.c_size_t) -> int | None:
    value = ctype()
    size = ctypes.c_size_t(ctypes.sizeof(value))
    if fn(name.encode(), ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
        return None
    return int(value.value)


def _oversize_target(fn: Any) -> int | None:
    """The oversize threshold jemalloc's options ask for: ``opt.oversize_threshold``, or, where that is
    disabled (0: a value outside the large size classes, such as run_cpu's 1), what jemalloc itself uses
    then (the largest large size class plus a page: no extent is oversize)."""
    opt = _ctl_read(fn, "opt.oversize_threshold")
    if opt is None or opt > 0:
        return opt
    count = _ctl_read(fn, "arenas.nlextents", ctypes.c_uint)
    page = _ctl_read(fn, "arenas.page")
    largest = _ctl_read(fn, f"arenas.lextent.{count - 1}.size") if count else None
    return None if largest is None or page is None else largest + page


def jemalloc_arena0_threshold() -> tuple[int, int] | None:
    """(arena 0's oversize threshold, the one jemalloc's options ask for) in bytes; None off jemalloc."""
    try:
        fn = _mallctl()
        if fn is None:
            return None
        current, target = _ctl_read(fn, "arena.0.oversize_threshold"), _oversize_target(fn)
        return None if current is None or target is None else (current, target)
    except Exception:
        return None


def set_jemalloc_arena0_threshold(value: int) -> bool:
    """Write ``arena.0.oversize_threshold``; False where that is not possible. Never raises."""
    try:
        fn = _mallctl()
        new = ctypes.c_size_t(value)
        return fn is not None and fn(b"arena.0.oversize_threshold", None, None, ctypes.byref(new),
                                     ctypes.sizeof(new)) == 0
    except Exception:
        return False


def align_jemalloc_arena0() -> tuple[int, int] | None:
    """Make jemalloc's arena 0 use the oversize threshold its options set; (before, after) when changed.

    Why: jemalloc 5.3.0 (Debian 12, Ubuntu 22.04/24.04) creates arena 0, the main thread's, before it
    reads ``oversize_threshold``, so arena 0 keeps the 8 MiB default whatever ``MALLOC_CONF`` says
    (jemalloc issue #2809, fixed after 5.3.0). Every extent of 8 MiB or more freed there is purged at
    once (unless a decay time is -1): with run_cpu's ``oversize_threshold:1`` (huge arena disabled) a
    worker faulted in Voxelization's large table on every call, as with glibc's defaults. Aligned, such
    extents follow ``dirty_decay_ms`` like every other arena's: no faults, the same peak RSS
    (docs/benchmarks.md). None: not jemalloc, already aligned, or not writable."""
    found = jemalloc_arena0_threshold()
    if found is None or found[0] == found[1] or not set_jemalloc_arena0_threshold(found[1]):
        return None
    return found


def describe_oversize(value: int) -> str:
    """``8MiB``; ``off`` for a threshold above every size class (what a disabled option means)."""
    return "off" if value > 1 << 48 else _human(value)


def find_library(kind: str, search: tuple[str, ...] = LIBRARY_DIRS) -> str | None:
    """Full path of the jemalloc/tcmalloc shared library, or None when not installed."""
    for directory in search:
        for name in LIBRARY_NAMES[kind]:
            path = os.path.join(directory, name)
            if os.path.exists(path):
                return path
    import ctypes.util  # imports subprocess and shutil: only when a library is looked for

    found = ctypes.util.find_library(kind if kind == "jemalloc" else "tcmalloc_minimal")
    if found:
        for directory in search:
            path = os.path.join(directory, found)
            if os.path.exists(path):
                return path
    return None


def preload_environ(path: str, kind: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a child needs to start with ``path`` preloaded (like run_cpu's add_lib_preload)."""
    parts = [p for p in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    changes = {"LD_PRELOAD": ":".join([path, *[p for p in parts if p != path]])}
    if kind == "jemalloc" and "MALLOC_CONF" not in environ:
        changes["MALLOC_CONF"] = JEMALLOC_CONF
    return changes


def raise_nofile() -> tuple[int, int, int] | None:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit; (before, after, hard), None if unchanged."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return None
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return soft, target, hard


def resident() -> int | None:
    """This process's resident memory in bytes, or None where unreadable."""
    return resident_bytes()


def trim() -> bool:
    """``malloc_trim(0)``: give every free heap page back to the kernel (holes too, not just the top)."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    fn(0)
    return True


class HeapBound:
    """What a tuned DataLoader worker may hold between batches: about what one batch needs.

    Measured per worker, in resident memory: a batch that starts on a trimmed heap (the worker's first,
    or the one after a trim) shows what the worker holds with one batch's temporaries kept
    (``held``) and how much of that the batch added (``working_set``). A later batch that leaves the
    worker holding more than ``held`` plus :data:`BOUND_SLACK` of the working set (at least
    :data:`BOUND_FLOOR`) has grown the heap instead of reusing it: ``malloc_trim(0)`` returns every
    free page and the next batch starts trimmed again (its temporaries fault in once).

    Why a heap grows although each batch frees what it allocated: torch allocates tensors with
    ``posix_memalign(64)``, and glibc before 2.38 cannot place an aligned block in a free chunk of
    exactly its size (it asks for the size plus the alignment), so a freed table of N bytes is not
    reused by the next batch's table of N bytes; two such tables freed together leave a 2N hole that
    fits one of the next pair, the other goes to the top. Without the bound a worker grew by a batch's
    temporaries per batch until the holes were large enough (Voxelization: 622 -> 1,414 MiB)."""

    def __init__(self, floor: int = BOUND_FLOOR, slack: float = BOUND_SLACK) -> None:
        self.floor = floor
        self.slack = slack
        self.held = 0  # bytes resident after a batch that started trimmed (the largest seen)
        self.working_set = 0  # bytes such a batch added to what the worker held before it
        self.trims = 0
        self.batches = 0
        self._base = resident()  # before the next clean batch: at start, or right after a trim
        self._clean = True
        self.available = self._base is not None

    @property
    def limit(self) -> int:
        """The most the worker may hold after a batch without a trim (bytes)."""
        return self.held + max(self.floor, int(self.working_set * self.slack))

    def after_batch(self) -> bool:
        """Call after each batch; True when it trimmed. Never raises."""
        try:
            now = resident()
            if now is None or self._base is None:
                return False
            self.batches += 1
            if self._clean:
                self.held = max(self.held, now)
                self.working_set = max(self.working_set, now - self._base)
                self._clean = False
                return False
            if now <= self.limit or not trim():
                return False
            self.trims += 1
            self._base = resident()
            self._clean = True
            return True
        except Exception:
            return False

    def to_json(self) -> dict[str, int]:
        return {"held": self.held, "working_set": self.working_set, "trims": self.trims, "batches": self.batches}


def minor_faults(who: int = resource.RUSAGE_SELF) -> int:
    return resource.getrusage(who).ru_minflt


def _human(value: int) -> str:
    return f"{value // MiB}MiB" if value % MiB == 0 else str(value)
