"""LOONGKIT_ALLOW_TF32: TF32 for FP32 matmul and convolution on CUDA devices (NVIDIA and PPU).

Two torch APIs, chosen by attribute (not by version string):

* torch >= 2.9: ``torch.backends.cuda.matmul.fp32_precision`` and ``torch.backends.cudnn.{conv,rnn}
  .fp32_precision``. The legacy flags are never read there: once the new API has been used,
  reading ``allow_tf32`` or ``get_float32_matmul_precision()`` raises RuntimeError ("mix of the
  legacy and new APIs"; seen on 2.13).
* torch < 2.9: ``torch.backends.cuda.matmul.allow_tf32`` and ``torch.backends.cudnn.allow_tf32``.

The switches are process-global and cheap, so they are set whenever the feature is enabled, even
with no CUDA device (one may appear later). A value the user chose before loongkit is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loongkit_core.context import ActivationContext
from loongkit_core.kit import FeatureImpl

# Defaults of the new API on an untouched process: matmul "none" (inherit = ieee), cuDNN "tf32".
NEW_API_DEFAULTS = {"matmul": "none", "conv": "tf32", "rnn": "tf32"}


def new_api(backends: Any) -> bool:
    """The fp32_precision API exists (torch >= 2.9)."""
    matmul = getattr(getattr(backends, "cuda", None), "matmul", None)
    return matmul is not None and hasattr(matmul, "fp32_precision")


# How a switch is set: plain ``setattr`` for the helpers alone, ``ctx.patcher.assign`` when activated
# (so the default deactivate puts back exactly the values found).
Setter = Callable[[Any, str, Any], object]


def apply_new(backends: Any, assign: Setter = setattr) -> tuple[dict[str, str], dict[str, str]]:
    """Set TF32 through fp32_precision; return (what is in effect, what the user had chosen)."""
    slots = {
        "matmul": backends.cuda.matmul,
        "conv": backends.cudnn.conv,
        "rnn": backends.cudnn.rnn,
    }
    global_choice = getattr(backends, "fp32_precision", "none")
    result: dict[str, str] = {}
    kept: dict[str, str] = {}
    for name, slot in slots.items():
        current = slot.fp32_precision
        if current != NEW_API_DEFAULTS[name]:
            kept[name] = current  # explicitly chosen before loongkit (new or legacy API)
        elif current == "none" and global_choice not in (None, "none"):
            kept[name] = f"{global_choice} (global)"
        else:
            assign(slot, "fp32_precision", "tf32")
        result[name] = kept.get(name, "tf32")
    return result, kept


def apply_legacy(backends: Any, torch: Any, assign: Setter = setattr) -> tuple[dict[str, str], dict[str, str]]:
    """Set TF32 through the legacy flags (torch < 2.9)."""
    kept: dict[str, str] = {}
    precision = torch.get_float32_matmul_precision() if hasattr(torch, "get_float32_matmul_precision") else "highest"
    if precision != "highest":
        kept["matmul"] = f"float32_matmul_precision={precision}"
    else:
        assign(backends.cuda.matmul, "allow_tf32", True)
    assign(backends.cudnn, "allow_tf32", True)  # already the default since torch 1.7; a user's False is unknowable
    result = {"matmul": "tf32" if backends.cuda.matmul.allow_tf32 else "ieee",
              "cudnn": "tf32" if backends.cudnn.allow_tf32 else "ieee"}
    return result, kept


class AllowTF32(FeatureImpl):
    """Every switch goes through ``ctx.patcher`` (assign, and the hook's removal deferred), so the
    default ``deactivate`` restores the values found and removes the hook."""

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        import torch

        backends = torch.backends
        assign = ctx.patcher.assign
        if new_api(backends):
            applied, kept = apply_new(backends, assign)
            config = {"matmul": applied["matmul"], "cudnn": applied["conv"], "cudnn_rnn": applied["rnn"]}
            ctx.detail("api", "fp32_precision")
        else:
            config, kept = apply_legacy(backends, torch, assign)
            ctx.detail("api", "allow_tf32 (legacy)")
        for name, value in kept.items():
            ctx.log.info("kept the user's precision setting", slot=name, value=value)
        ctx.set_config(config)
        if kept:
            ctx.detail("kept_user_settings", kept)
        self._watch_cuda_use(ctx, torch)

    @staticmethod
    def _watch_cuda_use(ctx: ActivationContext, torch: Any) -> None:
        """Count the feature active on the first FP32 matmul/convolution module run on CUDA.

        A global forward pre-hook removes itself after the first hit, so steady state costs nothing;
        without a CUDA device it is not installed at all.
        """
        if not torch.cuda.is_available():
            ctx.waiting("no CUDA device")
            ctx.log.info("TF32 switches set; no CUDA device, so nothing will use them")
            return
        nn = torch.nn
        kinds = (nn.Linear, nn.modules.conv._ConvNd, nn.RNNBase, nn.MultiheadAttention)

        def first_cuda_use(module: Any, args: Any) -> None:
            if not isinstance(module, kinds):
                return
            weight = next(module.parameters(recurse=False), None)
            if weight is not None and weight.is_cuda and weight.dtype == torch.float32:
                ctx.count()
                ctx.waiting("")
                handle.remove()  # idempotent: the deferred removal at undo is then a no-op

        handle = torch.nn.modules.module.register_module_forward_pre_hook(first_cuda_use)
        ctx.patcher.defer(handle.remove)
        ctx.waiting("no FP32 matmul/convolution ran on CUDA")
