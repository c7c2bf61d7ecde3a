"""loongkit-ops kernel library: compiled CPU kernels, Triton GPU kernels, torch.library custom ops.

- ``cpu/*.cpp``: C++ kernels (OpenMP), built on first use by :mod:`.build` into a persistent cache.
- ``triton/*.py``: Triton kernels for CUDA devices (optional: only used when triton imports).
- ``ops.py``: the ``loongkit::*`` custom ops (fake impls and autograd, so torch.compile traces
  them without graph breaks); each falls back to :mod:`.reference` when no kernel can run.
- ``reference.py``: independent float64 references written from the algorithms.

Importing this package imports neither torch nor the extension. Prebuild:
``python -m loongkit_ops.kernels``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import ModuleType

from loongkit_ops.kernels.build import CACHE_ENV, Extension

__all__ = ["CACHE_ENV", "EXTENSION", "failure", "load", "main"]

# No -ffast-math: NaN/inf handling and the summation order written in the source are kept; the
# vector loops are marked `omp simd` explicitly instead. -fopenmp makes at::parallel_for parallel
# (torch's OpenMP region); the libgomp torch bundles has the same soname, so one runtime is shared.
# No -std flag: torch's tooling passes the standard its headers need (C++17 up to 2.13, C++20 from
# 2.14, whose headers #error under C++17); the sources compile under both.
EXTENSION = Extension(
    name="loongkit_ops_kernels",
    directory=Path(__file__).with_name("cpu"),
    sources=("bindings.cpp", "msda.cpp", "dice.cpp", "daf.cpp", "bev_pool.cpp", "voxelize.cpp"),
    headers=("kernels.h", "bilinear.h"),
    cflags=("-O3", "-march=native", "-fno-math-errno", "-fopenmp"),
    ldflags=("-fopenmp",),
)


def load() -> ModuleType | None:
    """The compiled CPU kernels (built on first use), or None; :func:`failure` says why."""
    return EXTENSION.load()


def failure() -> str | None:
    return EXTENSION.failure()


def main() -> int:
    """``python -m loongkit_ops.kernels``: build (or find) the CPU kernels now and say where they are."""
    start = time.perf_counter()
    module = load()
    if module is None:
        print(f"loongkit-ops kernels unavailable: {failure()}", file=sys.stderr)
        return 1
    took = time.perf_counter() - start
    how = (f"built in {EXTENSION.build_seconds:.1f} s" if EXTENSION.build_seconds is not None
           else f"loaded from cache in {took:.2f} s")
    print(f"loongkit-ops kernels {how}: {module.__file__}")
    return 0
