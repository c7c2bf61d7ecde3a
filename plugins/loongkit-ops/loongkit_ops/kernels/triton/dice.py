"""Dice loss statistics in Triton: mmseg 1.x ``dice_stats`` and mmseg 0.x ``dice_class_stats``.

Same semantics as the C++ kernels (cpu/dice.cpp) and the references of ``kernels/ops/dice_stats.py`` and
``kernels/ops/dice_class_stats.py``:

- dice_stats, per sample n over kept classes and pixels: a = sum p*t, b = sum p^2 (naive: sum p),
  c = sum t^2 (the number of labelled pixels); p = identity (0) / sigmoid (1) / softmax over C (2) of
  the logits, t = one-hot of clamp(label, 0, C) without the extra class C (labels >= C, e.g. 255,
  have no class; negative labels are class 0); class ``drop_class`` (when in [0, C)) is left out.
- dice_class_stats, per (sample, class): A = sum p*t*valid, B = sum p^e, T = sum t^e, with p =
  softmax over C, t = one-hot of clamp(label, 0, C-1) (an ignored 255 counts in class C-1's T) and
  valid = label != ignore_index, which masks A only.

One program per (sample, block of pixels) reads the [C, BLOCK_S] logits tile once (classes are H*W
apart, so each class row of the tile is a contiguous load), computes the activation in-kernel and
writes its partial sums; the partials are then added by torch in a fixed order (deterministic,
unlike atomics). Arithmetic is float32 for fp16/bf16/fp32 and float64 for float64; partials are
added in float64. The backward recomputes p from the logits (nothing but the inputs is saved).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _probs(logits, n, blk, C, S, ACT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
           ACC: tl.constexpr):
    """p [BLOCK_C, BLOCK_S] (zero outside the tile's C x S bounds), the pixel offsets and masks."""
    cs = tl.arange(0, BLOCK_C)
    s = blk * BLOCK_S + tl.arange(0, BLOCK_S)
    cmask = cs < C
    smask = s < S
    valid = cmask[:, None] & smask[None, :]
    x = tl.load(logits + n * C * S + cs[:, None] * S + s[None, :], mask=valid, other=0.0).to(ACC)
    if ACT == 2:
        x = tl.where(cmask[:, None], x, float("-inf"))  # padding classes get probability 0
        e = tl.exp(x - tl.max(x, axis=0)[None, :])
        p = e / tl.sum(e, axis=0)[None, :]
    elif ACT == 1:
        p = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = x
    return tl.where(valid, p, 0.0), cs, s, cmask, smask, valid


@triton.jit
def _stats_fwd(logits, target, part, C, S, NB, DROP, ACT: tl.constexpr, NAIVE: tl.constexpr,
               BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, ACC: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1).to(tl.int64)
    p, cs, s, cmask, smask, _ = _probs(logits, n, blk, C, S, ACT, BLOCK_C, BLOCK_S, ACC)
    lab = tl.load(target + n * S + s, mask=smask, other=C)
    k = tl.minimum(tl.maximum(lab, 0), C)  # upstream clamps before one_hot; class C is dropped
    keep = cmask & (cs != DROP)
    onehot = (cs[:, None] == k[None, :]) & keep[:, None] & smask[None, :]
    bterm = p if NAIVE else p * p
    a = tl.sum(tl.where(onehot, p, 0.0))
    b = tl.sum(tl.where(keep[:, None], bterm, 0.0))
    t = tl.sum(onehot.to(ACC))
    out = part + (n * NB + blk) * 3
    tl.store(out, a)
    tl.store(out + 1, b)
    tl.store(out + 2, t)


@triton.jit
def _stats_bwd(logits, target, gstats, glogits, C, S, DROP, ACT: tl.constexpr, NAIVE: tl.constexpr,
               BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, ACC: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1).to(tl.int64)
    p, cs, s, cmask, smask, valid = _probs(logits, n, blk, C, S, ACT, BLOCK_C, BLOCK_S, ACC)
    lab = tl.load(target + n * S + s, mask=smask, other=C)
    k = tl.minimum(tl.maximum(lab, 0), C)
    keep = cmask & (cs != DROP)
    onehot = (cs[:, None] == k[None, :]) & keep[:, None] & smask[None, :]
    ga = tl.load(gstats + 3 * n).to(ACC)
    gb = tl.load(gstats + 3 * n + 1).to(ACC)
    # d(stats)/dp: ga*t + gb*(2p | 1) on kept classes, 0 on the dropped one.
    db = tl.zeros_like(p) + gb if NAIVE else 2.0 * gb * p
    gp = tl.where(keep[:, None] & smask[None, :], db, 0.0) + tl.where(onehot, ga, 0.0)
    if ACT == 2:
        dot = tl.sum(p * gp, axis=0)
        g = p * (gp - dot[None, :])
    elif ACT == 1:
        g = gp * p * (1.0 - p)
    else:
        g = gp
    tl.store(glogits + n * C * S + cs[:, None] * S + s[None, :], g.to(glogits.dtype.element_ty), mask=valid)


@triton.jit
def _pow(p, expo, POW: tl.constexpr):
    """p^e for p >= 0, e > 0 (POW 1 and 2 exact; otherwise exp(e*log p), and 0 at p = 0)."""
    if POW == 2:
        return p * p
    elif POW == 1:
        return p
    else:
        return tl.where(p > 0, tl.exp(expo * tl.log(tl.where(p > 0, p, 1.0))), 0.0)


@triton.jit
def _class_fwd(logits, target, expo_ptr, part, C, S, NB, IGNORE, POW: tl.constexpr,
               BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, ACC: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1).to(tl.int64)
    p, cs, s, cmask, smask, valid = _probs(logits, n, blk, C, S, 2, BLOCK_C, BLOCK_S, ACC)
    expo = tl.load(expo_ptr)
    lab = tl.load(target + n * S + s, mask=smask, other=0)
    k = tl.minimum(tl.maximum(lab, 0), C - 1)  # upstream clamps to C-1: an ignored 255 is class C-1
    onehot = (cs[:, None] == k[None, :]) & smask[None, :]
    counted = onehot & (lab != IGNORE)[None, :]  # the ignore mask applies to A only
    a = tl.sum(tl.where(counted, p, 0.0), axis=1)
    b = tl.sum(tl.where(valid, _pow(p, expo, POW), 0.0), axis=1)
    t = tl.sum(onehot.to(ACC), axis=1)
    out = part + ((n * NB + blk) * C + cs) * 3
    tl.store(out, a, mask=cmask)
    tl.store(out + 1, b, mask=cmask)
    tl.store(out + 2, t, mask=cmask)


@triton.jit
def _class_bwd(logits, target, expo_ptr, gstats, glogits, C, S, IGNORE, POW: tl.constexpr,
               BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, ACC: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1).to(tl.int64)
    p, cs, s, cmask, smask, valid = _probs(logits, n, blk, C, S, 2, BLOCK_C, BLOCK_S, ACC)
    expo = tl.load(expo_ptr)
    lab = tl.load(target + n * S + s, mask=smask, other=0)
    k = tl.minimum(tl.maximum(lab, 0), C - 1)
    counted = (cs[:, None] == k[None, :]) & smask[None, :] & (lab != IGNORE)[None, :]
    g = gstats + (n * C + cs) * 3
    ga = tl.load(g, mask=cmask, other=0.0).to(ACC)
    gb = tl.load(g + 1, mask=cmask, other=0.0).to(ACC)
    # dB/dp = e * p^(e-1); dA/dp = t * valid.
    if POW == 2:
        db = 2.0 * gb[:, None] * p
    elif POW == 1:
        db = tl.zeros_like(p) + gb[:, None]
    else:
        # p^(e-1) as pow gives it, also at p = 0 (an underflowed softmax): 0 for e > 1, inf for e < 1.
        pe1 = tl.exp((expo - 1.0) * tl.log(tl.where(p > 0, p, 1.0)))
        pe1 = tl.where(p > 0, pe1, tl.where(expo > 1.0, 0.0, float("inf")))
        db = gb[:, None] * expo * pe1
    gp = tl.where(valid, db, 0.0) + tl.where(counted, ga[:, None], 0.0)
    dot = tl.sum(p * gp, axis=0)
    tl.store(glogits + n * C * S + cs[:, None] * S + s[None, :], (p * (gp - dot[None, :])).to(glogits.dtype.element_ty),
             mask=valid)


def _acc(dtype: torch.dtype) -> tuple[tl.dtype, torch.dtype]:
    return (tl.float64, torch.float64) if dtype == torch.float64 else (tl.float32, torch.float32)


def _blocks(c: int, s: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_S): every class in one tile of about 4096 elements (2048 in float64, for registers)."""
    block_c = triton.next_power_of_2(max(c, 1))
    tile = 2048 if dtype == torch.float64 else 4096
    return block_c, max(1, min(triton.next_power_of_2(max(s, 1)), max(16, tile // block_c)))


_WARPS = 8  # a 4096-element tile over 256 threads: 16 values per thread per live array


def _check_activation(activation: int) -> None:
    if activation not in (0, 1, 2):  # the C++ kernel's check, same exception type
        raise RuntimeError(f"activation must be 0, 1 or 2, not {activation}")


def _check_class(c: int, exponent: float) -> None:
    if not (exponent > 0 and c > 0):
        raise RuntimeError(f"exponent must be > 0 (got {exponent}) and there must be a class (got {c})")


def _pow_mode(exponent: float) -> int:
    return 2 if exponent == 2.0 else (1 if exponent == 1.0 else 0)


def stats_forward(logits: Tensor, target: Tensor, activation: int, drop_class: int, naive: bool) -> Tensor:
    """[N, 3] per-sample (a, b, c); logits contiguous [N, C, S], target contiguous int64 [N, S]."""
    _check_activation(activation)
    n, c, s = logits.shape
    acc, acc_torch = _acc(logits.dtype)
    block_c, block_s = _blocks(c, s, logits.dtype)
    nb = triton.cdiv(s, block_s)
    part = torch.empty(n, nb, 3, dtype=acc_torch, device=logits.device)
    if part.numel() == 0 or c == 0:
        return logits.new_zeros(n, 3)
    _stats_fwd[(n, nb)](logits, target, part, c, s, nb, drop_class, ACT=activation, NAIVE=naive,
                        BLOCK_C=block_c, BLOCK_S=block_s, ACC=acc, num_warps=_WARPS)
    return part.sum(1, dtype=torch.float64).to(logits.dtype)


def stats_backward(grad_stats: Tensor, logits: Tensor, target: Tensor, activation: int, drop_class: int,
                   naive: bool) -> Tensor:
    """grad_logits [N, C, S] (contiguous) from grad_stats [N, 3]."""
    _check_activation(activation)
    n, c, s = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if grad.numel() == 0:
        return grad
    acc, _ = _acc(logits.dtype)
    block_c, block_s = _blocks(c, s, logits.dtype)
    _stats_bwd[(n, triton.cdiv(s, block_s))](logits, target, grad_stats.contiguous(), grad, c, s, drop_class,
                                             ACT=activation, NAIVE=naive, BLOCK_C=block_c, BLOCK_S=block_s, ACC=acc,
                                             num_warps=_WARPS)
    return grad


def class_stats_forward(logits: Tensor, target: Tensor, ignore_index: int, exponent: float) -> Tensor:
    """[N, C, 3] per-(sample, class) (A, B, T); logits contiguous [N, C, S], target contiguous int64 [N, S]."""
    n, c, s = logits.shape
    _check_class(c, exponent)
    acc, acc_torch = _acc(logits.dtype)
    block_c, block_s = _blocks(c, s, logits.dtype)
    nb = triton.cdiv(s, block_s)
    part = torch.empty(n, nb, c, 3, dtype=acc_torch, device=logits.device)
    if part.numel() == 0:
        return logits.new_zeros(n, c, 3)
    # The exponent as a tensor of the accumulation dtype: a float argument would be rounded to fp32.
    expo = torch.tensor([exponent], dtype=acc_torch, device=logits.device)
    _class_fwd[(n, nb)](logits, target, expo, part, c, s, nb, ignore_index, POW=_pow_mode(exponent),
                        BLOCK_C=block_c, BLOCK_S=block_s, ACC=acc, num_warps=_WARPS)
    return part.sum(1, dtype=torch.float64).to(logits.dtype)


def class_stats_backward(grad_stats: Tensor, logits: Tensor, target: Tensor, ignore_index: int,
                         exponent: float) -> Tensor:
    """grad_logits [N, C, S] (contiguous) from grad_stats [N, C, 3]."""
    n, c, s = logits.shape
    _check_class(c, exponent)
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if grad.numel() == 0:
        return grad
    acc, acc_torch = _acc(logits.dtype)
    block_c, block_s = _blocks(c, s, logits.dtype)
    expo = torch.tensor([exponent], dtype=acc_torch, device=logits.device)
    _class_bwd[(n, triton.cdiv(s, block_s))](logits, target, expo, grad_stats.contiguous(), grad, c, s,
                                             ignore_index, POW=_pow_mode(exponent), BLOCK_C=block_c,
                                             BLOCK_S=block_s, ACC=acc, num_warps=_WARPS)
    return grad
