"""Fused deformable attention (BEVFormer's TSA / MSDeformableAttention3D) in Triton, forward and backward.

The maths of ``ops.msda_fused.reference`` (and of ``cpu/msda.cpp``'s fused kernels): from the
projection row [offsets (x, y) | logits] per (head, queue entry, level, point), the weights are the
softmax of the logits over (levels, points), the location of (l, p) is ref[l] (per_level) or
ref[p % R] plus offset / (W_l, H_l), and the output is the mean over the ``queue`` value batches of
the weighted bilinear samples (the sampling rules of ``bilinear.py``).

One program per (query batch, query, head); the C channels of a value row are one vector (BLOCK_C
lanes, masked); the queue, levels and points are unrolled. Accumulation is float32 for fp16/bf16/fp32
inputs and float64 for float64. The backward scatters grad_value with atomic adds into a zeroed
float32 (float64) buffer, cast afterwards (half-precision atomics lose most of the sum), so every
element is written; the projection's gradient (offsets, and the logits through the softmax) of a
(query, head) belongs to one program and is stored directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from loongkit_ops.kernels.triton.bilinear import corners, interpolate, sample_xy, scatter


@triton.jit
def _softmax_stats(lg, LP: tl.constexpr, BLOCK_LP: tl.constexpr, ACC: tl.constexpr):
    """(weights as a BLOCK_LP vector (0 beyond LP), max, sum of exp) of the LP logits at lg."""
    lps = tl.arange(0, BLOCK_LP)
    x = tl.load(lg + lps, mask=lps < LP, other=-float("inf")).to(ACC)
    m = tl.max(x, axis=0)
    e = tl.where(lps < LP, tl.exp(x - m), 0.0)
    s = tl.sum(e, axis=0)
    return e / s, m, s


@triton.jit
def _locate(rq, oq, shapes, starts, R, lv, p, PER_LEVEL: tl.constexpr, P: tl.constexpr, ACC: tl.constexpr):
    """Sample (lv, p) of one (query, head, queue entry): bilinear setup of ref + offset / (W_l, H_l)."""
    r = lv if PER_LEVEL else p % R
    lp = lv * P + p
    Hl = tl.load(shapes + 2 * lv).to(ACC)
    Wl = tl.load(shapes + 2 * lv + 1).to(ACC)
    x = tl.load(rq + 2 * r).to(ACC) + tl.load(oq + 2 * lp).to(ACC) / Wl
    y = tl.load(rq + 2 * r + 1).to(ACC) + tl.load(oq + 2 * lp + 1).to(ACC) / Hl
    return sample_xy(x, y, shapes, starts, lv, False, ACC)


@triton.jit
def _fused_fwd(value, shapes, starts, ref, proj, out, K, Q, H, C, R, ps0, ps1, NLG,
               L: tl.constexpr, P: tl.constexpr, T: tl.constexpr, PER_LEVEL: tl.constexpr,
               BLOCK_C: tl.constexpr, BLOCK_LP: tl.constexpr, ACC: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    n = i // (Q * H)
    q = (i // H) % Q
    h = i % H
    cs = tl.arange(0, BLOCK_C)
    cmask = cs < C
    rowstride = H * C
    pq = proj + n * ps0 + q * ps1
    acc = tl.zeros([BLOCK_C], dtype=ACC)
    for t in tl.static_range(T):
        v = n * T + t
        ht = h * T + t
        oq = pq + ht * (L * P * 2)
        lg = pq + NLG + ht * (L * P)
        _, m, s = _softmax_stats(lg, L * P, BLOCK_LP, ACC)
        rq = ref + (v * Q + q) * R * 2
        vbase = value + v * K * rowstride + h * C
        for lv in tl.static_range(L):
            for p in tl.static_range(P):
                a = tl.exp(tl.load(lg + lv * P + p).to(ACC) - m) / s
                inr, Hl, Wl, st, lh, lw, h0, w0 = _locate(rq, oq, shapes, starts, R, lv, p, PER_LEVEL, P, ACC)
                v00, v01, v10, v11, _, _, _, _, _, _, _, _ = corners(
                    vbase, st, h0, w0, Hl, Wl, inr, cs, C, rowstride, ACC)
                sample = interpolate(v00, v01, v10, v11, lh, lw)
                acc += a * sample
    acc = acc / T
    tl.store(out + i * C + cs, acc.to(out.dtype.element_ty), mask=cmask)


@triton.jit
def _fused_bwd(value, shapes, starts, ref, proj, gout, gvalue, gproj, K, Q, H, C, R, ps0, ps1, NLG, F,
               L: tl.constexpr, P: tl.constexpr, T: tl.constexpr, PER_LEVEL: tl.constexpr,
               BLOCK_C: tl.constexpr, BLOCK_LP: tl.constexpr, ACC: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    n = i // (Q * H)
    q = (i // H) % Q
    h = i % H
    cs = tl.arange(0, BLOCK_C)
    cmask = cs < C
    lps = tl.arange(0, BLOCK_LP)
    rowstride = H * C
    pq = proj + n * ps0 + q * ps1
    gq = gproj + (n * Q + q) * F  # grad_proj is contiguous [NQ, Q, F]
    g = tl.load(gout + i * C + cs, mask=cmask, other=0.0).to(ACC)
    zero = tl.zeros([], dtype=ACC)
    for t in tl.static_range(T):
        v = n * T + t
        ht = h * T + t
        oq = pq + ht * (L * P * 2)
        lg = pq + NLG + ht * (L * P)
        go = gq + ht * (L * P * 2)
        gl = gq + NLG + ht * (L * P)
        w, m, s = _softmax_stats(lg, L * P, BLOCK_LP, ACC)
        gw = tl.zeros([BLOCK_LP], dtype=ACC)  # d out / d weight, gathered for the softmax backward
        rq = ref + (v * Q + q) * R * 2
        vbase = value + v * K * rowstride + h * C
        gbase = gvalue + v * K * rowstride + h * C
        for lv in tl.static_range(L):
            for p in tl.static_range(P):
                lp = lv * P + p
                aq = tl.exp(tl.load(lg + lp).to(ACC) - m) / s / T  # weight / queue (T exact, as an int)
                inr, Hl, Wl, st, lh, lw, h0, w0 = _locate(rq, oq, shapes, starts, R, lv, p, PER_LEVEL, P, ACC)
                hh = 1 - lh
                hw = 1 - lw
                v00, v01, v10, v11, m00, m01, m10, m11, o00, o01, o10, o11 = corners(
                    vbase, st, h0, w0, Hl, Wl, inr, cs, C, rowstride, ACC)
                d00 = tl.sum(g * v00, axis=0)
                d01 = tl.sum(g * v01, axis=0)
                d10 = tl.sum(g * v10, axis=0)
                d11 = tl.sum(g * v11, axis=0)
                ga = (hh * hw * d00 + hh * lw * d01 + lh * hw * d10 + lh * lw * d11) / T
                gw = tl.where(lps == lp, tl.where(inr, ga, zero), gw)
                # d loc / d offset = 1 / (W, H) cancels the pixel scale of d sample / d loc.
                dw = hh * (d01 - d00) + lh * (d11 - d10)
                dh = hw * (d10 - d00) + lw * (d11 - d01)
                tl.store(go + 2 * lp, tl.where(inr, aq * dw, zero).to(gproj.dtype.element_ty))
                tl.store(go + 2 * lp + 1, tl.where(inr, aq * dh, zero).to(gproj.dtype.element_ty))
                scatter(gbase, cs, aq * g, lh, lw, m00, m01, m10, m11, o00, o01, o10, o11)
        dot = tl.sum(w * gw, axis=0)  # softmax backward: w * (gw - w . gw)
        tl.store(gl + lps, (w * (gw - dot)).to(gproj.dtype.element_ty), mask=lps < L * P)


def _acc(dtype: torch.dtype) -> tuple[tl.dtype, torch.dtype]:
    return (tl.float64, torch.float64) if dtype == torch.float64 else (tl.float32, torch.float32)


def _dims(value: Tensor, spatial_shapes: Tensor, reference_points: Tensor, projection: Tensor, per_level: bool,
          queue: int) -> tuple[int, ...]:
    """(NQ, K, heads, C, Q, levels, points, R); the shape checks of cpu/msda.cpp's check_fused, since a
    wrong shape here would read out of bounds on the GPU."""
    nv, k, h, c = value.shape
    levels = spatial_shapes.shape[0]
    if queue < 1 or nv % queue:
        raise RuntimeError("value batches must be a multiple of queue")
    if projection.dim() != 3 or projection.stride(2) != 1:
        raise RuntimeError("projection must be [NQ, Q, features] with unit stride in features")
    nq, q, features = projection.shape
    per_point = h * queue * levels
    if not per_point or features % (per_point * 3) or features == 0:
        raise RuntimeError("projection features must be heads*queue*levels*points*3")
    points = features // (per_point * 3)
    if nq != nv // queue:
        raise RuntimeError("projection shape")
    if reference_points.dim() != 4 or reference_points.shape[:2] != (nv, q) or reference_points.shape[3] != 2:
        raise RuntimeError("reference points must be [NV, Q, R, 2]")
    r = reference_points.shape[2]
    if (r != levels) if per_level else (r == 0 or points % r):
        raise RuntimeError("reference points: one per level, or a number of anchors dividing the points")
    return nq, k, h, c, q, levels, points, r


def forward(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, reference_points: Tensor,
            projection: Tensor, per_level: bool, queue: int) -> Tensor:
    """[NQ, Q, heads*C]. value and reference_points contiguous, projection with unit stride in its last
    dim, all of one dtype on one device; shapes/starts int64 on that device."""
    nq, k, h, c, q, levels, points, r = _dims(value, spatial_shapes, reference_points, projection, per_level, queue)
    out = value.new_empty(nq, q, h * c)
    if out.numel() == 0:
        return out
    acc, _ = _acc(value.dtype)
    _fused_fwd[(nq * q * h,)](value, spatial_shapes, level_start_index, reference_points, projection, out,
                              k, q, h, c, r, projection.stride(0), projection.stride(1),
                              h * queue * levels * points * 2, L=levels, P=points, T=queue, PER_LEVEL=per_level,
                              BLOCK_C=triton.next_power_of_2(c), BLOCK_LP=triton.next_power_of_2(levels * points),
                              ACC=acc)
    return out


def backward(grad_out: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
             reference_points: Tensor, projection: Tensor, per_level: bool, queue: int) -> tuple[Tensor, Tensor]:
    """(grad_value, grad_projection), both contiguous and fully written."""
    nq, k, h, c, q, levels, points, r = _dims(value, spatial_shapes, reference_points, projection, per_level, queue)
    acc, acc_torch = _acc(value.dtype)
    grad_value = torch.zeros(value.shape, dtype=acc_torch, device=value.device)
    grad_proj = projection.new_empty(projection.shape)  # every element written below (zero when nothing sampled)
    if nq * q * h and c:
        _fused_bwd[(nq * q * h,)](value, spatial_shapes, level_start_index, reference_points, projection,
                                  grad_out.contiguous(), grad_value, grad_proj, k, q, h, c, r, projection.stride(0),
                                  projection.stride(1), h * queue * levels * points * 2, projection.shape[2],
                                  L=levels, P=points, T=queue, PER_LEVEL=per_level,
                                  BLOCK_C=triton.next_power_of_2(c),
                                  BLOCK_LP=triton.next_power_of_2(levels * points), ACC=acc)
    elif grad_proj.numel():
        grad_proj.zero_()  # no channels: the output does not depend on the projection
    return grad_value.to(value.dtype), grad_proj
