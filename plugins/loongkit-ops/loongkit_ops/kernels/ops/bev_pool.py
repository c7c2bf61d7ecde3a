"""``loongkit::bev_pool``: BEVFusion's sum of frustum features per BEV voxel.

feats [N, C], coords [N, 4] = (x, y, z, batch) -> [B, C, Z, X, Y]. Kernels: ``cpu/bev_pool.cpp``,
``triton/bev_pool.py``; :func:`reference` (an index_add) otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from loongkit_ops import kernels
from loongkit_ops.kernels.ops import dispatch


def backend(feats: Tensor) -> tuple[str, str]:
    """('cpu' | 'triton' | 'reference', why) for a call on ``feats``."""
    return dispatch.backend(feats, "bev_pool", triton_module="bev_pool")


def reference(feats: Tensor, coords: Tensor, B: int, Z: int, X: int, Y: int) -> Tensor:
    """Sum of feats [N, C] per voxel coords [N, 4] = (x, y, z, batch) -> [B, C, Z, X, Y].

    Points outside the grid are dropped. Written as an index_add over flattened voxels (no sort).
    """
    C = feats.shape[1]
    x, y, z, b = coords.long().unbind(1)
    inside = (x >= 0) & (x < X) & (y >= 0) & (y < Y) & (z >= 0) & (z < Z) & (b >= 0) & (b < B)
    voxel = ((b * Z + z) * X + x) * Y + y
    out = feats.new_zeros(B * Z * X * Y, C)
    out = out.index_add(0, voxel[inside], feats[inside])
    return out.reshape(B, Z, X, Y, C).permute(0, 4, 1, 2, 3).contiguous()


@dispatch.custom_op("loongkit::bev_pool")
def op(feats: Tensor, coords: Tensor, B: int, Z: int, X: int, Y: int) -> Tensor:
    """[B, C, Z, X, Y]: sums of feats [N, C] per voxel coords [N, 4] = (x, y, z, batch)."""
    which, _ = backend(feats)
    if which == "reference":
        return reference(feats, coords, B, Z, X, Y)
    if which == "triton":
        return dispatch.triton("bev_pool").forward(feats.contiguous(), coords.to(torch.int64).contiguous(), B, Z, X,
                                                   Y)
    out = feats.new_empty(B, feats.shape[1], Z, X, Y)  # written in this layout by the kernel: no permute
    kernels.load().bev_pool_forward(feats.contiguous(), coords.to(torch.int64).contiguous(), B, Z, X, Y, out)
    return out


@op.register_fake
def _(feats: Tensor, coords: Tensor, B: int, Z: int, X: int, Y: int) -> Tensor:
    torch._check(feats.dim() == 2 and coords.dim() == 2)
    return feats.new_empty(B, feats.shape[1], Z, X, Y)


@dispatch.custom_op("loongkit::bev_pool_backward")
def backward_op(grad_output: Tensor, coords: Tensor, B: int, Z: int, X: int, Y: int) -> Tensor:
    """grad_feats [N, C]: each point's voxel row of grad_output [B, C, Z, X, Y] (zero when dropped)."""
    which, _ = backend(grad_output)
    if which == "reference":
        c = grad_output.shape[1]
        feats = grad_output.new_zeros(coords.shape[0], c)
        _, vjp = torch.func.vjp(lambda f: reference(f, coords, B, Z, X, Y), feats)
        return vjp(grad_output)[0].contiguous()
    if which == "triton":
        return dispatch.triton("bev_pool").backward(grad_output, coords.to(torch.int64).contiguous(), B, Z, X, Y)
    grad = grad_output.new_empty(coords.shape[0], grad_output.shape[1])
    kernels.load().bev_pool_backward(grad_output.contiguous(), coords.to(torch.int64).contiguous(), B, Z, X, Y, grad)
    return grad


@backward_op.register_fake
def _(grad_output: Tensor, coords: Tensor, B: int, Z: int, X: int, Y: int) -> Tensor:
    return grad_output.new_empty(coords.shape[0], grad_output.shape[1])


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(inputs[1])
    ctx.grid = inputs[2:]


def _backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
    (coords,) = ctx.saved_tensors
    return backward_op(grad_output, coords, *ctx.grid), None, None, None, None, None


op.register_autograd(_backward, setup_context=_setup_context)
