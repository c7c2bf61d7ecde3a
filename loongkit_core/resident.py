"""This process's resident memory, from ``/proc/self/statm``: one small read, no psutil, cheap enough
to call after every batch or step (the monitor, the worker heap bound and the compile feature do)."""

from __future__ import annotations

import os

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
STATM = "/proc/self/statm"


def resident_bytes(path: str = STATM) -> int | None:
    """Resident bytes (statm's second field, counted in pages), or None where it cannot be read."""
    try:
        with open(path, "rb") as fh:
            return int(fh.read(256).split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None
