"""``loongkit::dice_stats``: the per-sample sums of mmseg >= 1.1's DiceLoss in one pass over the logits.

logits [N, C, S], labels [N, S] -> [N, 3]. Kernels: ``cpu/dice.cpp``, ``triton/dice.py``;
:func:`reference` otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from loongkit_ops import kernels
from loongkit_ops.kernels.ops import dispatch

ACTIVATIONS = {"none": 0, "sigmoid": 1, "softmax": 2}


def backend(logits: Tensor) -> tuple[str, str]:
    """('cpu' | 'triton' | 'reference', why) for a call on ``logits``."""
    return dispatch.backend(logits, "fused Dice", triton_module="dice")


def reference(logits: Tensor, target: Tensor, activation: int, drop_class: int, naive: bool) -> Tensor:
    """Per-sample (sum p*t, sum p^2 or sum p, sum t^2) of mmseg 1.x DiceLoss; logits [N, C, S], target [N, S].

    activation: 0 identity, 1 sigmoid, 2 softmax over C. t is the one-hot of clamp(target, 0, C)
    without the extra class C; class ``drop_class`` (if in range) is left out of every sum.
    """
    n, c, _ = logits.shape
    if activation == 1:
        p = torch.sigmoid(logits)
    elif activation == 2:
        p = torch.softmax(logits, dim=1)
    else:
        p = logits
    labels = target.clamp(0, c)
    onehot = (labels[:, None, :] == torch.arange(c, device=logits.device)[None, :, None]).to(p.dtype)
    keep = torch.ones(c, dtype=p.dtype, device=p.device)
    if 0 <= drop_class < c:
        keep[drop_class] = 0
    keep = keep[None, :, None]
    a = (p * onehot * keep).sum((1, 2))
    b = ((p if naive else p * p) * keep).sum((1, 2))
    t = (onehot * keep).sum((1, 2))
    return torch.stack([a, b, t], 1).reshape(n, 3)


@dispatch.custom_op("loongkit::dice_stats")
def op(logits: Tensor, target: Tensor, activation: int, drop_class: int, naive: bool) -> Tensor:
    """[N, 3] per-sample (sum p*t, sum p^2 | sum p, sum t^2) of logits [N, C, S] and labels [N, S]."""
    which, _ = backend(logits)
    if which == "reference":
        return reference(logits, target, activation, drop_class, naive)
    if which == "triton":
        return dispatch.triton("dice").stats_forward(logits.contiguous(), target.to(torch.int64).contiguous(),
                                                     activation, drop_class, naive)
    stats = logits.new_empty(logits.shape[0], 3)
    kernels.load().dice_stats_forward(logits.contiguous(), target.to(torch.int64).contiguous(), activation,
                                      drop_class, naive, stats)
    return stats


@op.register_fake
def _(logits: Tensor, target: Tensor, activation: int, drop_class: int, naive: bool) -> Tensor:
    torch._check(logits.dim() == 3 and target.dim() == 2)
    return logits.new_empty(logits.shape[0], 3)


@dispatch.custom_op("loongkit::dice_stats_backward")
def backward_op(grad_stats: Tensor, logits: Tensor, target: Tensor, activation: int, drop_class: int,
                naive: bool) -> Tensor:
    which, _ = backend(logits)
    if which == "reference":
        _, vjp = torch.func.vjp(lambda x: reference(x, target, activation, drop_class, naive), logits)
        return vjp(grad_stats)[0].contiguous()
    if which == "triton":
        return dispatch.triton("dice").stats_backward(grad_stats.contiguous(), logits.contiguous(),
                                                      target.to(torch.int64).contiguous(), activation, drop_class,
                                                      naive)
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    kernels.load().dice_stats_backward(logits.contiguous(), target.to(torch.int64).contiguous(), activation,
                                       drop_class, naive, grad_stats.contiguous(), grad)
    return grad


@backward_op.register_fake
def _(grad_stats: Tensor, logits: Tensor, target: Tensor, activation: int, drop_class: int, naive: bool) -> Tensor:
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    logits, target, activation, drop_class, naive = inputs
    ctx.save_for_backward(logits, target)
    ctx.args = (activation, drop_class, naive)


def _backward(ctx: Any, grad_stats: Tensor) -> tuple[Tensor | None, ...]:
    logits, target = ctx.saved_tensors
    grad = backward_op(grad_stats, logits, target, *ctx.args)
    return grad, None, None, None, None


op.register_autograd(_backward, setup_context=_setup_context)
