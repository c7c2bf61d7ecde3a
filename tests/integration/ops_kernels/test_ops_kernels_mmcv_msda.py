"""loongkit::ms_deform_attn and LOONGKIT_BEVFORMER against the real mmcv 2.x (CPU pytorch path).

Fresh random inputs every run (seed printed on failure); outputs and gradients of the patched
MultiScaleDeformableAttention must equal the unpatched module's within a per-dtype tolerance.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.integration

pytest.importorskip("mmcv")
msda_mod = pytest.importorskip("mmcv.ops.multi_scale_deform_attn")

from loongkit_ops import kernels  # noqa: E402
from loongkit_ops.kernels.ops import msda  # noqa: E402
from loongkit_ops.patches.bevformer import Bevformer  # noqa: E402
from loongkit_ops.plugin import plugin  # noqa: E402

from loongkit_core.context import ActivationContext, NotApplicable  # noqa: E402

SEED = int(torch.seed() % 2**31)
TOL = {torch.float32: {"rtol": 2e-5, "atol": 2e-5}, torch.float64: {"rtol": 1e-10, "atol": 1e-10}}


@pytest.fixture(scope="module", autouse=True)
def ext() -> Any:
    module = kernels.load()
    assert module is not None, kernels.failure()
    return module


def activation() -> tuple[Bevformer, ActivationContext]:
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == "bevformer")
    ctx = ActivationContext.standalone(feature, logger="test")
    return Bevformer(feature), ctx


def scaled(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return t * (1 + torch.rand(t.shape, generator=gen, dtype=t.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("levels", [[(5, 7)], [(8, 6), (4, 3), (2, 2), (1, 1)]])
def test_op_matches_mmcv_pytorch_path(dtype: torch.dtype, levels: list) -> None:
    gen = torch.Generator().manual_seed(SEED)
    shapes = torch.tensor(levels)
    areas = shapes[:, 0] * shapes[:, 1]
    starts = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
    bs, lq, heads, c, points = 2, 9, 4, 16, 3
    value = torch.randn(bs, int(areas.sum()), heads, c, generator=gen, dtype=dtype)
    loc = torch.rand(bs, lq, heads, len(levels), points, 2, generator=gen, dtype=dtype) * 1.4 - 0.2
    attn = torch.rand(bs, lq, heads, len(levels), points, generator=gen, dtype=dtype)
    grad = torch.randn(bs, lq, heads * c, generator=gen, dtype=dtype)
    results = []
    for fn in (lambda v, lc, a: msda_mod.multi_scale_deformable_attn_pytorch(v, shapes, lc, a),
               lambda v, lc, a: msda.op(v, shapes, starts, lc, a)):
        inputs = [t.clone().requires_grad_() for t in (value, loc, attn)]
        out = fn(*inputs)
        out.backward(grad)
        results.append((out.detach(), *(t.grad for t in inputs)))
    for name, theirs, mine in zip(("out", "grad_value", "grad_loc", "grad_attn"), *results, strict=True):
        scale = theirs.abs().max().clamp(min=1)  # grad_loc grows with the map size
        torch.testing.assert_close(mine / scale, theirs / scale, **TOL[dtype],
                                   msg=lambda m, n=name: f"{n} seed {SEED}: {m}")


def bevformer_tiny_tsa(bs: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[Any, dict[str, Any]]:
    """An mmcv MSDA configured like BEVFormer-tiny's temporal self-attention (50x50 BEV, 256 dims)."""
    module = msda_mod.MultiScaleDeformableAttention(embed_dims=256, num_heads=8, num_levels=1, num_points=4,
                                                    dropout=0.0, batch_first=True).to(dtype)
    with torch.no_grad():  # upstream init zeroes offsets/weights: randomise so sampling is non-trivial
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.05)
    h = w = 50
    query = torch.randn(bs, h * w, 256, generator=gen, dtype=dtype)
    ref = torch.rand(bs, h * w, 1, 2, generator=gen, dtype=dtype)
    kwargs = {"query": query, "value": torch.randn(bs, h * w, 256, generator=gen, dtype=dtype),
              "reference_points": ref, "spatial_shapes": torch.tensor([[h, w]]),
              "level_start_index": torch.tensor([0])}
    return module, kwargs


