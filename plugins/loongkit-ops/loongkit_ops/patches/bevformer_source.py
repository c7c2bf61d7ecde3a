"""What BEVFormer's attention classes must look like, and what their source says about their maths.

:data:`SPECS`: the registry names LOONGKIT_BEVFORMER patches, with the interface each must have (forward
parameters, ``__init__`` parameters that create the attributes the maths uses, names the forward
references). The source checks read the forward's text (whitespace removed) for upstream's expressions:
:func:`fused_problem` (the maths the fused forwards reproduce), :func:`tsa_layout` and
:func:`sca_layout` (how rows are ordered when the batch is larger than one). A forward whose source
cannot be read (or shows neither layout) is treated as unknown: the fast paths then leave bs > 1 to it.
"""

from __future__ import annotations

import inspect
from typing import Any

from loongkit_ops.patches.model_classes import Spec
from loongkit_ops.patches.msda import FUNCTION

_MSDA_FORWARD = ("self", "query", "key", "value", "identity", "query_pos", "key_padding_mask",
                 "reference_points", "spatial_shapes", "level_start_index")
_MSDA_INIT = ("embed_dims", "num_heads", "num_levels", "num_points")
_MSDA_USES = ("sampling_offsets", "attention_weights", "value_proj", FUNCTION)

SPECS: dict[str, Spec] = {
    "SpatialCrossAttention": Spec(
        "sca",
        ("self", "query", "key", "value", "residual", "query_pos", "key_padding_mask", "reference_points",
         "spatial_shapes", "reference_points_cam", "bev_mask", "level_start_index", "flag", "**"),
        ("embed_dims", "num_cams", "deformable_attention"),
        ("nonzero", "deformable_attention", "output_proj", "num_cams", "embed_dims", "dropout")),
    "MSDeformableAttention3D": Spec("msda", (*_MSDA_FORWARD, "**"), _MSDA_INIT, _MSDA_USES),
    "TemporalSelfAttention": Spec("msda", (*_MSDA_FORWARD, "flag", "**"), (*_MSDA_INIT, "num_bev_queue"),
                                  (*_MSDA_USES, "output_proj")),
    "CustomMSDeformableAttention": Spec("msda", (*_MSDA_FORWARD, "flag", "**"), _MSDA_INIT,
                                        (*_MSDA_USES, "output_proj")),
}

# Expressions of upstream's forward (whitespace removed) that define the maths the fused forward
# reproduces; a class whose source lacks one keeps its own forward (with the fused sampling kernel).
_COMMON_MARKERS = ("self.value_proj(value)", ".softmax(-1)",
                   "torch.stack([spatial_shapes[...,1],spatial_shapes[...,0]],-1)")
FUSED_MARKERS: dict[str, tuple[str, ...]] = {
    "MSDeformableAttention3D": (*_COMMON_MARKERS, "reference_points[:,:,None,None,None,:,:]"),
    "TemporalSelfAttention": (*_COMMON_MARKERS, "reference_points[:,:,None,:,None,:]", "torch.cat([value[",
                              "],query],-1)", "self.output_proj(", "self.dropout(output)+identity"),
}


def compact_source(fn: Any) -> str | None:
    """``fn``'s source without whitespace, or None when it cannot be read."""
    try:
        return "".join(inspect.getsource(fn).split())
    except (OSError, TypeError):
        return None


def fused_problem(name: str, forward: Any) -> str | None:
    """None when ``forward``'s source shows the maths the fused forwards of :mod:`.bevformer_fused` compute."""
    compact = compact_source(forward)
    if compact is None:
        return "source unavailable"
    missing = [m for m in FUSED_MARKERS[name] if m not in compact]
    return f"source lacks {missing}" if missing else None


def tsa_layout(forward: Any) -> str | None:
    """'batch-major' when the TSA's rows are [sample, queue] with the previous half ``value[:bs]``
    (BEVFormer's and UniAD's code); otherwise None: bs > 1 runs the original."""
    compact = compact_source(forward) or ""
    if "permute(0,3,1,2,4,5)" in compact and "torch.cat([value[:bs],query],-1)" in compact:
        return "batch-major"
    return None


def sca_layout(forward: Any) -> str | None:
    """How the SCA's source orders the key/value rows it hands the deformable attention: 'batch-major'
    (``permute(2, 0, 1, 3).reshape``: published BEVFormer and UniAD, like the packed queries),
    'camera-major' (``permute(0, 2, 1, 3).view``: an early BEVFormer revision) or None (unknown: bs > 1
    then runs the original)."""
    compact = compact_source(forward)
    if compact is None or "mask_per_img[0]" not in compact:
        return None
    if "key.permute(0,2,1,3).view(" in compact and "value.permute(0,2,1,3).view(" in compact:
        return "camera-major"
    if "key.permute(2,0,1,3).reshape(" in compact and "value.permute(2,0,1,3).reshape(" in compact:
        return "batch-major"
    return None
