"""The bilinear sampling steps shared by the Triton MSDA (plain and fused) and deformable-aggregation kernels.

The same rules as ``cpu/bilinear.h``: pixel coordinate u*S - 0.5 (align_corners=False), a sample
with its coordinate outside (-2, S+1) reads nothing (and never forms an address), corners outside
the map read zero.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sample_setup(loc, s, shapes, starts, kl, INSIDE: tl.constexpr, ACC: tl.constexpr):
    """Sample s (x, y at loc[2s:2s+2]) on map kl: (in range, H, W, start, frac h, frac w, h0, w0).

    INSIDE adds the Sparse4D CUDA kernel's rule: x and y strictly inside (0, 1)."""
    x = tl.load(loc + 2 * s).to(ACC)
    y = tl.load(loc + 2 * s + 1).to(ACC)
    return sample_xy(x, y, shapes, starts, kl, INSIDE, ACC)


@triton.jit
def sample_xy(x, y, shapes, starts, kl, INSIDE: tl.constexpr, ACC: tl.constexpr):
    """sample_setup for a location given as values x, y (already ACC): kernels that compute it."""
    Hl = tl.load(shapes + 2 * kl)
    Wl = tl.load(shapes + 2 * kl + 1)
    st = tl.load(starts + kl)
    w_im = x * Wl.to(ACC) - 0.5
    h_im = y * Hl.to(ACC) - 0.5
    inr = (h_im > -2.0) & (w_im > -2.0) & (h_im < (Hl + 1).to(ACC)) & (w_im < (Wl + 1).to(ACC))
    if INSIDE:
        inr = inr & (x > 0.0) & (x < 1.0) & (y > 0.0) & (y < 1.0)
    h_im = tl.where(inr, h_im, 0.0)
    w_im = tl.where(inr, w_im, 0.0)
    h0f = tl.floor(h_im)
    w0f = tl.floor(w_im)
    return inr, Hl, Wl, st, h_im - h0f, w_im - w0f, h0f.to(tl.int64), w0f.to(tl.int64)


@triton.jit
def corner(vbase, st, hh, ww, Hl, Wl, inr, cs, C, rowstride, ACC: tl.constexpr):
    """Row (hh, ww) of map st, C channels: (values or zeros, lane mask, element offset)."""
    valid = inr & (hh >= 0) & (hh < Hl) & (ww >= 0) & (ww < Wl)
    off = (st + hh * Wl + ww) * rowstride
    off = tl.where(valid, off, 0)  # never form an out-of-range address, even masked
    # The lane mask of a corner: all C channels when valid, none when not (an integer bound rather
    # than `block & scalar`, which the interpreter cannot broadcast).
    mask = cs < tl.where(valid, C, 0)
    v = tl.load(vbase + off + cs, mask=mask, other=0.0).to(ACC)
    return v, mask, off


@triton.jit
def corners(vbase, st, h0, w0, Hl, Wl, inr, cs, C, rowstride, ACC: tl.constexpr):
    """The four corners of cell (h0, w0): values, then lane masks, then offsets (each 00, 01, 10, 11)."""
    v00, m00, o00 = corner(vbase, st, h0, w0, Hl, Wl, inr, cs, C, rowstride, ACC)
    v01, m01, o01 = corner(vbase, st, h0, w0 + 1, Hl, Wl, inr, cs, C, rowstride, ACC)
    v10, m10, o10 = corner(vbase, st, h0 + 1, w0, Hl, Wl, inr, cs, C, rowstride, ACC)
    v11, m11, o11 = corner(vbase, st, h0 + 1, w0 + 1, Hl, Wl, inr, cs, C, rowstride, ACC)
    return v00, v01, v10, v11, m00, m01, m10, m11, o00, o01, o10, o11


@triton.jit
def interpolate(v00, v01, v10, v11, lh, lw):
    """Bilinear blend of four corners at fractions (lh, lw) of the cell."""
    return (1 - lh) * ((1 - lw) * v00 + lw * v01) + lh * ((1 - lw) * v10 + lw * v11)


@triton.jit
def scatter(gbase, cs, g, lh, lw, m00, m01, m10, m11, o00, o01, o10, o11):
    """Add g, split over the four corners by their bilinear weights (the value gradient)."""
    hh = 1 - lh
    hw = 1 - lw
    tl.atomic_add(gbase + o00 + cs, hh * hw * g, mask=m00)
    tl.atomic_add(gbase + o01 + cs, hh * lw * g, mask=m01)
    tl.atomic_add(gbase + o10 + cs, lh * hw * g, mask=m10)
    tl.atomic_add(gbase + o11 + cs, lh * lw * g, mask=m11)
