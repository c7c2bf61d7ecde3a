"""loongkit-ops kernel library: compiled CPU kernels, Triton GPU kernels, torch.library custom ops.

- ``cpu/``: C++ kernels (OpenMP), one library (``cpu/build.json``) loaded by
  :class:`loongkit_core.kernels.KernelLibrary`: prebuilt in the wheel, else built on first use into
  the kernel cache; baseline, AVX2 and AVX-512 builds of every kernel, the best one for this CPU
  picked at run time.
- ``triton/*.py``: Triton kernels for CUDA devices (optional: only used when triton imports).
- ``ops/``: the ``loongkit::*`` custom ops, one module per op: its definition, fake impl and
  autograd (so torch.compile traces it without graph breaks), its dispatch to a kernel, and its
  plain-torch ``reference`` (the tests' float64 oracle and the fallback when no kernel can run).

Importing this package imports neither torch nor the library. Prebuild or check:
``python -m loongkit_ops.kernels``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongkit_core.kernels import CACHE_ENV, KernelLibrary, Kernels

__all__ = ["CACHE_ENV", "LIBRARY", "describe", "failure", "load", "log", "main"]


class OpsKernels(Kernels):
    """The library's functions, plus the voxelization entry points that allocate their outputs
    (torch tensors, as the custom ops return them)."""

    def hard_voxelize(self, points: Any, voxel_size: Any, coors_range: Any, max_points: int,
                      max_voxels: int) -> list[Any]:
        """(voxels [M, max_points, F], coors int32 [M, 3] (z, y, x), num_points int32 [M]): mmcv's
        deterministic hard voxelization of contiguous CPU points [N, >= 3]."""
        import torch

        plan = self.hard_voxelize_plan(points, voxel_size, coors_range, max_points, max_voxels)
        try:
            m = self.hard_voxelize_voxels(plan)
            voxels = torch.empty((m, max_points, points.shape[1]), dtype=points.dtype)
            coors = torch.empty((m, 3), dtype=torch.int32)
            num = torch.empty((m,), dtype=torch.int32)
        except BaseException:
            self.hard_voxelize_discard(plan)
            raise
        self.hard_voxelize_fill(plan, voxels, coors, num)  # frees the plan
        return [voxels, coors, num]

    def dynamic_voxelize(self, points: Any, voxel_size: Any, coors_range: Any) -> Any:
        """coors int32 [N, 3] (z, y, x), -1 rows for points outside the range."""
        import torch

        coors = torch.empty((points.shape[0], 3), dtype=torch.int32)
        self.dynamic_voxelize_into(points, voxel_size, coors_range, coors)
        return coors


LIBRARY = KernelLibrary(Path(__file__).with_name("cpu"), logger="loongkit.ops.kernels", api=OpsKernels)
log = LIBRARY.log


def load() -> OpsKernels | None:
    """The compiled CPU kernels (prebuilt, or built on first use), or None; :func:`failure` says why."""
    return LIBRARY.load()  # type: ignore[return-value]


def failure() -> str | None:
    return LIBRARY.failure()


def describe() -> str:
    """Where the CPU kernels come from and which instruction set runs (a Summary detail)."""
    return LIBRARY.describe()


def main() -> int:
    """``python -m loongkit_ops.kernels``: build (or find) the CPU kernels now and say where they are."""
    return LIBRARY.main("loongkit-ops")
