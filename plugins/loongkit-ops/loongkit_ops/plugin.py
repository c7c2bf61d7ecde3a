"""Entry point of loongkit-ops (operators, compilation, framework fixes): declarations only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loongkit_core.feature import Category, Feature, PolicyDecision
from loongkit_core.kit import PluginSpec
from loongkit_ops import __version__

plugin = PluginSpec("ops", distribution="loongkit-ops")


def _declare(name: str, level: int, description: str, requires: tuple[str, ...] = (),
             targets: tuple[str, ...] = (), options: tuple[str, ...] = (), env: str | None = None,
             impl: str | None = None) -> None:
    plugin.add(
        Feature(
            name=name,
            env=env or f"LOONGKIT_{name.upper()}",
            level=level,
            category=Category.OPS,
            description=description,
            requires=requires,
            targets=targets,
            options=options,
            implemented=impl is not None,
            plugin_version=__version__,
        ),
        impl=impl,
    )


_declare("compile_resnet", 1, "torch.compile the stages of mmdet's ResNet backbone.",
         ("torch>=2.6.0", "mmdet>=1.0.0,<=3.3.0"), ("mmdet.models.backbones.resnet",),
         impl="loongkit_ops.compile.resnet:CompileResNet")
_declare("fused_adamw", 1, "AdamW with the fused implementation.", ("torch>=2.4.0",), ("torch.optim",),
         impl="loongkit_ops.optim:FusedAdamW")
_declare("fused_adam", 1, "Adam with the fused implementation.", ("torch>=2.4.0",), ("torch.optim",),
         impl="loongkit_ops.optim:FusedAdam")
_declare("openvla", 1, "torch.compile the Llama-2 decoder layers of an OpenVLA-style model.",
         ("torch>=2.6.0",), ("transformers.models.llama.modeling_llama",),
         impl="loongkit_ops.compile.llama:CompileLlama")
_declare("mmdet_modules", 1, "torch.compile selected modules registered in mmdet.models.builder.MODELS.",
         ("torch>=2.6.0", "mmdet>=2.12.0,<=2.28.3"), ("mmdet.models.builder",),
         ("LOONGKIT_COMPILE_MMDET_MODULES_FILTER",), impl="loongkit_ops.compile.mmdet_modules:CompileMMDetModules")
_declare("dice_loss", 1, "Fused DiceLoss for mmseg 0.x.", ("mmseg>=0.12.0,<=1.0.0",),
         ("mmseg.models.losses.dice_loss",), impl="loongkit_ops.patches.dice:DiceLossMmseg0")
_declare("dice_loss_mmseg1", 1, "Fused DiceLoss for mmseg >= 1.1 (its rewritten loss; LOONGKIT_DICE_LOSS covers 0.x).",
         ("mmseg>=1.1.0",), ("mmseg.models.losses.dice_loss",), impl="loongkit_ops.patches.dice:DiceLossMmseg1")
_declare("dag", 1, "Fused deformable aggregation for DeformableFeatureAggregation (Sparse4D).", ("torch>=2.4.0",),
         ("mmengine.registry.registry", "mmcv.utils.registry"), impl="loongkit_ops.patches.dag:SparseDAG")
_declare("voxelization", 3, "Faster CPU hard_voxelize for mmcv/mmdet3d voxelization (identical output).",
         ("torch>=2.4.0",), ("mmcv.ops.voxelize",), impl="loongkit_ops.patches.voxelize:Voxelization")
_declare("bevformer", 1, "Fused SpatialCrossAttention / TemporalSelfAttention of BEVFormer.", ("torch>=2.4.0",),
         ("mmcv.ops.multi_scale_deform_attn", "mmcv.utils.registry", "mmengine.registry.registry"),
         impl="loongkit_ops.patches.bevformer:Bevformer")
_declare("uniad", 1, "Fused and vectorised modules of UniAD.", ("torch>=2.4.0",),
         ("mmcv.utils.registry", "mmengine.registry.registry"), impl="loongkit_ops.patches.uniad:UniAD")
_declare("bevfusion", 3, "Fused bev_pool of BEVFusion's camera-to-BEV view transforms.", ("torch>=2.4.0",),
         ("mmengine.registry.registry", "mmcv.utils.registry"), impl="loongkit_ops.patches.bevfusion:BevFusionPool")
_declare("hf_acc_compile", 3, "torch.compile training with HuggingFace Accelerate (inductor).",
         ("torch==2.10.*",), ("accelerate",), impl="loongkit_ops.compile.hf_accelerate:HFAccCompile")
_declare("dynamic_shape_fix", 1, "Work around torch 2.9 crashes compiling with dynamic shapes.",
         ("torch==2.9.*",), ("torch._dynamo.config", "torch._inductor.config"),
         impl="loongkit_ops.fixes:DynamicShapeFix")
_declare("compile_pi0pytorch", 1, "torch.compile the pi0 PyTorch policy module.", ("torch>=2.6.0",),
         ("lerobot.policies.pi0.modeling_pi0", "openpi.models_pytorch.pi0_pytorch"),
         impl="loongkit_ops.compile.pi0:CompilePi0")
_declare("donated_buffer_fix", 1, "Disable donated_buffer where DDPOptimizer silently overwrites weights.",
         ("torch>=2.6.0,<2.9",), ("torch._dynamo.backends.distributed",),
         impl="loongkit_ops.fixes:DonatedBufferFix")


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
