"""Fixtures shared by the loongkit-ops kernel tests: the compiled extension and Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from itertools import count
from pathlib import Path
from typing import Any

import pytest
import torch

# Every torch.empty / empty_like / new_empty in the child is poisoned (NaN, True, or -7 for integers):
# an element a kernel forgets to write shows up in the comparison.
POISON = """
import torch
_empty, _empty_like, _new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
def _poison(t):
    return t.fill_(float("nan") if t.is_floating_point() else (True if t.dtype == torch.bool else -7))
torch.empty = lambda *a, **k: _poison(_empty(*a, **k))
torch.empty_like = lambda *a, **k: _poison(_empty_like(*a, **k))
torch.Tensor.new_empty = lambda self, *a, **k: _poison(_new_empty(self, *a, **k))
"""

# What the child script sees: ARGS (the arguments, rebuilt from their repr) and save(obj).
CHILD = """
import sys
import torch
ARGS = tuple(eval(a) for a in sys.argv[2:])
def save(obj):
    torch.save(obj, sys.argv[1])
"""


@pytest.fixture(scope="module")
def ext() -> Any:
    """The compiled CPU kernels (built on first use); a build failure fails the test with its reason."""
    from loongkit_ops import kernels

    module = kernels.load()
    assert module is not None, kernels.failure()
    return module


def interpreter_or_skip() -> None:
    """Skip unless triton is installed and its CPU interpreter runs the kernels: triton 3.0 (torch
    2.4's pin) raises "arange's arguments must be of type tl.constexpr" interpreting them (seen with
    torch 2.4.1 + triton 3.0.0; triton 3.9 runs them). Not a verdict on triton 3.0 on a GPU."""
    triton = pytest.importorskip("triton")
    if triton.__version__.startswith("3.0."):
        pytest.skip(f"triton {triton.__version__}'s interpreter rejects the kernels' tl.arange "
                    "(arange's arguments must be of type tl.constexpr); interpreted checks need a newer triton")


@pytest.fixture
def run_interpreted(tmp_path: Path) -> Callable[..., Any]:
    """``run(script, *args, poison=True)``: run ``script`` in a child with TRITON_INTERPRET=1 (Triton
    kernels on CPU tensors) and return what it passed to ``save``. ``args`` travel as their repr."""
    interpreter_or_skip()
    runs = count()

    def run(script: str, *args: Any, poison: bool = True) -> Any:
        path = tmp_path / f"interpreted{next(runs)}.pt"
        code = (POISON if poison else "") + CHILD + textwrap.dedent(script)
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        proc = subprocess.run([sys.executable, "-c", code, str(path), *map(repr, args)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"args {args!r}: {proc.stderr[-3000:]}"
        return torch.load(path)

    return run
