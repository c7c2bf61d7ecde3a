"""Deformable aggregation (Sparse4D) in Triton (forward and backward).

One program per (batch, anchor); the C channels are one vector (BLOCK_C lanes, masked) and each
lane reads the weight of its group. Accumulation is float32 for fp16/bf16/fp32 and float64 for
float64. The backward scatters grad_mc_ms_feat with atomic adds into a float32 (float64) buffer,
cast afterwards; grad_weights (per group) and grad_sampling_location are per program, so plain
stores. INSIDE selects the upstream CUDA kernel's rule (samples not strictly inside (0, 1) dropped).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from loongkit_ops.kernels.triton.bilinear import corners, interpolate, sample_setup, scatter


@triton.jit
def _daf_fwd(feat, shapes, starts, loc, wts, out, NF, A, PK, K, C, GD,
             L: tl.constexpr, G: tl.constexpr, INSIDE: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    b = i // A
    cs = tl.arange(0, BLOCK_C)
    cmask = cs < C
    grp = cs // GD
    fbase = feat + b * NF * C
    acc = tl.zeros([BLOCK_C], dtype=ACC)
    for pk in range(PK):
        s = i * PK + pk
        k = pk % K
        for lv in tl.static_range(L):
            kl = k * L + lv
            inr, Hl, Wl, st, lh, lw, h0, w0 = sample_setup(loc, s, shapes, starts, kl, INSIDE, ACC)
            v00, v01, v10, v11, _, _, _, _, _, _, _, _ = corners(fbase, st, h0, w0, Hl, Wl, inr, cs, C, C, ACC)
            wv = tl.load(wts + (s * L + lv) * G + grp, mask=cmask, other=0.0).to(ACC)
            sample = interpolate(v00, v01, v10, v11, lh, lw)
            acc += wv * sample
    tl.store(out + i * C + cs, acc.to(out.dtype.element_ty), mask=cmask)


@triton.jit
def _daf_bwd(feat, shapes, starts, loc, wts, gout, gfeat, gloc, gw, NF, A, PK, K, C, GD,
             L: tl.constexpr, G: tl.constexpr, INSIDE: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    b = i // A
    cs = tl.arange(0, BLOCK_C)
    cmask = cs < C
    grp = cs // GD
    fbase = feat + b * NF * C
    gbase = gfeat + b * NF * C
    g = tl.load(gout + i * C + cs, mask=cmask, other=0.0).to(ACC)
    zero = tl.zeros([], dtype=ACC)
    for pk in range(PK):
        s = i * PK + pk
        k = pk % K
        dx = zero
        dy = zero
        for lv in tl.static_range(L):
            kl = k * L + lv
            inr, Hl, Wl, st, lh, lw, h0, w0 = sample_setup(loc, s, shapes, starts, kl, INSIDE, ACC)
            hh = 1 - lh
            hw = 1 - lw
            v00, v01, v10, v11, m00, m01, m10, m11, o00, o01, o10, o11 = corners(
                fbase, st, h0, w0, Hl, Wl, inr, cs, C, C, ACC)
            wv = tl.load(wts + (s * L + lv) * G + grp, mask=cmask, other=0.0).to(ACC)
            gwv = g * wv
            sample = interpolate(v00, v01, v10, v11, lh, lw)
            contrib = g * sample
            for gi in tl.static_range(G):
                part = tl.sum(tl.where(grp == gi, contrib, 0.0), axis=0)
                tl.store(gw + (s * L + lv) * G + gi, tl.where(inr, part, zero).to(gw.dtype.element_ty))
            dw = tl.sum(gwv * (hh * (v01 - v00) + lh * (v11 - v10)), axis=0)
            dh = tl.sum(gwv * (hw * (v10 - v00) + lw * (v11 - v01)), axis=0)
            dx += tl.where(inr, Wl.to(ACC) * dw, zero)
            dy += tl.where(inr, Hl.to(ACC) * dh, zero)
            scatter(gbase, cs, gwv, lh, lw, m00, m01, m10, m11, o00, o01, o10, o11)
        tl.store(gloc + 2 * s, dx.to(gloc.dtype.element_ty))
        tl.store(gloc + 2 * s + 1, dy.to(gloc.dtype.element_ty))


def _acc(dtype: torch.dtype) -> tuple[tl.dtype, torch.dtype]:
    return (tl.float64, torch.float64) if dtype == torch.float64 else (tl.float32, torch.float32)


def _dims(feat: Tensor, loc: Tensor, weights: Tensor) -> tuple[int, ...]:
    bs, nf, c = feat.shape
    _, a, p, k, _ = loc.shape
    levels, groups = weights.shape[4], weights.shape[5]
    return bs, nf, c, a, p, k, levels, groups


def forward(mc_ms_feat: Tensor, spatial_shape: Tensor, scale_start_index: Tensor, sampling_location: Tensor,
            weights: Tensor, inside_only: bool) -> Tensor:
    """[bs, anchors, C]; inputs contiguous, same device; shapes/starts int64 on that device."""
    bs, nf, c, a, p, k, levels, groups = _dims(mc_ms_feat, sampling_location, weights)
    out = mc_ms_feat.new_empty(bs, a, c)
    if out.numel() == 0:
        return out
    acc, _ = _acc(mc_ms_feat.dtype)
    _daf_fwd[(bs * a,)](mc_ms_feat, spatial_shape, scale_start_index, sampling_location, weights, out,
                        nf, a, p * k, k, c, c // groups, L=levels, G=groups, INSIDE=inside_only,
                        BLOCK_C=triton.next_power_of_2(c), ACC=acc)
    return out


def backward(grad_out: Tensor, mc_ms_feat: Tensor, spatial_shape: Tensor, scale_start_index: Tensor,
             sampling_location: Tensor, weights: Tensor, inside_only: bool) -> tuple[Tensor, Tensor, Tensor]:
    bs, nf, c, a, p, k, levels, groups = _dims(mc_ms_feat, sampling_location, weights)
    acc, acc_torch = _acc(mc_ms_feat.dtype)
    grad_feat = torch.zeros(mc_ms_feat.shape, dtype=acc_torch, device=mc_ms_feat.device)
    grad_loc = torch.zeros_like(sampling_location)
    grad_w = torch.zeros_like(weights)
    if bs * a and p * k:
        _daf_bwd[(bs * a,)](mc_ms_feat, spatial_shape, scale_start_index, sampling_location, weights,
                            grad_out.contiguous(), grad_feat, grad_loc, grad_w, nf, a, p * k, k, c, c // groups,
                            L=levels, G=groups, INSIDE=inside_only, BLOCK_C=triton.next_power_of_2(c), ACC=acc)
    return grad_feat.to(mc_ms_feat.dtype), grad_loc, grad_w
