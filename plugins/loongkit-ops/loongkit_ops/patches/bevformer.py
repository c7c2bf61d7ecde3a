"""LOONGKIT_BEVFORMER: mmcv's MultiScaleDeformableAttention and BEVFormer's attention classes.

Three targets. ``mmcv.ops.multi_scale_deform_attn``: mmcv's CPU sampling function on the fused op
(:mod:`.msda`). ``mmcv.utils.registry`` / ``mmengine.registry.registry``: BEVFormer (and UniAD, which
vendors its encoder) lives in the user's tree as ``projects/mmdet3d_plugin/bevformer/modules/*.py``;
its classes register themselves in mmcv 1.x's ``ATTENTION`` registry (or mmengine's ``MODELS`` in 2.x
ports), where :class:`.model_classes.ModelClasses` finds them by name (:data:`.bevformer_source.SPECS`)
and checks them before patching:

- ``SpatialCrossAttention``: batched gather/scatter over cameras (:mod:`.bevformer_sca`);
- ``MSDeformableAttention3D``, ``TemporalSelfAttention``, ``CustomMSDeformableAttention`` (decoder):
  the sampling function in their module on the fused op, and for the first two, when their source
  shows upstream's maths, the fused forward (:mod:`.bevformer_fused`).

No kernel is built when the registries are imported (every OpenMMLab program imports them), only at
the first call that needs it. Every change goes through ``ctx.patcher``: the default ``deactivate``
undoes all of it, registry subscriptions included.
"""

from __future__ import annotations

import sys

from loongkit_core.context import ActivationContext
from loongkit_core.kit import FeatureImpl
from loongkit_ops.patches import bevformer_fused, bevformer_sca, msda
from loongkit_ops.patches.bevformer_source import SPECS
from loongkit_ops.patches.model_classes import ModelClasses, Patch

REGISTRY_TARGETS = ("mmcv.utils.registry", "mmengine.registry.registry")
# How each kind of BEVFormer class is patched (the kinds of bevformer_source.SPECS); UNIAD reuses them.
PATCHES: dict[str, Patch] = {"sca": bevformer_sca.patch, "msda": bevformer_fused.patch}


class Bevformer(FeatureImpl):
    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        if target in REGISTRY_TARGETS:
            ModelClasses.of(ctx, SPECS, PATCHES).watch(target)
            return
        msda.patch_mmcv(ctx, sys.modules[target or self.feature.targets[0]])
        classes = ModelClasses.of(ctx, SPECS, PATCHES)  # one Summary row for both parts
        classes.row("mmcv.MultiScaleDeformableAttention", "loongkit::ms_deform_attn (CPU)")
        classes.refresh()
