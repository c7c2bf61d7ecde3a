"""LOONGKIT_COMPILE_RESNET: torch.compile the stages (``res_layers``) of mmdet's ResNet backbone.

``ResNet.__init__`` (mmdet 1.x-3.x, ``mmdet.models.backbones.resnet``; subclasses such as ResNeXt and
ResNetV1d go through it) is wrapped: once the original has built the stages, each stage named in
``self.res_layers`` gets a compiled call (see :mod:`.common`; compiling is lazy, at its first forward).
Nothing else of the backbone changes, so what must keep working does:

* ``frozen_stages``, ``norm_eval``, ``train()``/``eval()``: they set ``requires_grad`` and BatchNorm
  ``training`` on the same modules; dynamo guards on both, so a switch selects (or compiles once) the
  graph for the new mode rather than running a stale one.
* ``with_cp``: a stage whose blocks checkpoint stays eager. mmdet calls ``torch.utils.checkpoint``
  without ``use_reentrant``, i.e. the reentrant variant, which dynamo cannot put in a graph (it
  graph-breaks around every block and the recomputation in backward reruns the eager closure anyway):
  compiling would cost compile time for no speed, and the memory saving the user asked for stays
  exactly as configured only in eager.
* checkpoints: ``state_dict`` keys are unchanged (no ``_orig_mod.``); deep copies (EMA) are eager.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl
from loongkit_ops.compile._patch import after_init
from loongkit_ops.compile.common import Compiler


def has_checkpointing(stage: Any) -> bool:
    return any(bool(getattr(m, "with_cp", False)) for m in stage.modules())


class CompileResNet(FeatureImpl):
    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        import torch

        assert target is not None
        module = sys.modules.get(target) or importlib.import_module(target)
        cls = getattr(module, "ResNet", None)
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise NotApplicable(f"{target} has no ResNet nn.Module class")
        if "__init__" not in cls.__dict__:
            raise NotApplicable(f"{target}.ResNet defines no __init__")
        compiler = Compiler(ctx)  # its modules go back to eager at the feature's undo
        after_init(ctx, cls, compiler, lambda resnet: self.compile_stages(compiler, resnet))
        ctx.log.info("ResNet stages will be compiled at construction", cls=f"{target}.ResNet")

    @staticmethod
    def compile_stages(compiler: Compiler, resnet: Any) -> None:
        import torch

        owner = type(resnet).__name__
        names = getattr(resnet, "res_layers", None)
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            compiler.keep_eager(owner, "no res_layers list of stage names")
            return
        for name in names:
            stage = getattr(resnet, name, None)
            label = f"{owner}.{name}"
            if not isinstance(stage, torch.nn.Module):
                compiler.keep_eager(label, "not an nn.Module")
            elif has_checkpointing(stage):
                compiler.keep_eager(label, "with_cp (reentrant checkpoint kept eager)")
            else:
                compiler.compile_module(stage, label, group=label)
