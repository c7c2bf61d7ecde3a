"""LOONGKIT_OPENVLA: torch.compile the Llama-2 decoder layers of an OpenVLA-style model.

OpenVLA's language backbone is a Hugging Face ``LlamaForCausalLM``; its time goes to the stack of
``LlamaDecoderLayer``. ``LlamaDecoderLayer.__init__`` (``transformers.models.llama.modeling_llama``) is
wrapped so every layer gets a compiled call (see :mod:`.common`). All layers share one compiled graph
per mode: the code object is shared by the group "LlamaDecoderLayer" and dynamo lifts each layer's
parameters as graph inputs, so a 32-layer model compiles once, not 32 times.

Gradient checkpointing set by transformers (``GradientCheckpointingLayer.__call__``) wraps the layer's
``Module.__call__`` from outside, so it checkpoints the compiled layer and keeps working. A layer whose
compile fails (a cache object dynamo cannot trace during generation, say) runs eagerly from then on.
"""

from __future__ import annotations

import importlib
import sys

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl
from loongkit_ops.compile._patch import after_init
from loongkit_ops.compile.common import Compiler

CLASS = "LlamaDecoderLayer"


class CompileLlama(FeatureImpl):
    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        import torch

        assert target is not None
        module = sys.modules.get(target) or importlib.import_module(target)
        cls = getattr(module, CLASS, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise NotApplicable(f"{target} has no {CLASS} nn.Module class")
        if "__init__" not in cls.__dict__:
            raise NotApplicable(f"{target}.{CLASS} defines no __init__")
        compiler = Compiler(ctx)  # its layers go back to eager at the feature's undo
        after_init(ctx, cls, compiler, lambda layer: compiler.compile_module(layer, CLASS, group=CLASS))
        ctx.log.info("Llama decoder layers will be compiled at construction", cls=f"{target}.{CLASS}")
