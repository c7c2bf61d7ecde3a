"""Build-on-first-use loader for loongkit-ops' C++ CPU kernels (``kernels/cpu/*.cpp``).

Same scheme as loongkit-data's loader (plugins never import each other, so the pattern lives here
too, as a reusable class): ``torch.utils.cpp_extension.load`` compiles the sources into a
persistent directory keyed by everything that changes the binary (sources, flags, torch and Python
versions, the compiler's identity, the CPU since we build with ``-march=native``); later processes
import the cached shared object without invoking ninja. A file lock makes concurrent first uses
build once. ``LOONGKIT_KERNEL_CACHE`` overrides the cache directory.

Failures never raise: :meth:`Extension.load` returns None and :meth:`Extension.failure` says why
(no compiler, no ninja, read-only cache, compile error); callers then use the reference path.
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
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from loongkit_core.kernelcache import CACHE_ENV as CACHE_ENV  # re-exported for loongkit_ops.kernels
from loongkit_core.kernelcache import cache_root, compiler, cpu_identity
from loongkit_core.log import get_logger

log = get_logger("loongkit.ops.kernels")


# Cache directory, compiler and CPU identity are shared with every kernel-shipping plugin.
_cpu_identity = cpu_identity


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = next((ln for ln in text if "error" in ln.lower()), text[0] if text else "")
    return f"{type(exc).__name__}: {first[:300]}"


class Extension:
    """One compiled extension: its sources, flags, and the once-per-process load result."""

    def __init__(self, name: str, directory: Path, sources: Sequence[str], headers: Sequence[str] = (),
                 cflags: Sequence[str] = (), ldflags: Sequence[str] = (), abi: int = 1) -> None:
        self.name = name
        self.directory = directory
        self.sources = tuple(sources)
        self.headers = tuple(headers)
        self.cflags = tuple(cflags)
        self.ldflags = tuple(ldflags)
        self.abi = abi
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._failure: str | None = None
        self._tried = False
        self.build_seconds: float | None = None  # set in the process that compiled it

    def build_key(self, torch_version: str, cxx: str | None = None) -> str:
        """Hash of everything that makes a different binary; names the cache directory."""
        h = hashlib.sha256()
        for name in (*self.sources, *self.headers):
            h.update(name.encode())
            h.update((self.directory / name).read_bytes())
        h.update(repr((self.cflags, self.ldflags)).encode())
        h.update(f"torch={torch_version} py={sys.version} soabi={sysconfig.get_config_var('SOABI')}".encode())
        if cxx:
            st = os.stat(cxx)
            h.update(f"cxx={os.path.realpath(cxx)}:{st.st_size}:{st.st_mtime_ns}".encode())
        h.update(_cpu_identity().encode())
        return h.hexdigest()[:20]

    def _import_so(self, path: Path) -> ModuleType:
        loader = importlib.machinery.ExtensionFileLoader(self.name, str(path))
        spec = importlib.util.spec_from_file_location(self.name, str(path), loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module

    def _build(self, directory: Path) -> ModuleType:
        from torch.utils import cpp_extension

        cpp_extension.verify_ninja_availability()  # RuntimeError with a clear message when missing
        return cpp_extension.load(
            name=self.name,
            sources=[str(self.directory / s) for s in self.sources],
            extra_include_paths=[str(self.directory)],
            extra_cflags=list(self.cflags),
            extra_ldflags=list(self.ldflags),
            build_directory=str(directory),
            verbose=False,
        )

    def _load_or_build(self) -> ModuleType:
        import torch  # the extension links libtorch; it must be loaded first

        cxx = compiler()
        directory = cache_root() / f"{self.name}-{self.build_key(torch.__version__, cxx)}"
        so = directory / f"{self.name}.so"  # the name cpp_extension.load gives it on Linux
        if so.exists():
            return self._import_so(so)
        if cxx is None:
            raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')} not on PATH) to build the kernels")
        directory.mkdir(parents=True, exist_ok=True)  # OSError on a read-only cache
        import fcntl

        with open(directory / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
            if so.exists():
                return self._import_so(so)
            start = time.perf_counter()
            module = self._build(directory)
            self.build_seconds = time.perf_counter() - start
        log.info("built the kernels (one-time JIT compilation)", extension=self.name,
                 seconds=round(self.build_seconds, 2), path=str(so))
        return module

    def load(self) -> ModuleType | None:
        """The compiled module, building it on first use; None (see :meth:`failure`) if unavailable."""
        if self._tried:
            return self._module
        with self._lock:
            if not self._tried:
                try:
                    module = self._load_or_build()
                    if getattr(module, "ABI", None) != self.abi:
                        raise RuntimeError(f"kernel ABI {getattr(module, 'ABI', None)!r}, expected {self.abi}")
                    self._module = module
                except BaseException as exc:  # a kernel must never break the user's program
                    if isinstance(exc, KeyboardInterrupt):
                        raise
                    self._module = None
                    self._failure = _reason(exc)
                    log.warning("kernels unavailable; using the reference path", extension=self.name,
                                reason=self._failure)
                self._tried = True
        return self._module

    def failure(self) -> str | None:
        """Why :meth:`load` returned None (None when it did not, or has not run)."""
        return self._failure

    def reset(self) -> None:
        """Forget the load result (tests)."""
        with self._lock:
            self._module, self._failure, self._tried, self.build_seconds = None, None, False, None