def run_module(module: Any, kwargs: dict[str, Any], grad: torch.Tensor) -> list[torch.Tensor]:
    module.zero_grad()
    query = kwargs["query"].clone().requires_grad_()
    value = kwargs["value"].clone().requires_grad_()
    out = module(**{**kwargs, "query": query, "value": value})
    out.backward(grad)
    return [out.detach(), query.grad, value.grad, *(p.grad.clone() for p in module.parameters())]


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_patched_module_equals_unpatched(bs: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(SEED + bs)
    module, kwargs = bevformer_tiny_tsa(bs, dtype, gen)
    grad = torch.randn(bs, 2500, 256, generator=gen, dtype=dtype)
    before = run_module(module, kwargs, grad)
    impl, ctx = activation()
    impl.activate(ctx, "mmcv.ops.multi_scale_deform_attn")
    try:
        assert msda_mod.multi_scale_deformable_attn_pytorch is not ctx.patcher.original(
            msda_mod, "multi_scale_deformable_attn_pytorch")
        after = run_module(module, kwargs, grad)
        assert ctx.record.calls == 1
    finally:
        impl.deactivate(ctx)
    assert msda_mod.multi_scale_deformable_attn_pytorch.__module__ == "mmcv.ops.multi_scale_deform_attn"
    for i, (theirs, mine) in enumerate(zip(before, after, strict=True)):
        scale = theirs.abs().max().clamp(min=1e-3)
        torch.testing.assert_close(mine / scale, theirs / scale, **TOL[dtype],
                                   msg=lambda m, i=i: f"#{i} seed {SEED}: {m}")


def test_other_dtypes_use_the_original() -> None:
    impl, ctx = activation()
    impl.activate(ctx, "mmcv.ops.multi_scale_deform_attn")
    try:
        value = torch.randn(1, 4, 2, 3, dtype=torch.bfloat16)
        loc = torch.rand(1, 2, 2, 1, 2, 2, dtype=torch.bfloat16)
        attn = torch.rand(1, 2, 2, 1, 2, dtype=torch.bfloat16)
        out = msda_mod.multi_scale_deformable_attn_pytorch(value, torch.tensor([[2, 2]]), loc, attn)
        assert out.dtype == torch.bfloat16 and ctx.record.calls == 0
    finally:
        impl.deactivate(ctx)


def fake_module(**attrs: Any) -> types.ModuleType:
    module = types.ModuleType("fake_msda")
    module.__dict__.update(attrs)
    return module


def test_interface_differs_is_not_applicable(monkeypatch: pytest.MonkeyPatch) -> None:
    def multi_scale_deformable_attn_pytorch(value: Any, shapes: Any, locations: Any, weights: Any, extra: Any) -> Any:
        raise AssertionError("must not be called")

    fake = fake_module(MultiScaleDeformableAttention=msda_mod.MultiScaleDeformableAttention,
                       multi_scale_deformable_attn_pytorch=multi_scale_deformable_attn_pytorch)
    monkeypatch.setitem(sys.modules, "fake_msda", fake)
    impl, ctx = activation()
    with pytest.raises(NotApplicable, match="interface differs"):
        impl.activate(ctx, "fake_msda")
    assert fake.multi_scale_deformable_attn_pytorch is multi_scale_deformable_attn_pytorch


def test_forward_that_does_not_call_the_function_is_not_applicable(monkeypatch: pytest.MonkeyPatch) -> None:
    class MultiScaleDeformableAttention:
        def forward(self, query: Any, key: Any = None, value: Any = None, identity: Any = None, query_pos: Any = None,
                    key_padding_mask: Any = None, reference_points: Any = None, spatial_shapes: Any = None,
                    level_start_index: Any = None) -> Any:
            return query

    fake = fake_module(MultiScaleDeformableAttention=MultiScaleDeformableAttention,
                       multi_scale_deformable_attn_pytorch=msda_mod.multi_scale_deformable_attn_pytorch)
    monkeypatch.setitem(sys.modules, "fake_msda2", fake)
    impl, ctx = activation()
    with pytest.raises(NotApplicable, match="does not call"):
        impl.activate(ctx, "fake_msda2")


def test_broken_target_is_not_applicable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fake_msda3", fake_module())
    impl, ctx = activation()
    with pytest.raises(NotApplicable, match="lacks"):
        impl.activate(ctx, "fake_msda3")


def test_kernel_unavailable_keeps_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel is built at the first eligible call; when it cannot be, upstream's code runs."""
    import sys

    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels, "failure", lambda: "RuntimeError: no compiler")
    impl, ctx = activation()
    impl.activate(ctx, "mmcv.ops.multi_scale_deform_attn")
    try:
        module = sys.modules["mmcv.ops.multi_scale_deform_attn"]
        patched = module.multi_scale_deformable_attn_pytorch
        original = patched.__loongkit_original__
        value = torch.randn(1, 20, 2, 4)
        args = (value, torch.tensor([[4, 5]]), torch.rand(1, 6, 2, 1, 2, 2), torch.rand(1, 6, 2, 1, 2))
        torch.testing.assert_close(patched(*args), original(*args), rtol=0, atol=0)
        assert ctx.record.calls == 0 and "no compiler" in ctx.record.reason
    finally:
        impl.deactivate(ctx)


RUN = """
import torch
from mmcv.ops import MultiScaleDeformableAttention
m = MultiScaleDeformableAttention(embed_dims=32, num_heads=4, num_levels=1, num_points=2, batch_first=True)
q = torch.randn(1, 20, 32)
out = m(q, value=q, reference_points=torch.rand(1, 20, 1, 2), spatial_shapes=torch.tensor([[4, 5]]),
        level_start_index=torch.tensor([0]))
out.sum().backward()
"""


def test_end_to_end_summary(run_loongkit: Callable[..., Any]) -> None:
    result = run_loongkit(RUN, env={"LOONGKIT_BEVFORMER": "1"})
    assert result.returncode == 0, result.stderr
    row = result.feature("bevformer")
    assert row["active"] and row["calls"] == 1, row
    assert "multi_scale_deform_attn" in str(row["targets"]), row
