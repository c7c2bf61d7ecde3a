"""Build-on-first-use loader of loongkit-data's C++ kernels (``csrc/``).

The extension is compiled with torch's extension tooling (``torch.utils.cpp_extension.load``, which
needs ninja and a C++ compiler) into a persistent directory keyed by everything that changes the
binary: the sources and flags, torch's and Python's versions, the compiler (path, size, mtime) and
the CPU (the code is built with ``-march=native``). Later processes, including spawned DataLoader
workers, import the cached shared object directly without invoking the build system; forked workers
inherit the loaded module. A file lock makes concurrent first uses (several workers at once) build
once; the process that builds logs the one-time cost, the others wait for it.

Failures never raise: :func:`load` returns None and :func:`failure` says why (no compiler, no ninja,
read-only cache directory, compile error), and callers keep using the upstream code.

Prebuild (optional): ``python -m loongkit_data.kernels``.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

from loongkit_core.kernelcache import CACHE_ENV as CACHE_ENV  # re-exported: tests and docs name it here
from loongkit_core.kernelcache import cache_root, compiler, cpu_identity
from loongkit_core.log import get_logger

NAME = "loongkit_data_kernels"
CSRC = Path(__file__).with_name("csrc")
SOURCES = ("bindings.cpp",)
HEADERS = ("simd.hpp", "imnormalize.hpp", "distortion.hpp")
# -ffp-contract=off: never fuse a*b+c unless the source says fma() (bit-exactness with OpenCV).
# No -ffast-math: IEEE semantics of every operation are part of the result.
# No -std: torch's tooling picks the standard its headers need (C++17 on 2.13, C++20 on 2.14).
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp")
LDFLAGS = ("-fopenmp",)

log = get_logger("loongkit.data.kernels")

_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None
_tried = False
build_seconds: float | None = None  # set in the process that compiled the extension


# Cache directory, compiler and CPU identity are shared with every kernel-shipping plugin.
_cpu_identity = cpu_identity


def build_key(torch_version: str, cxx: str | None = None) -> str:
    """Hash of everything that makes a different binary; names the cache directory."""
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(repr((CFLAGS, LDFLAGS)).encode())
    h.update(f"torch={torch_version} py={sys.version} soabi={sysconfig.get_config_var('SOABI')}".encode())
    if cxx:
        st = os.stat(cxx)
        h.update(f"cxx={os.path.realpath(cxx)}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(_cpu_identity().encode())
    return h.hexdigest()[:20]


def _import_so(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, str(path), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _so_path(directory: Path) -> Path:
    return directory / f"{NAME}.so"  # the name torch.utils.cpp_extension.load gives it on Linux


def _build(directory: Path) -> ModuleType:
    from torch.utils import cpp_extension

    cpp_extension.verify_ninja_availability()  # RuntimeError with a clear message when missing
    return cpp_extension.load(
        name=NAME,
        sources=[str(CSRC / s) for s in SOURCES],
        extra_include_paths=[str(CSRC)],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(directory),
        verbose=False,
    )


def _load_or_build() -> ModuleType:
    global build_seconds
    import torch  # the extension links libtorch; it must be loaded first

    cxx = compiler()
    directory = cache_root() / build_key(torch.__version__, cxx)
    so = _so_path(directory)
    if so.exists():
        return _import_so(so)
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')} not on PATH) to build the kernels")
    directory.mkdir(parents=True, exist_ok=True)  # OSError on a read-only cache
    import fcntl

    with open(directory / "build.lock", "w") as lock:
        waited = time.perf_counter()
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        waited = time.perf_counter() - waited
        if so.exists():
            log.info("kernels built by another process", waited_s=round(waited, 3), path=str(so))
            return _import_so(so)
        start = time.perf_counter()
        module = _build(directory)
        build_seconds = time.perf_counter() - start
    # Once per machine and key (the lock makes a single builder): the seed's one-time JIT cost.
    log.info("built the loongkit-data kernels (one-time JIT compilation)",
             seconds=round(build_seconds, 2), path=str(so))
    return module


def load() -> ModuleType | None:
    """The compiled kernels, building them on first use; None (see :func:`failure`) if unavailable."""
    global _module, _failure, _tried
    if _tried:
        return _module
    with _lock:
        if not _tried:
            try:
                _module = _load_or_build()
                if getattr(_module, "ABI", None) != 1:
                    raise RuntimeError(f"kernel ABI {getattr(_module, 'ABI', None)!r}, expected 1")
            except BaseException as exc:  # a kernel must never break the user's program
                if isinstance(exc, KeyboardInterrupt):
                    raise
                _module = None
                _failure = _reason(exc)
                log.warning("loongkit-data kernels unavailable; using upstream code", reason=_failure)
            _tried = True
    return _module


def failure() -> str | None:
    """Why :func:`load` returned None (None when it did not, or has not run)."""
    return _failure


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = next((ln for ln in text if "error" in ln.lower()), text[0] if text else "")
    return f"{type(exc).__name__}: {first[:300]}"


def reset() -> None:
    """Forget the load result (tests)."""
    global _module, _failure, _tried, build_seconds
    with _lock:
        _module, _failure, _tried, build_seconds = None, None, False, None


def main() -> int:
    """``python -m loongkit_data.kernels``: build (or find) the kernels now and say where they are."""
    start = time.perf_counter()
    module = load()
    if module is None:
        print(f"loongkit-data kernels unavailable: {failure()}", file=sys.stderr)
        return 1
    took = time.perf_counter() - start
    how = f"built in {build_seconds:.1f} s" if build_seconds is not None else f"loaded from cache in {took:.2f} s"
    print(f"loongkit-data kernels {how}: {module.__file__}")
    return 0
