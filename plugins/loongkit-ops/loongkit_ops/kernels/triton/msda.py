"""Multi-scale deformable attention in Triton (forward and backward).

One program per (batch, query, head); the C channels of a value row are one vector (BLOCK_C lanes,
masked). Accumulation is float32 for fp16/bf16/fp32 inputs and float64 for float64. The backward
scatters grad_value with atomic adds (on a GPU, unlike the CPU kernel, atomics are cheap and the
alternative private buffers would cost memory per program); grad_value is accumulated in float32
(or float64) and cast afterwards, since half-precision atomics lose most of the sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from loongkit_ops.kernels.triton.bilinear import corners, interpolate, sample_setup, scatter


@triton.jit
def _msda_fwd(value, shapes, starts, loc, attn, out, K, Lq, H, C,
              L: tl.constexpr, P: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    b = i // (Lq * H)
    h = i % H
    cs = tl.arange(0, BLOCK_C)
    cmask = cs < C
    rowstride = H * C
    vbase = value + b * K * rowstride + h * C
    acc = tl.zeros([BLOCK_C], dtype=ACC)
    for lv in tl.static_range(L):
        for p in tl.static_range(P):
            j = i * L * P + lv * P + p
            a = tl.load(attn + j).to(ACC)
            inr, Hl, Wl, st, lh, lw, h0, w0 = sample_setup(loc, j, shapes, starts, lv, False, ACC)
            v00, v01, v10, v11, _, _, _, _, _, _, _, _ = corners(vbase, st, h0, w0, Hl, Wl, inr, cs, C, rowstride, ACC)
            sample = interpolate(v00, v01, v10, v11, lh, lw)
            acc += a * sample
    tl.store(out + i * C + cs, acc.to(out.dtype.element_ty), mask=cmask)


@triton.jit
def _msda_bwd(value, shapes, starts, loc, attn, gout, gvalue, gloc, gattn, K, Lq, H, C,
              L: tl.constexpr, P: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    b = i // (Lq * H)
    h = i % H
    cs = tl.arange(0, BLOCK_C)
    cmask = cs < C
    rowstride = H * C
    vbase = value + b * K * rowstride + h * C
    gbase = gvalue + b * K * rowstride + h * C
    g = tl.load(gout + i * C + cs, mask=cmask, other=0.0).to(ACC)
    for lv in tl.static_range(L):
        for p in tl.static_range(P):
            j = i * L * P + lv * P + p
            a = tl.load(attn + j).to(ACC)
            inr, Hl, Wl, st, lh, lw, h0, w0 = sample_setup(loc, j, shapes, starts, lv, False, ACC)
            hh = 1 - lh
            hw = 1 - lw
            v00, v01, v10, v11, m00, m01, m10, m11, o00, o01, o10, o11 = corners(
                vbase, st, h0, w0, Hl, Wl, inr, cs, C, rowstride, ACC)
            d00 = tl.sum(g * v00, axis=0)
            d01 = tl.sum(g * v01, axis=0)
            d10 = tl.sum(g * v10, axis=0)
            d11 = tl.sum(g * v11, axis=0)
            ga = hh * hw * d00 + hh * lw * d01 + lh * hw * d10 + lh * lw * d11
            dw = hh * (d01 - d00) + lh * (d11 - d10)
            dh = hw * (d10 - d00) + lw * (d11 - d01)
            zero = tl.zeros([], dtype=ACC)
            tl.store(gattn + j, tl.where(inr, ga, zero).to(gattn.dtype.element_ty))
            tl.store(gloc + 2 * j, tl.where(inr, a * Wl.to(ACC) * dw, zero).to(gloc.dtype.element_ty))
            tl.store(gloc + 2 * j + 1, tl.where(inr, a * Hl.to(ACC) * dh, zero).to(gloc.dtype.element_ty))
            scatter(gbase, cs, a * g, lh, lw, m00, m01, m10, m11, o00, o01, o10, o11)


def _acc(dtype: torch.dtype) -> tuple[tl.dtype, torch.dtype]:
    return (tl.float64, torch.float64) if dtype == torch.float64 else (tl.float32, torch.float32)


def _dims(value: Tensor, loc: Tensor) -> tuple[int, ...]:
    bs, k, h, c = value.shape
    _, lq, _, levels, points, _ = loc.shape
    return bs, k, h, c, lq, levels, points


def forward(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_locations: Tensor,
            attention_weights: Tensor) -> Tensor:
    """[bs, Lq, heads*C]; inputs contiguous, same device; shapes/starts int64 on that device."""
    bs, k, h, c, lq, levels, points = _dims(value, sampling_locations)
    out = value.new_empty(bs, lq, h * c)
    if out.numel() == 0:
        return out
    acc, _ = _acc(value.dtype)
    _msda_fwd[(bs * lq * h,)](value, spatial_shapes, level_start_index, sampling_locations, attention_weights, out,
                              k, lq, h, c, L=levels, P=points, BLOCK_C=triton.next_power_of_2(c), ACC=acc)
    return out


def backward(grad_out: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
             sampling_locations: Tensor, attention_weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    bs, k, h, c, lq, levels, points = _dims(value, sampling_locations)
    acc, acc_torch = _acc(value.dtype)
    grad_value = torch.zeros(value.shape, dtype=acc_torch, device=value.device)
    grad_loc = torch.empty_like(sampling_locations)
    grad_attn = torch.empty_like(attention_weights)
    if bs * lq * h:
        _msda_bwd[(bs * lq * h,)](value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                                  grad_out.contiguous(), grad_value, grad_loc, grad_attn, k, lq, h, c,
                                  L=levels, P=points, BLOCK_C=triton.next_power_of_2(c), ACC=acc)
    return grad_value.to(value.dtype), grad_loc, grad_attn
