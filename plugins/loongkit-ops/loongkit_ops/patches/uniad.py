"""LOONGKIT_UNIAD: UniAD's BEVFormer-style encoder, motion deformable attention and CollisionLoss.

Found like BEVFORMER's classes, with BEVFORMER's pieces (:class:`.model_classes.ModelClasses` over the
mmcv 1.x / mmengine registries, and the patches of :mod:`.bevformer_sca` / :mod:`.bevformer_fused`):

- ``SpatialCrossAttention``, ``MSDeformableAttention3D``, ``TemporalSelfAttention``: as LOONGKIT_BEVFORMER
  (UniAD's copy of SCA orders key/value batch-major; that is detected and reproduced). A class already
  patched by LOONGKIT_BEVFORMER is left to it.
- ``MotionDeformableAttention`` (motion head): its CPU path calls ``multi_scale_deformable_attn_pytorch``
  from its module's globals; that global goes to the fused op, the module's own maths stay as they are.
- ``CollisionLoss`` (planning head): forward replaced by :func:`collision_fused`, without the per-box
  Python loop (see there). It needs no compiled kernel, so it applies even when the kernel cannot be
  built (the fused-op classes then say "CPU kernel unavailable").
"""

from __future__ import annotations

import dis
import inspect
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl
from loongkit_ops.patches.bevformer import PATCHES
from loongkit_ops.patches.bevformer_source import SPECS
from loongkit_ops.patches.model_classes import ModelClasses, Patched, Spec, forward_function, mark
from loongkit_ops.patches.msda import FUNCTION

COLLISION_FORWARD = ("self", "sdc_traj_all", "sdc_planning_gt", "sdc_planning_gt_mask", "future_gt_bbox")

UNIAD_SPECS: dict[str, Spec] = {
    **{k: v for k, v in SPECS.items() if k != "CustomMSDeformableAttention"},
    "MotionDeformableAttention": Spec(
        "msda",
        ("self", "query", "key", "value", "identity", "query_pos", "key_padding_mask", "spatial_shapes",
         "level_start_index", "bbox_results", "reference_trajs", "flag", "**"),
        ("embed_dims", "num_heads", "num_levels", "num_points", "num_steps", "sample_index", "bev_range"),
        ("sampling_offsets", "attention_weights", "value_proj", "output_proj", FUNCTION)),
    "CollisionLoss": Spec("collision", COLLISION_FORWARD, ("delta", "weight"),
                          ("to_corners", "inter_bbox", "corners", "tensor", "weight", "w", "h")),
}


def _reads(code: Any, name: str) -> bool:
    """Whether ``code`` (or a comprehension/closure in it) reads the local ``name``."""
    for ins in dis.get_instructions(code):
        if ins.opname.startswith(("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE")):
            names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
            if name in names:
                return True
    return any(_reads(c, name) for c in code.co_consts if hasattr(c, "co_code"))


def _owner(cls: type, attr: str) -> type | None:
    return next((k for k in cls.__mro__ if attr in vars(k)), None)


def collision_problem(cls: type) -> str | None:
    """What the generic check cannot see: the maths must be UniAD's, not a variant's."""
    forward = forward_function(cls)
    if _reads(forward.__code__, "sdc_planning_gt_mask"):
        return "interface differs: CollisionLoss.forward reads sdc_planning_gt_mask (a variant, not UniAD's loss)"
    owners = {attr: _owner(cls, attr) for attr in ("forward", "to_corners", "inter_bbox")}
    if len(set(owners.values())) != 1:
        return f"interface differs: CollisionLoss overrides {sorted(a for a, o in owners.items() if o is not cls)}"
    try:
        to_corners = tuple(inspect.signature(cls.to_corners).parameters)  # type: ignore[attr-defined]
        inter = tuple(inspect.signature(cls.inter_bbox).parameters)  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return "interface differs: CollisionLoss lacks to_corners/inter_bbox"
    if to_corners != ("self", "bbox") or inter != ("self", "corners_a", "corners_b"):
        return f"interface differs: to_corners{to_corners}, inter_bbox{inter}"
    return None


