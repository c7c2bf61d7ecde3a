"""The ``loongkit::*`` torch.library custom ops, one module per op.

Each module holds its op's definition, fake (meta) impl, autograd, the dispatch to the C++ kernel
(``kernels/cpu/``) or the Triton kernel (``kernels/triton/``), and its plain-torch reference (the
tests' fp64 oracle and the fallback when no kernel can run); :mod:`.dispatch` is what they share.

========================  ==================================================================
module                    op(s)
========================  ==================================================================
:mod:`.msda`              ``loongkit::ms_deform_attn`` (+ ``_backward``)
:mod:`.msda_fused`        ``loongkit::ms_deform_attn_fused`` (+ ``_backward``)
:mod:`.daf`               ``loongkit::deformable_aggregation`` (+ ``_backward``)
:mod:`.bev_pool`          ``loongkit::bev_pool`` (+ ``_backward``)
:mod:`.dice_stats`        ``loongkit::dice_stats`` (+ ``_backward``)
:mod:`.dice_class_stats`  ``loongkit::dice_class_stats`` (+ ``_backward``)
:mod:`.voxelize`          ``loongkit::hard_voxelize``, ``loongkit::dynamic_voxelize``
========================  ==================================================================

Every module names its parts alike: ``backend(t) -> (backend, why)``, ``op``, ``backward_op``,
``reference``. Being custom ops (not autograd.Functions), they are opaque single nodes to
torch.compile: dynamo and AOTAutograd trace them through their fake impls, without graph breaks.
Importing this package imports no op (each module registers its own ops when imported).
"""
