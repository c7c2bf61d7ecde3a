"""LOONGKIT_COMPILE_PI0PYTORCH: torch.compile the pi0 PyTorch policy's forward (the flow-matching loss).

The policy module is openpi's ``PI0Pytorch`` (``openpi.models_pytorch.pi0_pytorch``), which lerobot
ports as ``lerobot.policies.pi0.modeling_pi0.PI0Pytorch`` and wraps in ``PI0Policy``. What is compiled is
what the published training loops call: lerobot's ``PI0Policy.forward`` calls ``self.model.forward(...)``
directly (bypassing ``nn.Module.__call__``), openpi's trainer calls the module. So ``PI0Pytorch.forward``
is patched on the class to dispatch each instance built while the feature is on to its compiled forward
(``_patch.CompiledMethod``); a module call reaches it through ``_call_impl``. ``sample_actions``
(inference, with a KV cache) is left as is.

The upstream switches, as they are: lerobot's ``config.compile_model`` assigns a compiled
``self.forward`` (and ``sample_actions``) on the instance, which is then left alone (compiling it twice
would only nest two compilers); openpi's ``pytorch_compile_mode`` compiles ``sample_actions`` only, so
the training forward is still compiled here.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl
from loongkit_ops.compile._patch import CompiledMethod, after_init
from loongkit_ops.compile.common import Compiler

CLASS = "PI0Pytorch"


class CompilePi0(FeatureImpl):
    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        import torch

        assert target is not None
        module = sys.modules.get(target) or importlib.import_module(target)
        cls = getattr(module, CLASS, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise NotApplicable(f"{target} has no {CLASS} nn.Module class")
        if "__init__" not in cls.__dict__ or "forward" not in cls.__dict__:
            raise NotApplicable(f"{target}.{CLASS} defines no __init__/forward")
        compiler = getattr(ctx.scratch, "compiler", None)  # forgotten (and its modules eager) at undo
        if compiler is None:  # both targets (lerobot and openpi) report into one Summary config
            compiler = ctx.scratch.compiler = Compiler(ctx)
        group = f"{target}.{CLASS}"

        forward = CompiledMethod(ctx, cls, "forward")

        def step(policy: Any) -> None:
            if "forward" in policy.__dict__:
                compiler.keep_eager(group, "already compiled by config.compile_model")
                return
            forward.install(policy, compiler.compile_method(forward.original, group, group))

        after_init(ctx, cls, compiler, step)
        ctx.log.info("pi0 policy forward will be compiled at construction (called or as .forward)", cls=group)
