"""Every loongkit-ops custom op on every device here, against the fp64 reference.

On this CPU machine the device list is ``cpu`` (the C++ kernels); where CUDA exists it adds
``cuda``, where each op must pick its Triton kernel (when triton is installed) and match the
reference in fp32, fp16 and bf16, forward and backward. The same test body serves both, so the
GPU checks are exercised here on CPU and cannot rot unseen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from loongkit_ops.kernels.ops import bev_pool, daf, dice_class_stats, dice_stats, msda, msda_fused, voxelize
from loongkit_ops.kernels.triton import available as triton_available

SEED = int(torch.seed() % 2**31)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (rtol, atol) against the fp64 reference, by dtype; sums over a few hundred terms at most.
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (8e-2, 8e-2)}


def cases() -> list[Any]:
    out = [pytest.param(d, t, id=f"{d}-{str(t).removeprefix('torch.')}")
           for d in DEVICES for t in ((torch.float32,) if d == "cpu" else (torch.float32, torch.float16,
                                                                           torch.bfloat16))]
    return out


def expected_backend(device: str) -> str:
    if device == "cpu":
        return "cpu"
    return "triton" if triton_available() else "reference"


def check(fn: Callable[..., torch.Tensor], ref: Callable[..., torch.Tensor], inputs: list[torch.Tensor],
          device: str, dtype: torch.dtype, gen: torch.Generator) -> None:
    """fn on (device, dtype) vs ref in fp64 on CPU: output and the gradients of every float input."""
    ours = [t.to(device=device, dtype=dtype, copy=True).requires_grad_() for t in inputs]
    theirs = [t.double().requires_grad_() for t in inputs]
    out, expected = fn(*ours), ref(*theirs)
    grad = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    out.backward(grad.to(device=device, dtype=dtype))
    expected.backward(grad)
    rtol, atol = TOL[dtype]
    scale = float(expected.detach().abs().max()) or 1.0
    msg = f"seed {SEED}, {device}, {dtype}"
    torch.testing.assert_close(out.detach().cpu().double(), expected.detach(), rtol=rtol, atol=atol * scale,
                               msg=lambda m: f"{msg}: output: {m}")
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        gscale = float(b.grad.abs().max()) or 1.0
        torch.testing.assert_close(a.grad.cpu().double(), b.grad, rtol=rtol, atol=atol * gscale,
                                   msg=lambda m, i=i: f"{msg}: grad of input {i}: {m}")


def in_cell(gen: torch.Generator, shape: tuple[int, ...], size: torch.Tensor, base: float = 0.2) -> torch.Tensor:
    """Normalised locations whose pixel coordinate u*S - 0.5 lies base..1-base into a random cell of
    [-3, S+1) (some off the map, some on its border), for sizes S broadcast over ``shape``.

    Rounded to fp16/bf16, such a location stays in its cell, where the location gradient (the slope
    of the bilinear interpolation, which jumps at cell borders) is the reference's; a uniformly random
    location would sometimes cross a border and fail for a reason that is not a kernel error.
    """
    cell = (torch.rand(shape, generator=gen, dtype=torch.float64) * (size + 4)).floor() - 3
    frac = base + (1 - 2 * base) * torch.rand(shape, generator=gen, dtype=torch.float64)
    return ((cell + frac + 0.5) / size).float()


@pytest.mark.parametrize(("device", "dtype"), cases())
def test_ms_deform_attn(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(SEED)
    shapes = torch.tensor([[6, 7], [3, 4]])
    starts = torch.tensor([0, 42])
    value = torch.randn(2, 54, 2, 8, generator=gen)
    loc = in_cell(gen, (2, 5, 2, 2, 3, 2), shapes.flip(1).double()[:, None, :])  # [.., levels, points, (x, y)]
    attn = torch.rand(2, 5, 2, 2, 3, generator=gen)
    assert msda.backend(value.to(device=device, dtype=dtype))[0] == expected_backend(device)

    def ours(v: torch.Tensor, lc: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return msda.op(v, shapes.to(device), starts.to(device), lc, a)

    def ref(v: torch.Tensor, lc: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return msda.reference(v, shapes, starts, lc, a)

    check(ours, ref, [value, loc, attn], device, dtype, gen)


@pytest.mark.parametrize(("device", "dtype"), cases())
@pytest.mark.parametrize(("per_level", "queue"), [(True, 2), (False, 1)])
def test_ms_deform_attn_fused(device: str, dtype: torch.dtype, per_level: bool, queue: int) -> None:
    gen = torch.Generator().manual_seed(SEED)
    shapes = torch.tensor([[6, 7], [3, 4]])
    starts = torch.tensor([0, 42])
    nq, q, heads, c, levels, points = 2, 5, 2, 8, 2, 4
    value = torch.randn(nq * queue, 54, heads, c, generator=gen)
    # TSA-like: one reference point per level; MSDA3D-like: 2 anchors, point p on anchor p % 2.
    ref_points = torch.rand(nq * queue, q, 2, 2, generator=gen) * 1.2 - 0.1
    # Offsets that put each sample 0.2..0.8 into a random pixel cell of [-3, S+1) (some off the map, some
    # on its border): a location rounded to fp16/bf16 then stays in its cell, where the offsets' gradient
    # (the slope of the bilinear interpolation, which jumps at cell borders) matches the reference's.
    wh = shapes.flip(1).double()[:, None, :]  # (W, H) per level, [levels, 1, 2]
    size = (nq, q, heads, queue, levels, points, 2)
    pixel = (torch.rand(size, generator=gen, dtype=torch.float64) * (wh + 4)).floor() - 3
    pixel += 0.2 + 0.6 * torch.rand(size, generator=gen, dtype=torch.float64)
    by_query = ref_points.double().reshape(nq, queue, q, 2, 2).transpose(1, 2)  # [nq, q, queue, R, 2]
    anchor = by_query[:, :, :, :, None] if per_level else by_query[:, :, :, None, torch.arange(points) % 2]
    offsets = pixel + 0.5 - anchor[:, :, None] * wh  # pixel = (ref + offset / (W, H)) * (W, H) - 0.5
    logits = torch.randn(nq, q, heads * queue * levels * points, generator=gen, dtype=torch.float64)
    proj = torch.cat([offsets.reshape(nq, q, -1), logits], -1).float()
    assert msda.backend(value.to(device=device, dtype=dtype))[0] == expected_backend(device)

    def ours(v: torch.Tensor, r: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return msda_fused.op(v, shapes.to(device), starts.to(device), r, p, per_level, queue)

    def ref(v: torch.Tensor, r: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return msda_fused.reference(v, shapes, starts, r, p, per_level, queue)

    check(ours, ref, [value, ref_points, proj], device, dtype, gen)


@pytest.mark.parametrize(("device", "dtype"), cases())
def test_deformable_aggregation(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(SEED)
    shapes = torch.tensor([[[6, 8], [3, 4]], [[6, 8], [3, 4]]])  # 2 cameras x 2 levels
    starts = torch.tensor([[0, 48], [60, 108]])
    feat = torch.randn(1, 120, 16, generator=gen)
    # [bs, anchors, pts, cams, 2]. One location serves both levels (W 8 and 4, H 6 and 3): in cells of
    # the coarse level at 0.02..0.13 past a row/column, which is 0.52..0.63 into its cell and
    # 0.54..0.76 into a cell of the fine level; some off the map (the inside-only rule drops them).
    coarse = torch.tensor([4.0, 3.0], dtype=torch.float64)
    cell = (torch.rand(1, 7, 3, 2, 2, generator=gen, dtype=torch.float64) * (coarse + 2)).floor() - 1
    loc = ((cell + 0.02 + 0.11 * torch.rand(1, 7, 3, 2, 2, generator=gen, dtype=torch.float64)) / coarse).float()
    w = torch.rand(1, 7, 3, 2, 2, 4, generator=gen)  # 4 groups
    assert daf.backend(feat.to(device=device, dtype=dtype))[0] == expected_backend(device)

    def ours(f: torch.Tensor, lc: torch.Tensor, ww: torch.Tensor) -> torch.Tensor:
        return daf.op(f, shapes.to(device), starts.to(device), lc, ww, True)

    def ref(f: torch.Tensor, lc: torch.Tensor, ww: torch.Tensor) -> torch.Tensor:
        return daf.reference(f, shapes, starts, lc, ww, True)

    check(ours, ref, [feat, loc, w], device, dtype, gen)


@pytest.mark.parametrize(("device", "dtype"), cases())
def test_bev_pool(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(SEED)
    B, Z, X, Y, n = 2, 2, 9, 7, 400
    feats = torch.randn(n, 5, generator=gen)
    coords = torch.stack([torch.randint(-1, X + 1, (n,), generator=gen), torch.randint(-1, Y + 1, (n,), generator=gen),
                          torch.randint(0, Z, (n,), generator=gen), torch.randint(0, B, (n,), generator=gen)], 1)
    assert bev_pool.backend(feats.to(device=device, dtype=dtype))[0] == expected_backend(device)
    check(lambda f: bev_pool.op(f, coords.to(device), B, Z, X, Y),
          lambda f: bev_pool.reference(f, coords, B, Z, X, Y), [feats], device, dtype, gen)


@pytest.mark.parametrize(("device", "dtype"), cases())
@pytest.mark.parametrize("activation", [0, 1, 2])
def test_dice_stats(device: str, dtype: torch.dtype, activation: int) -> None:
    gen = torch.Generator().manual_seed(SEED)
    logits = torch.randn(2, 5, 300, generator=gen)
    target = torch.randint(-1, 7, (2, 300), generator=gen)
    target[:, :4] = 255
    assert dice_stats.backend(logits.to(device=device, dtype=dtype))[0] == expected_backend(device)
    check(lambda x: dice_stats.op(x, target.to(device), activation, 1, False),
          lambda x: dice_stats.reference(x, target, activation, 1, False), [logits], device, dtype, gen)


@pytest.mark.parametrize(("device", "dtype"), cases())
def test_dice_class_stats(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(SEED)
    logits = torch.randn(2, 5, 300, generator=gen)
    target = torch.randint(0, 5, (2, 300), generator=gen)
    target[:, :4] = 255
    check(lambda x: dice_class_stats.op(x, target.to(device), 255, 2.0),
          lambda x: dice_class_stats.reference(x, target, 255, 2.0), [logits], device, dtype, gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_voxelize_exact(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(SEED)
    points = torch.rand(3000, 4, generator=gen, dtype=dtype) * torch.tensor([12.0, 12.0, 4.0, 1.0], dtype=dtype) - 1
    points[1000:1300, :3] = points[:300, :3]  # repeated positions share voxels
    size, rng = [0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 10.0, 10.0, 3.0]
    assert voxelize.backend(points.to(device))[0] == expected_backend(device)
    got = voxelize.hard_op(points.to(device), size, rng, 5, 300)
    want = voxelize.hard_reference(points, size, rng, 5, 300)
    for a, b, name in zip(got, want, ("voxels", "coors", "num_points"), strict=True):
        assert torch.equal(a.cpu(), b), f"seed {SEED}, {device}: {name} differs"
    dyn = voxelize.dynamic_op(points.to(device), size, rng)
    assert torch.equal(dyn.cpu(), voxelize.dynamic_reference(points, size, rng)), f"seed {SEED}: dynamic differs"
