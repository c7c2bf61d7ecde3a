"""LOONGKIT_VOXELIZATION: mmcv's voxelization (mmcv-full 1.x and mmcv 2.x) on loongkit's CPU kernel.

``mmcv.ops.voxelize._Voxelization.forward`` (behind ``voxelization`` and the ``Voxelization`` module
that mmdet3d's voxel encoders use) is replaced in place. CPU points of float16/32/64 go to
``loongkit::hard_voxelize`` (deterministic mode) or ``loongkit::dynamic_voxelize`` (max_points or
max_voxels == -1): the same voxels, coordinates and counts as mmcv's CPU kernel, bit for bit, without
its dense Z*Y*X id grid per call nor the max_voxels-row zero buffer. Anything else (CUDA points,
non-deterministic mode, arguments mmcv itself would reject) runs mmcv's forward unchanged. The kernel
is built at the first eligible call, not when mmcv is imported; a failed build keeps mmcv's code.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl

FORWARD_PARAMS = ["ctx", "points", "voxel_size", "coors_range", "max_points", "max_voxels", "deterministic"]


def interface_problem(module: Any) -> str | None:
    """None when ``module`` looks like mmcv's voxelize module (1.x full or 2.x), else what differs."""
    fn_cls = getattr(module, "_Voxelization", None)
    if fn_cls is None or getattr(module, "Voxelization", None) is None or not callable(
            getattr(module, "voxelization", None)):
        return f"interface differs: {module.__name__} lacks _Voxelization, voxelization or Voxelization"
    if not isinstance(fn_cls.__dict__.get("forward"), staticmethod):
        return "interface differs: _Voxelization.forward is not a staticmethod"
    try:
        params = list(inspect.signature(fn_cls.forward).parameters)
    except (TypeError, ValueError):
        return "interface differs: cannot read _Voxelization.forward's signature"
    if params != FORWARD_PARAMS:
        return f"interface differs: _Voxelization.forward{tuple(params)}, expected {tuple(FORWARD_PARAMS)}"
    names = getattr(getattr(module.Voxelization.forward, "__code__", None), "co_names", ())
    if "voxelization" not in names:
        return "interface differs: Voxelization.forward does not call voxelization"
    return None


def _plain_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Voxelization(FeatureImpl):
    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        module = sys.modules[target or self.feature.targets[0]]
        problem = interface_problem(module)
        if problem:
            raise NotApplicable(problem)
        import torch

        from loongkit_ops.kernels.ops import voxelize
        from loongkit_ops.patches import kernel

        fn_cls = module._Voxelization
        original = fn_cls.forward
        count = ctx.count

        def grid_args(voxel_size: Any, coors_range: Any) -> tuple[list[float], list[float]] | None:
            # mmcv hands the kernel float32 copies: the same values, and a grid it would accept.
            try:
                size = torch.as_tensor(voxel_size, dtype=torch.float32).flatten().cpu()
                rng = torch.as_tensor(coors_range, dtype=torch.float32).flatten().cpu()
            except (TypeError, ValueError, RuntimeError):
                return None
            if size.numel() != 3 or rng.numel() != 6:
                return None
            if not bool((torch.round((rng[3:] - rng[:3]) / size) > 0).all()):
                return None
            return size.tolist(), rng.tolist()

        def forward(fctx: Any, points: Any, voxel_size: Any, coors_range: Any, max_points: int = 35,
                    max_voxels: int = 20000, deterministic: bool = True) -> Any:
            eligible = (isinstance(points, torch.Tensor) and points.device.type == "cpu"
                        and points.dtype in (torch.float16, torch.float32, torch.float64)
                        and points.dim() == 2 and points.shape[1] >= 3
                        and _plain_int(max_points) and _plain_int(max_voxels))
            dynamic = eligible and (max_points == -1 or max_voxels == -1)
            eligible = eligible and (dynamic or (max_points >= 0 and max_voxels >= 0 and bool(deterministic)))
            grid = grid_args(voxel_size, coors_range) if eligible else None
            # The kernel is built here, at the first eligible call (not when mmcv is imported).
            if grid is None or not kernel.ready(ctx):
                return original(fctx, points, voxel_size, coors_range, max_points, max_voxels, deterministic)
            count()
            if dynamic:
                return voxelize.dynamic_op(points, *grid)
            return voxelize.hard_op(points, *grid, max_points, max_voxels)

        forward.__doc__ = original.__doc__
        forward.__wrapped__ = original  # type: ignore[attr-defined]
        ctx.patcher.patch(fn_cls, "forward", staticmethod(forward))
        ctx.set_config({"mmcv.ops.voxelize": "loongkit::hard_voxelize / dynamic_voxelize (CPU)"})
        ctx.log.info("mmcv voxelization uses the loongkit CPU kernel", target=module.__name__)
