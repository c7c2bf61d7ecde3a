"""``loongkit::dice_class_stats``: the per-(sample, class) sums of mmseg 0.x's DiceLoss in one pass.

logits [N, C, S], labels [N, S] -> [N, C, 3]. Kernels: ``cpu/dice.cpp``, ``triton/dice.py``;
:func:`reference` otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from loongkit_ops import kernels
from loongkit_ops.kernels.ops import dispatch


def backend(logits: Tensor) -> tuple[str, str]:
    """('cpu' | 'triton' | 'reference', why) for a call on ``logits``."""
    return dispatch.backend(logits, "fused Dice", triton_module="dice")


def reference(logits: Tensor, target: Tensor, ignore_index: int, exponent: float) -> Tensor:
    """Per-(sample, class) (sum p*t*valid, sum p^e, sum t^e) of mmseg 0.x DiceLoss; [N, C, 3].

    p = softmax over C of logits [N, C, S]; t = one-hot of clamp(target, 0, C-1) (an ignored label
    such as 255 lands in class C-1's t); valid = target != ignore_index masks the first sum only.
    """
    c = logits.shape[1]
    p = torch.softmax(logits, dim=1)
    onehot = (target.clamp(0, c - 1)[:, None, :] == torch.arange(c, device=logits.device)[None, :, None]).to(p.dtype)
    valid = (target != ignore_index).to(p.dtype)[:, None, :]
    a = (p * onehot * valid).sum(2)
    b = p.pow(exponent).sum(2)
    t = onehot.pow(exponent).sum(2)
    return torch.stack([a, b, t], 2)


@dispatch.custom_op("loongkit::dice_class_stats")
def op(logits: Tensor, target: Tensor, ignore_index: int, exponent: float) -> Tensor:
    """[N, C, 3] per-(sample, class) (sum p*t*valid, sum p^e, sum t^e) of logits [N, C, S] and labels [N, S]."""
    which, _ = backend(logits)
    if which == "reference":
        return reference(logits, target, ignore_index, exponent)
    if which == "triton":
        return dispatch.triton("dice").class_stats_forward(logits.contiguous(), target.to(torch.int64).contiguous(),
                                                           ignore_index, exponent)
    stats = logits.new_empty(logits.shape[0], logits.shape[1], 3)
    kernels.load().dice_class_stats_forward(logits.contiguous(), target.to(torch.int64).contiguous(), ignore_index,
                                            exponent, stats)
    return stats


@op.register_fake
def _(logits: Tensor, target: Tensor, ignore_index: int, exponent: float) -> Tensor:
    torch._check(logits.dim() == 3 and target.dim() == 2)
    return logits.new_empty(logits.shape[0], logits.shape[1], 3)


@dispatch.custom_op("loongkit::dice_class_stats_backward")
def backward_op(grad_stats: Tensor, logits: Tensor, target: Tensor, ignore_index: int, exponent: float) -> Tensor:
    which, _ = backend(logits)
    if which == "reference":
        _, vjp = torch.func.vjp(lambda x: reference(x, target, ignore_index, exponent), logits)
        return vjp(grad_stats)[0].contiguous()
    if which == "triton":
        return dispatch.triton("dice").class_stats_backward(grad_stats.contiguous(), logits.contiguous(),
                                                            target.to(torch.int64).contiguous(), ignore_index,
                                                            exponent)
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    kernels.load().dice_class_stats_backward(logits.contiguous(), target.to(torch.int64).contiguous(), ignore_index,
                                             exponent, grad_stats.contiguous(), grad)
    return grad


@backward_op.register_fake
def _(grad_stats: Tensor, logits: Tensor, target: Tensor, ignore_index: int, exponent: float) -> Tensor:
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    logits, target, ignore_index, exponent = inputs
    ctx.save_for_backward(logits, target)
    ctx.args = (ignore_index, exponent)


def _backward(ctx: Any, grad_stats: Tensor) -> tuple[Tensor | None, ...]:
    logits, target = ctx.saved_tensors
    return backward_op(grad_stats, logits, target, *ctx.args), None, None, None


op.register_autograd(_backward, setup_context=_setup_context)
