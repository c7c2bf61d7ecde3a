"""Build of loongkit-ops's compiled CPU kernels into its wheel (metadata: pyproject.toml).

The kernel library (loongkit_ops/kernels/cpu) is compiled by loongkit_core.kernelbuild (standard library only),
the code that also builds it on first use: from the repository's core in a checkout (`pip wheel
plugins/loongkit-ops`), else from an installed loongkit-core (`pip wheel --no-build-isolation`); without
either, the wheel holds no binary and the kernels build on first use.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
if (HERE.parent.parent / "loongkit_core" / "kernelbuild.py").exists():
    sys.path.insert(0, str(HERE.parent.parent))
try:
    from loongkit_core.kernelbuild import setup_kwargs
except ImportError:
    print("loongkit-ops: loongkit_core.kernelbuild not found, building a wheel without the compiled kernels "
          "(they build on first use)", file=sys.stderr)
    setup()
else:
    setup(**setup_kwargs(HERE, "loongkit_ops/kernels/cpu"))
