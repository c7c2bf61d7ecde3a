"""LOONGKIT_BEVFORMER's mmcv part: mmcv's MultiScaleDeformableAttention on the fused CPU op.

mmcv 2.x has no CPU kernel for multi-scale deformable attention: on CPU,
``MultiScaleDeformableAttention.forward`` calls ``multi_scale_deformable_attn_pytorch`` (one
grid_sample per level plus stacking), looked up in its module's globals at call time. The patch
replaces that module attribute with a dispatcher: float32/float64 CPU tensors go to
``loongkit::ms_deform_attn`` (same maths, C++/OpenMP, fused backward), anything else to the
original function. The module class itself is left untouched, so subclasses and registries keep
working, and code that imports the function from mmcv after activation gets the dispatcher too.

Interface check before patching: the forward must still take the documented arguments and call the
function by that name, and the function must have mmcv's signature; otherwise NotApplicable.
"""

from __future__ import annotations

import inspect
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable

FUNCTION = "multi_scale_deformable_attn_pytorch"
FUNCTION_PARAMS = ["value", "value_spatial_shapes", "sampling_locations", "attention_weights"]
FORWARD_PARAMS = ["self", "query", "key", "value", "identity", "query_pos", "key_padding_mask", "reference_points",
                  "spatial_shapes", "level_start_index"]


def interface_problem(module: Any) -> str | None:
    """None when ``module`` looks like mmcv's multi_scale_deform_attn, else what differs."""
    cls = getattr(module, "MultiScaleDeformableAttention", None)
    fn = getattr(module, FUNCTION, None)
    if cls is None or not callable(fn):
        return f"interface differs: {module.__name__} lacks MultiScaleDeformableAttention or {FUNCTION}"
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return f"interface differs: cannot read the signature of {FUNCTION}"
    if params != FUNCTION_PARAMS:
        return f"interface differs: {FUNCTION}{tuple(params)}, expected {tuple(FUNCTION_PARAMS)}"
    forward = inspect.unwrap(cls.forward)  # mmcv wraps it in deprecated_api_warning
    try:
        fparams = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return "interface differs: cannot read MultiScaleDeformableAttention.forward's signature"
    if fparams[:len(FORWARD_PARAMS)] != FORWARD_PARAMS:
        return f"interface differs: MultiScaleDeformableAttention.forward{tuple(fparams)}"
    code = getattr(forward, "__code__", None)
    if code is None or FUNCTION not in code.co_names:
        return f"interface differs: MultiScaleDeformableAttention.forward does not call {FUNCTION}"
    return None


def fused_dispatcher(original: Any, ctx: ActivationContext) -> Any:
    """A drop-in for ``multi_scale_deformable_attn_pytorch``: float32/float64 CPU tensors go to
    ``loongkit::ms_deform_attn`` (each call counted), anything else to ``original``."""
    import torch

    from loongkit_ops.kernels.ops import msda
    from loongkit_ops.patches import kernel

    fused_dtypes = (torch.float32, torch.float64)
    count = ctx.count

    def multi_scale_deformable_attn_pytorch(value: Any, value_spatial_shapes: Any, sampling_locations: Any,
                                            attention_weights: Any) -> Any:
        # The kernel is built at the first eligible call, not at import: every mmdet program imports
        # this module; a failed build keeps upstream's code (the reason goes to the Summary).
        if (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dtype in fused_dtypes
                and value.dim() == 4 and sampling_locations.dim() == 6 and kernel.ready(ctx)):
            shapes = torch.as_tensor(value_spatial_shapes, dtype=torch.int64, device="cpu")
            areas = shapes[:, 0] * shapes[:, 1]
            starts = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
            count()
            return msda.op(value, shapes, starts, sampling_locations.to(value.dtype), attention_weights.to(value.dtype))
        return original(value, value_spatial_shapes, sampling_locations, attention_weights)

    multi_scale_deformable_attn_pytorch.__doc__ = original.__doc__
    multi_scale_deformable_attn_pytorch.__loongkit_original__ = original  # type: ignore[attr-defined]
    return multi_scale_deformable_attn_pytorch


def function_problem(fn: Any) -> str | None:
    """None when ``fn`` has ``multi_scale_deformable_attn_pytorch``'s parameters, else what differs."""
    if not callable(fn):
        return f"{FUNCTION} is not callable"
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return f"cannot read the signature of {FUNCTION}"
    if params != FUNCTION_PARAMS:
        return f"{FUNCTION}{tuple(params)}, expected {tuple(FUNCTION_PARAMS)}"
    return None


def patch_mmcv(ctx: ActivationContext, module: Any) -> None:
    """Swap ``module.multi_scale_deformable_attn_pytorch`` (mmcv's) for :func:`fused_dispatcher`.

    Raises NotApplicable when the module is not mmcv's multi_scale_deform_attn as expected.
    """
    problem = interface_problem(module)
    if problem:
        raise NotApplicable(problem)
    ctx.patcher.patch(module, FUNCTION, fused_dispatcher(getattr(module, FUNCTION), ctx))
    ctx.log.info("mmcv MultiScaleDeformableAttention uses the fused CPU op", target=module.__name__)