def collision_fused(module: Any, sdc_traj_all: Any, sdc_planning_gt: Any, future_gt_bbox: Any) -> Any:
    """UniAD's CollisionLoss.forward, every (future step, GT box) pair at once.

    Upstream, per future step i with boxes: the ego box (w x h, yaw = sdc_planning_gt[0, i, 2], centre
    = sdc_traj_all[0, i, :2]) is built with ``torch.tensor(...)`` from its parts, which copies them:
    the ego box carries no gradient (neither position nor yaw), so the loss does not train the
    trajectory. Kept: the ego inputs are detached here too. Each GT box's BEV corners (corners 0, 3,
    4, 7) and the ego box give axis-aligned extents; the overlap is max(min(maxes) - max(mins), 0) per
    axis with Python's min/max (the first argument wins ties and NaN comparisons; reproduced with
    ``where``), multiplied over x and y and summed into a [1] tensor of the trajectory's dtype, times
    ``weight``. Only sample 0 of the batch is read, as upstream.
    """
    import torch

    dtype, device = sdc_traj_all.dtype, sdc_traj_all.device
    inter_sum = sdc_traj_all.new_zeros(1)
    steps: list[int] = []
    corners: list[Any] = []
    for i, boxes in enumerate(future_gt_bbox):  # one step per future frame; the boxes are batched
        if len(boxes.tensor) > 0:
            steps.append(i)
            corners.append(boxes.corners[:, [0, 3, 4, 7], :2])
    if not steps:
        return inter_sum * module.weight
    index = torch.tensor(steps, device=device)
    theta = sdc_planning_gt[0, index.to(sdc_planning_gt.device), 2].to(dtype).detach().to(device)
    centre = sdc_traj_all[0, index, :2].detach()
    w, h = module.w, module.h
    base = torch.tensor([[w / 2, -h / 2], [w / 2, h / 2], [-w / 2, h / 2], [-w / 2, -h / 2]]).to(device)
    cos, sin = torch.cos(theta), torch.sin(theta)
    rot = torch.stack([torch.stack([cos, sin], -1), torch.stack([-sin, cos], -1)], -2)  # [S, 2, 2]
    ego = rot @ base.T + centre[:, :, None]  # [S, 2, 4]: rows x and y of the four corners
    xa1, ya1 = ego[:, 0].amax(-1), ego[:, 1].amax(-1)
    xa2, ya2 = ego[:, 0].amin(-1), ego[:, 1].amin(-1)

    gt = torch.cat(corners).to(device)  # [M, 4, 2]
    # The step each GT box belongs to. Built from the Python lengths: torch.repeat_interleave with a
    # tensor of repeats opens a parallel region even for a handful of steps, dear on a loaded machine.
    owner = torch.tensor([k for k, c in enumerate(corners) for _ in range(len(c))], device=device)
    xb1, yb1 = gt[..., 0].amax(-1), gt[..., 1].amax(-1)
    xb2, yb2 = gt[..., 0].amin(-1), gt[..., 1].amin(-1)
    xa1, ya1, xa2, ya2 = xa1[owner], ya1[owner], xa2[owner], ya2[owner]
    xi1, yi1 = torch.where(xb1 < xa1, xb1, xa1), torch.where(yb1 < ya1, yb1, ya1)  # min(a, b)
    xi2, yi2 = torch.where(xb2 > xa2, xb2, xa2), torch.where(yb2 > ya2, yb2, ya2)  # max(a, b)
    dx, dy = xi1 - xi2, yi1 - yi2
    zero = dx.new_zeros(())
    intersect = torch.where(zero > dx, zero, dx) * torch.where(zero > dy, zero, dy)  # max(d, 0)
    inter_sum = inter_sum + intersect.sum().to(inter_sum.dtype)
    return inter_sum * module.weight


def make_collision_forward(ctx: ActivationContext, original: Any) -> Any:
    import torch

    count, fallback = ctx.count, ctx.fallback

    def forward(self: Any, sdc_traj_all: Any, sdc_planning_gt: Any, sdc_planning_gt_mask: Any,
                future_gt_bbox: Any) -> Any:
        why = None
        if not all(isinstance(getattr(self, a, None), (int, float)) for a in ("w", "h", "weight")):
            why = "instance lacks numeric w/h/weight"
        elif not (isinstance(sdc_traj_all, torch.Tensor) and isinstance(sdc_planning_gt, torch.Tensor)):
            why = "trajectories are not tensors"
        elif sdc_traj_all.dtype != torch.get_default_dtype():
            why = "trajectory dtype is not the default dtype (upstream's corner matmul mixes dtypes)"
        if why is not None:
            fallback(why)
            return original(self, sdc_traj_all, sdc_planning_gt, sdc_planning_gt_mask, future_gt_bbox)
        count()
        return collision_fused(self, sdc_traj_all, sdc_planning_gt, future_gt_bbox)

    return mark(forward, ctx, original)


def patch_collision(ctx: ActivationContext, name: str, cls: type) -> Patched:
    problem = collision_problem(cls)
    if problem:
        raise NotApplicable(problem)
    ctx.patcher.patch(cls, "forward", make_collision_forward(ctx, cls.forward))  # type: ignore[attr-defined]
    return Patched("vectorised", "vectorised over (future step, GT box); ego box detached as upstream")


class UniAD(FeatureImpl):
    """LOONGKIT_UNIAD: targets the mmcv 1.x and mmengine registry modules."""

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        assert target is not None
        ModelClasses.of(ctx, UNIAD_SPECS, {**PATCHES, "collision": patch_collision}).watch(target)
