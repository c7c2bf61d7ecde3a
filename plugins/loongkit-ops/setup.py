"""Build of loongkit-ops's compiled CPU kernels into its wheel (metadata: pyproject.toml).

The kernel library (loongkit_ops/kernels/cpu/build.json) is compiled by loongkit_core.kernelbuild, the same
code that builds it on first use, into a py3-none-<platform> wheel: the binary uses neither
Python's nor libtorch's ABI (docs/architecture.md, "Kernel ABI"). That module is loaded by path
from the repository (pip wheel plugins/loongkit-ops), else from an installed loongkit-core
(pip wheel --no-build-isolation); without either, the wheel holds no binary and the kernels build
on first use.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from setuptools import setup

HERE = Path(__file__).resolve().parent


def kernel_build() -> Any:
    repo = HERE.parent.parent / "loongkit_core" / "kernelbuild.py"
    if repo.exists():
        spec = importlib.util.spec_from_file_location("_loongkit_kernelbuild", repo)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        return module
    try:
        from loongkit_core import kernelbuild
    except ImportError:
        print("loongkit-ops: loongkit_core.kernelbuild not found, building a wheel without the compiled "
              "kernels (they build on first use)", file=sys.stderr)
        return None
    return kernelbuild


kb = kernel_build()
KERNELS = ("loongkit_ops/kernels/cpu", "loongkit_ops.kernels.cpu.loongkit_ops_cpu")
setup(**(kb.setup_kwargs(HERE, *KERNELS) if kb else {}))
