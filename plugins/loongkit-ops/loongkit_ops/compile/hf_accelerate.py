"""LOONGKIT_HF_ACC_COMPILE (torch 2.10.x): Accelerate's torch.compile training, with inductor.

Three patches, installed when ``accelerate`` is imported:

* ``Accelerator.__init__``: when the user chose no dynamo backend (no ``dynamo_backend``, no
  ``dynamo_plugin`` argument, ``ACCELERATE_DYNAMO_BACKEND`` unset or ``no`` as ``accelerate launch``
  writes it by default) the Accelerator is built with ``dynamo_backend="inductor"``, so ``prepare()``
  compiles the model. A backend the user chose is kept.
* ``Accelerator.prepare_model``: the ``torch.compile``d model it returns gets our guard on its compiled
  forward (see :mod:`.common`): a compile error at run time falls back to the eager model, logged and
  shown in the Summary, and compile time and memory are measured.
* transformers 4.57.*: the flash-attention-2 entry of ``AttentionInterface`` (what the models' attention
  layers call as ``attention_interface``) is wrapped in ``torch.compiler.disable``: dynamo then runs it
  outside the graph instead of tracing into flash-attn's unpadding (data-dependent ``.item()`` sizes,
  a C extension), which is where compiling those models crashes on torch 2.10.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from loongkit_core import requirements
from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl
from loongkit_ops.compile.common import MARK, Compiler

FA2_KEY = "flash_attention_2"
FA2_TRANSFORMERS = "4.57."
ENV_BACKEND = "ACCELERATE_DYNAMO_BACKEND"


def transformers_affected() -> bool:
    found = requirements.installed("transformers")
    return found is not None and found.version.startswith(FA2_TRANSFORMERS)


class HFAccCompile(FeatureImpl):
    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        import torch

        module = sys.modules.get("accelerate") or importlib.import_module("accelerate")
        accelerator = getattr(module, "Accelerator", None)
        if not isinstance(accelerator, type) or not callable(getattr(accelerator, "prepare_model", None)):
            raise NotApplicable("accelerate has no Accelerator.prepare_model")
        compiler = Compiler(ctx, extra={"switched_on": 0, "user_backend": None, "fa2_disabled": None})
        config = compiler.config
        original_init = accelerator.__init__
        original_prepare = accelerator.prepare_model

        def __init__(acc: Any, *args: Any, **kwargs: Any) -> None:
            env = os.environ.get(ENV_BACKEND, "").strip().lower()
            chosen = kwargs.get("dynamo_backend") or kwargs.get("dynamo_plugin") or env not in ("", "no")
            if not chosen:
                kwargs["dynamo_backend"] = "inductor"
                config["switched_on"] += 1
                ctx.log.info("Accelerator built with dynamo_backend=inductor")
            else:
                config["user_backend"] = str(kwargs.get("dynamo_backend") or kwargs.get("dynamo_plugin") or env)
            original_init(acc, *args, **kwargs)

        def prepare_model(acc: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
            before = model
            prepared = original_prepare(acc, model, *args, **kwargs)
            optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
            optimized = getattr(optimized, "OptimizedModule", None)
            if (optimized is not None and isinstance(prepared, optimized) and prepared is not before
                    and "forward" in prepared.__dict__ and not getattr(prepared.forward, MARK, None)):
                inner = prepared._orig_mod
                prepared.forward = compiler.guard(prepared.forward, inner.__call__, type(inner).__name__)
            return prepared

        __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
        prepare_model.__wrapped__ = original_prepare  # type: ignore[attr-defined]
        ctx.patcher.patch(accelerator, "__init__", __init__)
        ctx.patcher.patch(accelerator, "prepare_model", prepare_model)
        scratch = ctx.scratch  # dead at undo: a pending import hook of an undone activation then does nothing
        if transformers_affected():
            ctx.on_import("transformers.modeling_utils",
                          lambda mod: self._disable_fa2(ctx, mod, config) if scratch.live else None)
        else:
            config["fa2_disabled"] = "not needed (transformers is not 4.57.*)"
        ctx.log.info("Accelerate compile armed", backend="inductor")

    def _disable_fa2(self, ctx: ActivationContext, modeling_utils: Any, config: dict[str, Any]) -> None:
        import torch

        interface = getattr(modeling_utils, "AttentionInterface", None)
        mapping = getattr(interface, "_global_mapping", None)
        original = mapping.get(FA2_KEY) if isinstance(mapping, dict) else None
        if original is None or getattr(ctx.scratch, "fa2", None) is not None:
            config["fa2_disabled"] = config["fa2_disabled"] or "no flash_attention_2 entry in AttentionInterface"
            return
        wrapped = torch.compiler.disable(original)
        ctx.patcher.set_item(mapping, FA2_KEY, wrapped)
        ctx.scratch.fa2 = (mapping, original, wrapped)
        config["fa2_disabled"] = "flash_attention_2 attention_interface runs outside the compiled graph"
        ctx.log.info("flash_attention_2 attention_interface excluded from compilation (transformers 4.57)")
