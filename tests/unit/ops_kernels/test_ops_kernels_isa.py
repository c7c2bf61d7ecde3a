"""Every instruction-set build of the loongkit-ops CPU kernels (what a CPU without AVX-512, or without
AVX2, runs) against the best one on this machine: bit for bit where the maths is exact (voxelization,
BEV pooling: no rounding depends on the vector width), to a float tolerance where the wider builds
fuse multiply-adds or reduce in another order (MSDA, DAF, Dice)."""

from __future__ import annotations

import os
import platform
import shutil
from typing import Any

import pytest
import torch
from loongkit_ops import kernels

from loongkit_core import kernelbuild
from loongkit_core.kernels import ISA_ENV

SEED = int(torch.seed() % 2**31)


@pytest.fixture(scope="module")
def builds() -> dict[str, Any]:
    """isa -> the library's functions for it (best first)."""
    if kernels.load() is None:
        pytest.fail(f"the CPU kernels do not load: {kernels.failure()}")
    return {isa: kernels.LIBRARY.load(isa) for isa in kernels.LIBRARY.isas()}


def lower(builds: dict[str, Any]) -> list[str]:
    isas = list(builds)
    if len(isas) == 1:
        pytest.skip("this CPU runs the baseline build only")
    return isas[1:]


def points(gen: torch.Generator, n: int, dtype: torch.dtype) -> torch.Tensor:
    p = torch.rand(n, 5, generator=gen, dtype=torch.float64) * torch.tensor([120.0, 120, 10, 1, 1]) - torch.tensor(
        [60.0, 60, 6, 0, 0])  # some points outside the +-54 m x 8 m range
    p[:1200] = p[:100].repeat(12, 1)  # voxels with more points than max_points
    p[::97, 0] = float("nan")
    return p.to(dtype)


VOXEL, RANGE = [0.075, 0.075, 0.2], [-54.0, -54.0, -5.0, 54.0, 54.0, 3.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_voxelization_is_bit_identical(builds: dict[str, Any], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(SEED)
    pts = points(gen, 60_000, dtype)
    best = next(iter(builds.values()))
    hard = best.hard_voxelize(pts, VOXEL, RANGE, 5, 20_000)
    dynamic = best.dynamic_voxelize(pts, VOXEL, RANGE)
    assert hard[0].shape[0] == 20_000 and (hard[2] == 5).any()  # max_voxels and max_points both bite
    for isa in lower(builds):
        other = builds[isa]
        for a, b in zip(hard, other.hard_voxelize(pts, VOXEL, RANGE, 5, 20_000), strict=True):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.float16 else a,
                               b.view(torch.int16) if b.dtype == torch.float16 else b), f"{isa}, seed {SEED}"
        assert torch.equal(dynamic, other.dynamic_voxelize(pts, VOXEL, RANGE)), f"{isa}, seed {SEED}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bev_pool_is_bit_identical(builds: dict[str, Any], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(SEED)
    B, Z, X, Y, N, C = 2, 2, 40, 37, 20_000, 19
    feats = torch.randn(N, C, generator=gen, dtype=dtype)
    coords = torch.stack([torch.randint(-2, X + 2, (N,), generator=gen), torch.randint(0, Y, (N,), generator=gen),
                          torch.randint(0, Z, (N,), generator=gen), torch.randint(0, B, (N,), generator=gen)], 1)
    grad = torch.randn(B, C, Z, X, Y, generator=gen, dtype=dtype)
    results = {}
    for isa, lib in builds.items():
        out = torch.full((B, C, Z, X, Y), float("nan"), dtype=dtype)
        lib.bev_pool_forward(feats, coords, B, Z, X, Y, out)
        gf = torch.full((N, C), float("nan"), dtype=dtype)
        lib.bev_pool_backward(grad, coords, B, Z, X, Y, gf)
        results[isa] = (out, gf)
    best = results[next(iter(builds))]
    for isa in lower(builds):
        for a, b in zip(best, results[isa], strict=True):
            assert torch.equal(a, b), f"{isa}, seed {SEED}"


def msda_inputs(gen: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    shapes = torch.tensor([[12, 15], [6, 8]])
    starts = torch.tensor([0, 180])
    bs, H, C, Lq, L, P = 2, 4, 32, 33, 2, 3
    value = torch.randn(bs, 228, H, C, generator=gen, dtype=dtype)
    loc = torch.rand(bs, Lq, H, L, P, 2, generator=gen, dtype=dtype) * 1.2 - 0.1
    attn = torch.rand(bs, Lq, H, L, P, generator=gen, dtype=dtype)
    return value, shapes, starts, loc, attn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_msda_daf_dice_agree(builds: dict[str, Any], dtype: torch.dtype) -> None:
    # fp32 location gradients are sums of ~100 signed terms of magnitude ~10: 1e-4 absolute is a few ulps
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-11, "atol": 1e-11}
    gen = torch.Generator().manual_seed(SEED)
    value, shapes, starts, loc, attn = msda_inputs(gen, dtype)
    gout = torch.randn(2, 33, 4 * 32, generator=gen, dtype=dtype)
    feat = torch.randn(2, 500, 64, generator=gen, dtype=dtype)  # 2 cameras x (10x20 + 5x10) maps
    fshapes = torch.tensor([[[10, 20], [5, 10]], [[10, 20], [5, 10]]])
    fstarts = torch.tensor([[0, 200], [250, 450]])
    floc = torch.rand(2, 7, 3, 2, 2, generator=gen, dtype=dtype)
    fw = torch.rand(2, 7, 3, 2, 2, 4, generator=gen, dtype=dtype)
    logits = torch.randn(3, 5, 300, generator=gen, dtype=dtype)
    target = torch.randint(0, 6, (3, 300), generator=gen)

    def run(lib: Any) -> list[torch.Tensor]:
        out = torch.empty(2, 33, 4 * 32, dtype=dtype)
        lib.msda_forward(value, shapes, starts, loc, attn, out)
        gv, gl, ga = torch.empty_like(value).zero_(), torch.empty_like(loc), torch.empty_like(attn)
        lib.msda_backward(value, shapes, starts, loc, attn, gout, gv, gl, ga)
        dout = torch.empty(2, 7, 64, dtype=dtype)
        lib.daf_forward(feat, fshapes, fstarts, floc, fw, False, dout)
        stats = torch.empty(3, 3, dtype=dtype)
        lib.dice_stats_forward(logits, target, 2, 5, False, stats)
        return [out, gv, gl, ga, dout, stats]

    best = run(next(iter(builds.values())))
    for isa in lower(builds):
        for a, b in zip(best, run(builds[isa]), strict=True):
            torch.testing.assert_close(b, a, **tol, msg=lambda m, isa=isa: f"{isa}, seed {SEED}: {m}")


def test_default_is_the_best_build(builds: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get(ISA_ENV):
        pytest.skip(f"{ISA_ENV} is set")
    assert kernels.load().isa == next(iter(builds))
    assert kernels.describe().split(";")[0].endswith(f", {kernels.load().isa}")


@pytest.mark.skipif(shutil.which("objdump") is None or platform.machine() != "x86_64",
                    reason="needs binutils on x86-64")
def test_no_wide_instruction_outside_its_build(builds: dict[str, Any]) -> None:
    # The library must load and dispatch on any x86-64 CPU: nothing reachable before the dispatch
    # (entry points, tables, shared template code, initialisers) may use AVX, AVX2 or AVX-512.
    assert kernelbuild.isa_violations(kernels.load().__file__) == []
