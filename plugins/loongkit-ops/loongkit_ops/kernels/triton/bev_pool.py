"""BEV pooling (BEVFusion ``bev_pool``) in Triton (forward and backward).

Forward: one program per (block of points, block of channels); each point's voxel index is computed
in-kernel (points outside the grid are dropped, as in the reference and the C++ kernel) and its
feature row is added with atomic adds into a channel-last buffer [B*Z*X*Y, C], so a point's C values
go to one contiguous row. The buffer is float32 for fp16/bf16/fp32 (half-precision atomics lose most
of a sum) and float64 for float64; it is cast and permuted to [B, C, Z, X, Y] afterwards. Atomic
adds make the summation order (and so the last bits of fp32 sums) run-dependent on a GPU, unlike
the CPU kernel, which sums in point order.

Backward: a gather of each point's voxel row from grad_output made channel-last (one permuting
copy, so every point reads C contiguous values); dropped points get zeros. No sort, no per-point
outer product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _voxel(coords, rows, nmask, B, Z, X, Y):
    """Flat voxel index ((b*Z + z)*X + x)*Y + y of each point row, and whether it is inside the grid."""
    x = tl.load(coords + 4 * rows, mask=nmask, other=-1)
    y = tl.load(coords + 4 * rows + 1, mask=nmask, other=-1)
    z = tl.load(coords + 4 * rows + 2, mask=nmask, other=-1)
    b = tl.load(coords + 4 * rows + 3, mask=nmask, other=-1)
    inside = nmask & (x >= 0) & (x < X) & (y >= 0) & (y < Y) & (z >= 0) & (z < Z) & (b >= 0) & (b < B)
    vox = ((b * Z + z) * X + x) * Y + y
    return tl.where(inside, vox, 0), inside  # never form an out-of-range address, even masked


@triton.jit
def _bev_pool_fwd(feats, coords, acc, N, C, B, Z, X, Y, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cs = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    vox, inside = _voxel(coords, rows, rows < N, B, Z, X, Y)
    mask = inside[:, None] & (cs < C)[None, :]
    f = tl.load(feats + rows[:, None] * C + cs[None, :], mask=mask, other=0.0)
    tl.atomic_add(acc + vox[:, None] * C + cs[None, :], f.to(acc.dtype.element_ty), mask=mask)


@triton.jit
def _bev_pool_bwd(gout, coords, gfeats, N, C, B, Z, X, Y, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cs = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    nmask = rows < N
    cmask = (cs < C)[None, :]
    vox, inside = _voxel(coords, rows, nmask, B, Z, X, Y)
    g = tl.load(gout + vox[:, None] * C + cs[None, :], mask=inside[:, None] & cmask, other=0.0)
    tl.store(gfeats + rows[:, None] * C + cs[None, :], g, mask=nmask[:, None] & cmask)


def _blocks(c: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_C): channels in one block up to 128, about 2048 elements per program."""
    block_c = min(triton.next_power_of_2(max(c, 1)), 128)
    return max(16, 2048 // block_c), block_c


def forward(feats: Tensor, coords: Tensor, B: int, Z: int, X: int, Y: int) -> Tensor:
    """[B, C, Z, X, Y]; feats contiguous [N, C], coords contiguous int64 [N, 4] = (x, y, z, batch)."""
    n, c = feats.shape
    acc_dtype = torch.float64 if feats.dtype == torch.float64 else torch.float32
    acc = torch.zeros(B * Z * X * Y, c, dtype=acc_dtype, device=feats.device)
    if n and acc.numel():
        block_n, block_c = _blocks(c)
        _bev_pool_fwd[(triton.cdiv(n, block_n), triton.cdiv(c, block_c))](
            feats, coords, acc, n, c, B, Z, X, Y, BLOCK_N=block_n, BLOCK_C=block_c)
    out = torch.empty(B, c, Z, X, Y, dtype=feats.dtype, device=feats.device)
    out.copy_(acc.view(B, Z, X, Y, c).permute(0, 4, 1, 2, 3))  # cast and layout in one copy
    return out


def backward(grad_output: Tensor, coords: Tensor, B: int, Z: int, X: int, Y: int) -> Tensor:
    """grad_feats [N, C] from grad_output [B, C, Z, X, Y]; coords contiguous int64 [N, 4]."""
    c = grad_output.shape[1]
    n = coords.shape[0]
    grad = grad_output.new_empty(n, c)
    if grad.numel() == 0 or grad_output.numel() == 0:  # nothing to gather: every point is dropped
        return grad.zero_()
    grad_cl = grad_output.permute(0, 2, 3, 4, 1).contiguous()
    block_n, block_c = _blocks(c)
    _bev_pool_bwd[(triton.cdiv(n, block_n), triton.cdiv(c, block_c))](
        grad_cl, coords, grad, n, c, B, Z, X, Y, BLOCK_N=block_n, BLOCK_C=block_c)
    return grad
