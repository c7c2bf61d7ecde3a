"""Where plugins keep kernels compiled on first use, and what identifies a build.

Shared by every kernel-shipping plugin (plugins never import each other): one cache directory
(``LOONGKIT_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/loongkit/kernels``), the compiler torch's tooling
will call, and the CPU identity that goes into each build key (binaries are built with
``-march=native``, so a cached one must never be loaded on a different CPU).
"""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Mapping
from pathlib import Path

CACHE_ENV = "LOONGKIT_KERNEL_CACHE"


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "loongkit" / "kernels"


def compiler() -> str | None:
    """The C++ compiler torch's tooling will call (``$CXX`` or ``c++``), resolved; None when absent."""
    return shutil.which(os.environ.get("CXX", "c++"))


def cpu_identity() -> str:
    """Model name and feature flags of this machine's CPUs (part of every build key)."""
    try:
        with open("/proc/cpuinfo") as fh:
            lines = [ln for ln in fh if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
