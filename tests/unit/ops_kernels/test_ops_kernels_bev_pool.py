"""loongkit::bev_pool: C++ kernel vs the fp64 reference, gradcheck, opcheck, torch.compile, fallback.

Fresh random inputs every run (seed printed on failure); outputs poisoned with NaN before each call.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from loongkit_ops import kernels
from loongkit_ops.kernels.ops import bev_pool

SEED = int(torch.seed() % 2**31)
# (points, channels, B, Z, X, Y). The kernel works on tiles of 64 consecutive voxels of a batch's Z*X*Y
# plane: planes smaller than a tile, several tiles with a partial last one, one voxel for every point,
# no points, and a 360x360 grid (a 10 MB output: the huge-page hint's path).
CASES = [(1, 3, 1, 1, 2, 2), (200, 5, 2, 3, 4, 5), (5000, 17, 1, 1, 30, 20), (300, 8, 3, 2, 1, 7),
         (3000, 80, 2, 2, 13, 11), (500, 3, 1, 1, 1, 1), (0, 4, 1, 1, 3, 3), (20000, 20, 1, 1, 360, 360)]


def make(case: tuple, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    n, c, b, z, x, y = case
    feats = torch.randn(n, c, generator=gen, dtype=dtype)
    # Coordinates one beyond each side of the grid too: those points must be dropped.
    coords = torch.stack([torch.randint(-1, d + 1, (n,), generator=gen) for d in (x, y, z, b)], 1)
    return feats, coords


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_kernel_matches_reference(ext: Any, dtype: torch.dtype, case: tuple, threads: int) -> None:
    gen = torch.Generator().manual_seed(SEED)
    feats, coords = make(case, dtype, gen)
    _, c, b, z, x, y = case
    expected = bev_pool.reference(feats.double(), coords, b, z, x, y)  # [B, C, Z, X, Y]
    grad = torch.randn(b, c, z, x, y, generator=gen, dtype=dtype)  # BEVFusion's layout, as the kernel takes it
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full((b, c, z, x, y), float("nan"), dtype=dtype)
        ext.bev_pool_forward(feats, coords, b, z, x, y, out)
        gf = torch.full_like(feats, float("nan"))
        ext.bev_pool_backward(grad, coords, b, z, x, y, gf)
    finally:
        torch.set_num_threads(before)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(out.double(), expected, **tol,
                               msg=lambda m: f"out seed {SEED}: {m}")
    inside = ((coords >= 0) & (coords < torch.tensor([x, y, z, b]))).all(1)
    gathered = grad[coords[:, 3].clamp(0, b - 1), :, coords[:, 2].clamp(0, z - 1),
                                           coords[:, 0].clamp(0, x - 1), coords[:, 1].clamp(0, y - 1)]
    torch.testing.assert_close(gf, torch.where(inside[:, None], gathered, 0.0), rtol=0, atol=0)


def test_sum_order_is_point_order_for_any_thread_count(ext: Any) -> None:
    gen = torch.Generator().manual_seed(SEED)
    feats, coords = make(CASES[2], torch.float32, gen)
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.empty(1, 17, 1, 30, 20)
            ext.bev_pool_forward(feats, coords, 1, 1, 30, 20, out)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_op_autograd_gradcheck_and_opcheck(ext: Any) -> None:
    gen = torch.Generator().manual_seed(SEED)
    feats, coords = make(CASES[1], torch.float64, gen)
    assert torch.autograd.gradcheck(lambda f: bev_pool.op(f, coords, 2, 3, 4, 5), [feats.requires_grad_()])
    for dtype in (torch.float32, torch.float64):
        f, cd = make(CASES[1], dtype, gen)
        torch.library.opcheck(bev_pool.op, (f.requires_grad_(), cd, 2, 3, 4, 5))
        torch.library.opcheck(bev_pool.backward_op, (torch.randn(2, 5, 3, 4, 5, dtype=dtype), cd, 2, 3, 4, 5))


def test_op_backward_takes_any_grad_layout(ext: Any) -> None:
    """grad_output as autograd hands it over: expanded (sum().backward()) or a permuted view."""
    gen = torch.Generator().manual_seed(SEED)
    feats, coords = make(CASES[4], torch.float64, gen)
    grid = (2, 2, 13, 11)
    expanded = torch.ones(1, 1, 1, 1, 1, dtype=torch.float64).expand(2, 80, *grid[1:])
    permuted = torch.randn(2, 2, 13, 11, 80, generator=gen, dtype=torch.float64).permute(0, 4, 1, 2, 3)
    for grad in (expanded, permuted):
        assert not grad.is_contiguous()
        got = bev_pool.backward_op(grad, coords, *grid)
        want = bev_pool.backward_op(grad.contiguous(), coords, *grid)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    f = feats.clone().requires_grad_()
    bev_pool.op(f, coords, *grid).sum().backward()
    inside = ((coords >= 0) & (coords < torch.tensor([13, 11, 2, 2]))).all(1)
    torch.testing.assert_close(f.grad, inside[:, None].double().expand(-1, 80).contiguous(), rtol=0, atol=0)


def test_op_int32_coords_and_layout(ext: Any) -> None:
    gen = torch.Generator().manual_seed(SEED)
    feats, coords = make(CASES[1], torch.float32, gen)
    out = bev_pool.op(feats, coords.int(), 2, 3, 4, 5)
    assert out.shape == (2, 5, 3, 4, 5) and out.is_contiguous()
    torch.testing.assert_close(out, bev_pool.reference(feats, coords, 2, 3, 4, 5))


def test_torch_compile_fullgraph(ext: Any) -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(SEED)
    feats, coords = make(CASES[1], torch.float32, gen)

    def block(f: torch.Tensor) -> torch.Tensor:
        return torch.cat(bev_pool.op(f.relu(), coords, 2, 3, 4, 5).unbind(2), 1).square().sum()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    a, b = feats.clone().requires_grad_(), feats.clone().requires_grad_()
    block(a).backward()
    compiled(b).backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_reference_fallback_when_kernel_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels, "failure", lambda: "RuntimeError: no compiler")
    gen = torch.Generator().manual_seed(SEED)
    feats, coords = make(CASES[1], torch.float64, gen)
    assert bev_pool.backend(feats) == ("reference", "CPU kernel unavailable: RuntimeError: no compiler")
    f = feats.clone().requires_grad_()
    out = bev_pool.op(f, coords, 2, 3, 4, 5)
    out.backward(torch.ones_like(out))
    inside = ((coords >= 0) & (coords < torch.tensor([4, 5, 3, 2]))).all(1)
    torch.testing.assert_close(f.grad, inside[:, None].double().expand(-1, 5).contiguous())
    torch.testing.assert_close(out, bev_pool.reference(feats, coords, 2, 3, 4, 5))
