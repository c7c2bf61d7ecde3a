"""Shared by the ops_models tests: load the upstream-style test modules like a user's project, build
BEVFormer-tiny-shaped inputs, run a module forward+backward and compare two runs."""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).parent
TOL = {torch.float32: {"rtol": 2e-5, "atol": 2e-5}, torch.float64: {"rtol": 1e-10, "atol": 1e-10}}


def load_file(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def install_projects(attention: Any, losses: Any, uniad: bool = False) -> tuple[types.ModuleType, ...]:
    """Import the test projects, registering into ``attention`` / ``losses`` (module-level decorators)."""
    registry = types.ModuleType("lk_upstream_registry")
    registry.ATTENTION, registry.LOSSES = attention, losses  # type: ignore[attr-defined]
    sys.modules["lk_upstream_registry"] = registry
    if uniad:  # UniAD has its own registrations: the BEVFormer module only lends it MSDA3D and the MSDA
        registry.ATTENTION = type(attention)("bevformer-attention")  # type: ignore[attr-defined]
    bev = load_file(HERE / "upstream_bevformer_modules.py", "lk_upstream_bevformer")
    if not uniad:
        return (bev,)
    registry.ATTENTION = attention  # type: ignore[attr-defined]
    return bev, load_file(HERE / "upstream_uniad_modules.py", "lk_upstream_uniad")


def remove_projects() -> None:
    for name in ("lk_upstream_registry", "lk_upstream_bevformer", "lk_upstream_uniad"):
        sys.modules.pop(name, None)


def randomise(module: torch.nn.Module, gen: torch.Generator, scale: float = 0.05) -> None:
    """Upstream init zeroes attention weights: random parameters make every path non-trivial."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def camera_inputs(bs: int, dtype: torch.dtype, gen: torch.Generator, levels: list[tuple[int, int]],
                  cams: int = 6, bev: int = 50, anchors: int = 4, dims: int = 256) -> dict[str, Any]:
    """SCA inputs as BEVFormer's encoder makes them: each camera sees a 70-degree sector of the BEV
    grid (neighbours overlap), each anchor visible with p=0.7 there, masks differing per sample;
    key/value [cams, L, bs, C] as the permuted view of a [cams, bs, L, C] tensor."""
    ys, xs = torch.meshgrid(torch.arange(bev), torch.arange(bev), indexing="ij")
    angle = torch.atan2(ys.flatten() - bev / 2 + 0.5, xs.flatten() - bev / 2 + 0.5)
    centre = torch.arange(cams) * (2 * math.pi / cams) - math.pi
    diff = torch.remainder(angle[None, :] - centre[:, None] + math.pi, 2 * math.pi) - math.pi
    sector = diff.abs() < math.radians(35)  # [cams, Q]
    mask = sector[:, None, :, None] & (torch.rand(cams, bs, bev * bev, anchors, generator=gen) < 0.7)
    length = sum(h * w for h, w in levels)
    feat = torch.randn(cams, bs, length, dims, generator=gen, dtype=dtype)
    shapes = torch.tensor(levels)
    areas = shapes[:, 0] * shapes[:, 1]
    return {
        "query": torch.randn(bs, bev * bev, dims, generator=gen, dtype=dtype),
        "query_pos": torch.randn(bs, bev * bev, dims, generator=gen, dtype=dtype) * 0.1,
        "feat": feat,
        "reference_points_cam": torch.rand(cams, bs, bev * bev, anchors, 2, generator=gen, dtype=dtype) * 1.2 - 0.1,
        "bev_mask": mask,
        "spatial_shapes": shapes,
        "level_start_index": torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]]),
    }


def run_sca(module: Any, inputs: dict[str, Any], grad: torch.Tensor) -> list[torch.Tensor]:
    module.zero_grad()
    query = inputs["query"].clone().requires_grad_()
    feat = inputs["feat"].clone().requires_grad_()
    kv = feat.permute(0, 2, 1, 3)
    out = module(query, kv, kv, query_pos=inputs["query_pos"], reference_points_cam=inputs["reference_points_cam"],
                 bev_mask=inputs["bev_mask"], spatial_shapes=inputs["spatial_shapes"],
                 level_start_index=inputs["level_start_index"])
    out.backward(grad)
    return [out.detach(), query.grad, feat.grad, *(p.grad.clone() for p in module.parameters())]


def tsa_inputs(bs: int, dtype: torch.dtype, gen: torch.Generator, bev: int = 50, dims: int = 256) -> dict[str, Any]:
    """TSA inputs as the encoder makes them: value = [prev, current] per sample, batch-major rows;
    reference points of both frames (the shifted previous one first)."""
    query = torch.randn(bs, bev * bev, dims, generator=gen, dtype=dtype)
    prev = torch.randn(bs, bev * bev, dims, generator=gen, dtype=dtype)
    ref = torch.rand(bs, 2, bev * bev, 1, 2, generator=gen, dtype=dtype)
    return {"query": query, "value": torch.stack([prev, query], 1).reshape(bs * 2, bev * bev, dims),
            "query_pos": torch.randn(bs, bev * bev, dims, generator=gen, dtype=dtype) * 0.1,
            "reference_points": ref.reshape(bs * 2, bev * bev, 1, 2), "spatial_shapes": torch.tensor([[bev, bev]]),
            "level_start_index": torch.tensor([0])}


def run_tsa(module: Any, inputs: dict[str, Any], grad: torch.Tensor) -> list[torch.Tensor]:
    module.zero_grad()
    query = inputs["query"].clone().requires_grad_()
    value = inputs["value"].clone().requires_grad_()
    out = module(query, None, value, query_pos=inputs["query_pos"], reference_points=inputs["reference_points"],
                 spatial_shapes=inputs["spatial_shapes"], level_start_index=inputs["level_start_index"])
    out.backward(grad)
    return [out.detach(), query.grad, value.grad, *(p.grad.clone() for p in module.parameters())]


def assert_same(before: list[torch.Tensor], after: list[torch.Tensor], dtype: torch.dtype, seed: int) -> None:
    """Outputs and gradients equal within TOL, relative to each tensor's largest element.

    One exception, float32 gradients only: bilinear sampling's gradient with respect to a location
    jumps where the location crosses a pixel edge. grid_sample computes the pixel coordinate as
    ((2x-1+1)W-1)/2, the fused kernel as xW-0.5: in float32 they can round to different sides of an
    edge, and with ~10^5 random locations per test about one does (measured: ~40% of runs). That
    sample's location gradient then differs, and so do the gradients it feeds (its query's row, whole
    rows of the offset projection's weights and its bias). The exact equivalence is proven in float64
    (no such events at 1e-16); in float32 the gradients must match elementwise for at least 99% of
    elements and within 1e-2 in relative norm, and the outputs (#0, continuous in the locations) to
    TOL everywhere."""
    assert len(before) == len(after)
    for i, (theirs, mine) in enumerate(zip(before, after, strict=True)):
        assert mine is not None and theirs is not None, f"#{i}: gradient missing"
        scale = theirs.abs().max().clamp(min=1e-3)  # relative to the tensor's largest element
        a, b = mine / scale, theirs / scale
        if dtype == torch.float32 and i > 0:
            tol = TOL[dtype]
            bad = int((~torch.isclose(a, b, rtol=tol["rtol"], atol=tol["atol"])).sum())
            assert bad <= max(1, a.numel() // 100), f"#{i} seed {seed}: {bad} of {a.numel()} elements differ"
            rel = float((a - b).norm() / b.norm().clamp(min=1e-12))
            assert rel < 1e-2, f"#{i} seed {seed}: relative norm of the difference {rel:.2e}"
            continue
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m, i=i: f"#{i} seed {seed}: {m}")


def compare(build: Callable[[], Any], run: Callable[[Any], list[torch.Tensor]], patch: Callable[[], Any],
            unpatch: Callable[[], Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run the same module unpatched, then patched; returns both results."""
    module = build()
    before = run(module)
    patch()
    try:
        after = run(module)
    finally:
        unpatch()
    return before, after
