"""Triton GPU kernels of loongkit-ops (optional: :func:`available` is False without triton).

On a machine without a GPU they still run under ``TRITON_INTERPRET=1`` on CPU tensors (tests).
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """triton is importable (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None
