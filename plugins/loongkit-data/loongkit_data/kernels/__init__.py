"""loongkit-data's C++ kernels (``cpu/``): bit-exact mmcv imnormalize and mmdet PhotoMetricDistortion.

One library (``cpu/build.json``) loaded by :class:`loongkit_core.kernels.KernelLibrary`: the
binary prebuilt in the wheel, else one built on first use into the kernel cache (``$CXX``/``c++``;
a file lock makes concurrent first uses, several DataLoader workers at once, build once); forked
workers inherit the loaded library, spawned ones load the same file. Baseline, AVX2 and AVX-512
builds of every kernel, the best one for this CPU picked at run time; all of them compute the same
bits (the SIMD paths reproduce the scalar IEEE operations lane by lane).

Flags (``cpu/build.json``): ``-ffp-contract=off``, never fuse a*b+c unless the source says fma()
(bit-exactness with OpenCV); no ``-ffast-math``: IEEE semantics of every operation are part of the
result.

Failures never raise: :func:`load` returns None and :func:`failure` says why (no compiler,
read-only cache directory, compile error, a binary that does not load), and callers keep using the
upstream code.

Prebuild or check: ``python -m loongkit_data.kernels``.
"""

from __future__ import annotations

from pathlib import Path

from loongkit_core.kernels import CACHE_ENV, KernelLibrary, Kernels

__all__ = ["CACHE_ENV", "LIBRARY", "describe", "failure", "load", "log", "main"]

LIBRARY = KernelLibrary(Path(__file__).with_name("cpu"), logger="loongkit.data.kernels")
log = LIBRARY.log


def load() -> Kernels | None:
    """The compiled kernels (prebuilt, or built on first use), or None; :func:`failure` says why."""
    return LIBRARY.load()


def failure() -> str | None:
    """Why :func:`load` returned None (None when it did not, or has not run)."""
    return LIBRARY.failure()


def describe() -> str:
    """Where the kernels come from and which instruction set runs (a Summary detail)."""
    return LIBRARY.describe()


def reset() -> None:
    """Forget the load result (tests)."""
    LIBRARY.reset()


def main() -> int:
    """``python -m loongkit_data.kernels``: build (or find) the kernels now and say where they are."""
    return LIBRARY.main("loongkit-data")
