"""Entry point of loongkit-ops (operators, compilation, framework fixes): declarations only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loongkit_core.feature import Category, Feature, PolicyDecision
from loongkit_core.kit import PluginSpec

plugin = PluginSpec("ops", distribution="loongkit-ops", category=Category.OPS)


plugin.feature(
    "compile_resnet",
    level=1,
    description="torch.compile the stages of mmdet's ResNet backbone.",
    requires=("torch>=2.6.0", "mmdet>=1.0.0,<=3.3.0"),
    targets=("mmdet.models.backbones.resnet",),
    impl="loongkit_ops.compile.resnet:CompileResNet",
)
plugin.feature(
    "fused_adamw",
    level=1,
    description="AdamW with the fused implementation.",
    requires=("torch>=2.4.0",),
    targets=("torch.optim",),
    impl="loongkit_ops.optim:FusedAdamW",
)
plugin.feature(
    "fused_adam",
    level=1,
    description="Adam with the fused implementation.",
    requires=("torch>=2.4.0",),
    targets=("torch.optim",),
    impl="loongkit_ops.optim:FusedAdam",
)
plugin.feature(
    "openvla",
    level=1,
    description="torch.compile the Llama-2 decoder layers of an OpenVLA-style model.",
    requires=("torch>=2.6.0",),
    targets=("transformers.models.llama.modeling_llama",),
    impl="loongkit_ops.compile.llama:CompileLlama",
)
plugin.feature(
    "mmdet_modules",
    level=1,
    description="torch.compile selected modules registered in mmdet.models.builder.MODELS.",
    requires=("torch>=2.6.0", "mmdet>=2.12.0,<=2.28.3"),
    targets=("mmdet.models.builder",),
    options=("LOONGKIT_COMPILE_MMDET_MODULES_FILTER",),
    impl="loongkit_ops.compile.mmdet_modules:CompileMMDetModules",
)
plugin.feature(
    "dice_loss",
    level=1,
    description="Fused DiceLoss for mmseg 0.x.",
    requires=("mmseg>=0.12.0,<=1.0.0",),
    targets=("mmseg.models.losses.dice_loss",),
    impl="loongkit_ops.patches.dice:DiceLossMmseg0",
)
plugin.feature(
    "dice_loss_mmseg1",
    level=1,
    description="Fused DiceLoss for mmseg >= 1.1 (its rewritten loss; LOONGKIT_DICE_LOSS covers 0.x).",
    requires=("mmseg>=1.1.0",),
    targets=("mmseg.models.losses.dice_loss",),
    impl="loongkit_ops.patches.dice:DiceLossMmseg1",
)
plugin.feature(
    "dag",
    level=1,
    description="Fused deformable aggregation for DeformableFeatureAggregation (Sparse4D).",
    requires=("torch>=2.4.0",),
    targets=("mmengine.registry.registry", "mmcv.utils.registry"),
    impl="loongkit_ops.patches.dag:SparseDAG",
)
plugin.feature(
    "voxelization",
    level=3,
    description="Faster CPU hard_voxelize for mmcv/mmdet3d voxelization (identical output).",
    requires=("torch>=2.4.0",),
    targets=("mmcv.ops.voxelize",),
    impl="loongkit_ops.patches.voxelize:Voxelization",
)
plugin.feature(
    "bevformer",
    level=1,
    description="Fused SpatialCrossAttention / TemporalSelfAttention of BEVFormer.",
    requires=("torch>=2.4.0",),
    targets=("mmcv.ops.multi_scale_deform_attn", "mmcv.utils.registry", "mmengine.registry.registry"),
    impl="loongkit_ops.patches.bevformer:Bevformer",
)
plugin.feature(
    "uniad",
    level=1,
    description="Fused and vectorised modules of UniAD.",
    requires=("torch>=2.4.0",),
    targets=("mmcv.utils.registry", "mmengine.registry.registry"),
    impl="loongkit_ops.patches.uniad:UniAD",
)
plugin.feature(
    "bevfusion",
    level=3,
    description="Fused bev_pool of BEVFusion's camera-to-BEV view transforms.",
    requires=("torch>=2.4.0",),
    targets=("mmengine.registry.registry", "mmcv.utils.registry"),
    impl="loongkit_ops.patches.bevfusion:BevFusionPool",
)
plugin.feature(
    "hf_acc_compile",
    level=3,
    description="torch.compile training with HuggingFace Accelerate (inductor).",
    requires=("torch==2.10.*",),
    targets=("accelerate",),
    impl="loongkit_ops.compile.hf_accelerate:HFAccCompile",
)
plugin.feature(
    "dynamic_shape_fix",
    level=1,
    description="Work around torch 2.9 crashes compiling with dynamic shapes.",
    requires=("torch==2.9.*",),
    targets=("torch._dynamo.config", "torch._inductor.config"),
    impl="loongkit_ops.fixes:DynamicShapeFix",
)
plugin.feature(
    "compile_pi0pytorch",
    level=1,
    description="torch.compile the pi0 PyTorch policy module.",
    requires=("torch>=2.6.0",),
    targets=("lerobot.policies.pi0.modeling_pi0", "openpi.models_pytorch.pi0_pytorch"),
    impl="loongkit_ops.compile.pi0:CompilePi0",
)
plugin.feature(
    "donated_buffer_fix",
    level=1,
    description="Disable donated_buffer where DDPOptimizer silently overwrites weights.",
    requires=("torch>=2.6.0,<2.9",),
    targets=("torch._dynamo.backends.distributed",),
    impl="loongkit_ops.fixes:DonatedBufferFix",
)


@plugin.policy
def fused_adamw_policy(hardware: Any, features: Sequence[Feature]) -> Mapping[str, PolicyDecision]:
    """The seed's hardware policy: FUSED_ADAMW off by default on NVIDIA GPUs, on for Pingtouge PPU."""
    vendors = hardware.gpu_vendors
    if "ppu" in vendors:
        return {"fused_adamw": PolicyDecision(
            reason="Pingtouge PPU: fused AdamW improves every model type", enabled_by_default=True)}
    if "nvidia" in vendors:
        return {"fused_adamw": PolicyDecision(
            reason="NVIDIA GPU: fused AdamW can slow some models (LOONGKIT_FUSED_ADAMW=1 forces it)",
            enabled_by_default=False)}
    return {}


# Features that torch.compile a model: the product targets GPU training, where compilation pays.
COMPILE_FEATURES = ("compile_resnet", "openvla", "mmdet_modules", "compile_pi0pytorch", "hf_acc_compile")


@plugin.policy
def cpu_compile_policy(hardware: Any, features: Sequence[Feature]) -> Mapping[str, PolicyDecision]:
    """No accelerator: compile features off under LOONGKIT_ALL (the explicit variable still enables one).

    Measured here (2 vCPU, torch 2.13 inductor): the mmdet RetinaNet-R18 example's median step went
    from 373 to 427 ms with COMPILE_RESNET after a 19 s compile, i.e. a level-1 "no degradation by
    default" promise that CPU training would break (examples/mmdet_retinanet, README)."""
    if hardware.accelerators:
        return {}
    reason = ("no GPU/PPU found: CPU inductor compilation costs tens of seconds and was measured slower on "
              "the detection example; set the feature's variable to 1 to compile anyway")
    return {name: PolicyDecision(reason=reason, enabled_by_default=False) for name in COMPILE_FEATURES}
