"""loongkit::ms_deform_attn: C++ kernel vs the fp64 reference, gradcheck, opcheck, torch.compile, Triton.

Fresh random inputs every run (seed printed on failure); kernel outputs are poisoned with NaN before
each call so an element the kernel forgets to write fails the comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from loongkit_ops import kernels
from loongkit_ops.kernels.ops import msda, msda_fused

SEED = int(torch.seed() % 2**31)
# (bs, Lq, heads, C, level shapes, points): odd channel counts cover the vector tails.
CASES = [
    (1, 7, 2, 8, [(5, 6)], 3),
    (2, 5, 3, 5, [(4, 7), (2, 3), (1, 1)], 2),
    (3, 11, 1, 33, [(6, 3), (3, 2)], 4),
    (1, 9, 1, 7, [(4, 5)], 2),  # one (batch, head) slice: with 2 threads the backward splits queries
]


def make(case: tuple, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    bs, lq, heads, c, shapes, points = case
    shapes_t = torch.tensor(shapes, dtype=torch.int64)
    areas = shapes_t[:, 0] * shapes_t[:, 1]
    starts = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
    keys = int(areas.sum())
    value = torch.randn(bs, keys, heads, c, generator=gen, dtype=dtype)
    # Locations from -0.3 to 1.3: inside, on the border and fully outside the maps.
    loc = torch.rand(bs, lq, heads, len(shapes), points, 2, generator=gen, dtype=dtype) * 1.6 - 0.3
    attn = torch.rand(bs, lq, heads, len(shapes), points, generator=gen, dtype=dtype)
    return value, shapes_t, starts, loc, attn


def tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-11, "atol": 1e-11}


def ref_all(value: torch.Tensor, shapes: torch.Tensor, starts: torch.Tensor, loc: torch.Tensor,
            attn: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    v, lc, a = (t.detach().double().requires_grad_() for t in (value, loc, attn))
    out = msda.reference(v, shapes, starts, lc, a)
    out.backward(grad.double())
    return out.detach(), v.grad, lc.grad, a.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_kernel_matches_reference(ext: Any, dtype: torch.dtype, case: tuple, threads: int) -> None:
    gen = torch.Generator().manual_seed(SEED)
    value, shapes, starts, loc, attn = make(case, dtype, gen)
    bs, lq, heads, c = case[0], case[1], case[2], case[3]
    grad = torch.randn(bs, lq, heads * c, generator=gen, dtype=dtype)
    expected = ref_all(value, shapes, starts, loc, attn, grad)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # 2 threads with bs*heads < 2 takes the private-buffer path
    try:
        out = torch.full((bs, lq, heads * c), float("nan"), dtype=dtype)
        ext.msda_forward(value, shapes, starts, loc, attn, out)
        gv = torch.zeros_like(value)
        gl = torch.full_like(loc, float("nan"))
        ga = torch.full_like(attn, float("nan"))
        ext.msda_backward(value, shapes, starts, loc, attn, grad, gv, gl, ga)
    finally:
        torch.set_num_threads(before)
    for name, mine, theirs in zip(("out", "grad_value", "grad_loc", "grad_attn"), (out, gv, gl, ga), expected,
                                  strict=True):
        torch.testing.assert_close(mine.double(), theirs, **tol(dtype), msg=lambda m, n=name: f"{n} seed {SEED}: {m}")


def test_backward_deterministic(ext: Any) -> None:
    gen = torch.Generator().manual_seed(SEED)
    value, shapes, starts, loc, attn = make(CASES[1], torch.float32, gen)
    grad = torch.randn(2, 5, 15, generator=gen)
    runs = []
    for _ in range(3):
        gv, gl, ga = torch.zeros_like(value), torch.empty_like(loc), torch.empty_like(attn)
        ext.msda_backward(value, shapes, starts, loc, attn, grad, gv, gl, ga)
        runs.append(gv)
    assert all(torch.equal(runs[0], r) for r in runs[1:])


def test_nan_and_far_locations_do_not_crash(ext: Any) -> None:
    gen = torch.Generator().manual_seed(SEED)
    value, shapes, starts, loc, attn = make(CASES[0], torch.float32, gen)
    loc[0, 0, 0, 0, 0] = float("nan")
    loc[0, 1, 0, 0, 0] = 1e30
    loc[0, 2, 0, 0, 0] = -1e30
    out = msda.op(value, shapes, starts, loc, attn)
    ref = msda.reference(value.double(), shapes, starts, loc.double().nan_to_num(0, 1e30, -1e30),
                                   attn.double())
    # A NaN location contributes nothing (no valid corner); far ones fall outside every map.
    keep = torch.ones(out.shape[1], dtype=torch.bool)
    keep[0] = False
    torch.testing.assert_close(out[:, keep].double(), ref[:, keep], rtol=1e-5, atol=1e-5)


def test_op_autograd_and_gradcheck(ext: Any) -> None:
    gen = torch.Generator().manual_seed(SEED)
    value, shapes, starts, loc, attn = make(CASES[1], torch.float64, gen)
    # Bilinear sampling has kinks at integer pixel coordinates; random points land within eps of one
    # with negligible probability.
    inputs = [value.requires_grad_(), loc.requires_grad_(), attn.requires_grad_()]
    assert torch.autograd.gradcheck(
        lambda v, lc, a: msda.op(v, shapes, starts, lc, a), inputs, eps=1e-7, atol=1e-5)


def test_opcheck(ext: Any) -> None:
    gen = torch.Generator().manual_seed(SEED)
    for dtype in (torch.float32, torch.float64):
        value, shapes, starts, loc, attn = make(CASES[1], dtype, gen)
        args = (value.requires_grad_(), shapes, starts, loc.requires_grad_(), attn.requires_grad_())
        torch.library.opcheck(msda.op, args)
        grad = torch.randn(2, 5, 15, generator=gen, dtype=dtype)
        torch.library.opcheck(msda.backward_op, (grad, value.detach(), shapes, starts, loc.detach(),
                                                               attn.detach()))


def test_torch_compile_fullgraph(ext: Any) -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(SEED)
    value, shapes, starts, loc, attn = make(CASES[1], torch.float32, gen)
    w = torch.randn(15, 4, generator=gen)

    def block(v: torch.Tensor, lc: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return (msda.op(v * 2, shapes, starts, lc.clamp(0, 1), a.softmax(-1)) @ w).sum()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)  # fullgraph: a break would raise
    eager_in = [t.clone().requires_grad_() for t in (value, loc, attn)]
    comp_in = [t.clone().requires_grad_() for t in (value, loc, attn)]
    block(*eager_in).backward()
    compiled(*comp_in).backward()
    for a, b in zip(eager_in, comp_in, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_reference_fallback_when_kernel_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels, "failure", lambda: "RuntimeError: no compiler")
    gen = torch.Generator().manual_seed(SEED)
    value, shapes, starts, loc, attn = make(CASES[0], torch.float64, gen)
    assert msda.backend(value) == ("reference", "CPU kernel unavailable: RuntimeError: no compiler")
    inputs = [value.requires_grad_(), loc.requires_grad_(), attn.requires_grad_()]
    out = msda.op(inputs[0], shapes, starts, inputs[1], inputs[2])
    out.backward(torch.ones_like(out))
    expected = ref_all(value, shapes, starts, loc, attn, torch.ones_like(out))
    for mine, theirs in zip((out, *(t.grad for t in inputs)), expected, strict=True):
        torch.testing.assert_close(mine, theirs)
    assert msda.backend(value.half())[0] == "reference"


TRITON_SCRIPT = """
    from loongkit_ops.kernels.ops import msda
    from loongkit_ops.kernels.triton import msda as triton_msda
    (seed,) = ARGS; gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for dtype, (bs, lq, heads, c, shapes, points) in ((torch.float32, (2, 3, 2, 5, [(3, 4), (2, 2)], 2)),
                                                      (torch.float64, (1, 4, 3, 8, [(4, 3)], 3))):
        shapes_t = torch.tensor(shapes); areas = shapes_t[:, 0] * shapes_t[:, 1]
        starts = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
        v = torch.randn(bs, int(areas.sum()), heads, c, generator=gen, dtype=dtype)
        loc = torch.rand(bs, lq, heads, len(shapes), points, 2, generator=gen, dtype=dtype) * 1.6 - 0.3
        a = torch.rand(bs, lq, heads, len(shapes), points, generator=gen, dtype=dtype)
        g = torch.randn(bs, lq, heads * c, generator=gen, dtype=dtype)
        out = triton_msda.forward(v, shapes_t, starts, loc, a)
        gv, gl, ga = triton_msda.backward(g, v, shapes_t, starts, loc, a)
        rv, rl, ra = (t.double().requires_grad_() for t in (v, loc, a))
        ref = msda.reference(rv, shapes_t, starts, rl, ra); ref.backward(g.double())
        for mine, theirs in ((out, ref), (gv, rv.grad), (gl, rl.grad), (ga, ra.grad)):
            err = ((mine.double() - theirs).abs() / (theirs.abs() + 1)).max().item()
            worst = max(worst, err / (1e-5 if dtype == torch.float32 else 1e-12))
    save(worst)
"""


def test_triton_kernel_interpreted(run_interpreted: Callable[..., Any]) -> None:
    worst = run_interpreted(TRITON_SCRIPT, SEED, poison=False)
    assert worst < 1.0, f"seed {SEED}: error {worst} x tolerance"


# -- loongkit::ms_deform_attn_fused (BEVFormer's TSA / MSDeformableAttention3D) --------------------------

# (NQ, queue, Q, heads, C, level shapes, points, reference points R, per_level): TSA-like (queue 2, one
# reference point per level), MSDA3D-like (Z anchors dividing the points), odd channel counts, and one
# (value batch, head) slice (2 threads split its queries into private buffers).
FUSED_CASES = [
    (1, 2, 9, 2, 8, [(5, 6)], 4, 1, True),
    (2, 2, 7, 3, 5, [(4, 7), (2, 3)], 3, 2, True),
    (3, 1, 8, 2, 33, [(6, 3), (3, 2)], 4, 2, False),
    (2, 1, 6, 4, 32, [(5, 4)], 8, 4, False),
    (1, 1, 11, 1, 7, [(4, 5)], 4, 2, False),
]


def make_fused(case: tuple, dtype: torch.dtype, gen: torch.Generator, strided: bool = True) -> tuple[Any, ...]:
    nq, queue, q, heads, c, shapes, points, anchors, per_level = case
    shapes_t = torch.tensor(shapes, dtype=torch.int64)
    areas = shapes_t[:, 0] * shapes_t[:, 1]
    starts = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
    value = torch.randn(nq * queue, int(areas.sum()), heads, c, generator=gen, dtype=dtype)
    ref = torch.rand(nq * queue, q, len(shapes) if per_level else anchors, 2, generator=gen, dtype=dtype) * 1.2 - 0.1
    n = heads * queue * len(shapes) * points
    # Offsets of a few pixels (inside, across the border and outside the maps), logits of order 1.
    proj = torch.randn(nq, q, 3 * n + 5, generator=gen, dtype=dtype)
    proj[..., :2 * n] *= 3
    proj = proj[..., :3 * n] if strided else proj[..., :3 * n].contiguous()  # a slice: rows 3n + 5 apart
    return value, shapes_t, starts, ref, proj, per_level, queue


def fused_ref_all(args: tuple[Any, ...], grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    value, shapes, starts, ref, proj, per_level, queue = args
    v, r, p = (t.detach().double().requires_grad_() for t in (value, ref, proj))
    out = msda_fused.reference(v, shapes, starts, r, p, per_level, queue)
    out.backward(grad.double())
    return out.detach(), v.grad, r.grad, p.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", FUSED_CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_kernel_matches_reference(ext: Any, dtype: torch.dtype, case: tuple, threads: int) -> None:
    gen = torch.Generator().manual_seed(SEED)
    value, shapes, starts, ref, proj, per_level, queue = args = make_fused(case, dtype, gen)
    nq, q, heads, c = case[0], case[2], case[3], case[4]
    grad = torch.randn(nq, q, heads * c, generator=gen, dtype=dtype)
    expected = fused_ref_all(args, grad)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full((nq, q, heads * c), float("nan"), dtype=dtype)
        ext.msda_fused_forward(value, shapes, starts, ref, proj, per_level, queue, out)
        gv = torch.full_like(value, float("nan"))  # the kernel writes every element of grad_value
        gp = torch.full(proj.shape, float("nan"), dtype=dtype)
        ext.msda_fused_backward(value, shapes, starts, ref, proj, per_level, queue, grad, gv, gp)
        # grad of the reference points: through the op's autograd (from the offsets' gradient)
        r = ref.clone().requires_grad_()
        msda_fused.ms_deform_attn_fused(value, shapes, starts, r, proj, per_level, queue).backward(grad)
    finally:
        torch.set_num_threads(before)
    for name, mine, theirs in zip(("out", "grad_value", "grad_ref", "grad_proj"), (out, gv, r.grad, gp), expected,
                                  strict=True):
        torch.testing.assert_close(mine.double(), theirs, **tol(dtype), msg=lambda m, n=name: f"{n} seed {SEED}: {m}")


def test_fused_op_autograd_gradcheck_and_opcheck(ext: Any) -> None:
    gen = torch.Generator().manual_seed(SEED)
    value, shapes, starts, ref, proj, per_level, queue = make_fused(FUSED_CASES[1], torch.float64, gen)
    inputs = [value.requires_grad_(), ref.requires_grad_(), proj.contiguous().requires_grad_()]
    assert torch.autograd.gradcheck(
        lambda v, r, p: msda_fused.op(v, shapes, starts, r, p, per_level, queue), inputs, eps=1e-7,
        atol=1e-5)
    for dtype in (torch.float32, torch.float64):
        value, shapes, starts, ref, proj, per_level, queue = make_fused(FUSED_CASES[2], dtype, gen, strided=False)
        torch.library.opcheck(msda_fused.op, (value.requires_grad_(), shapes, starts, ref,
                                                            proj.requires_grad_(), per_level, queue))
        grad = torch.randn(3, 8, 66, generator=gen, dtype=dtype)
        torch.library.opcheck(msda_fused.backward_op,
                              (grad, value.detach(), shapes, starts, ref, proj.detach(), per_level, queue))


def test_fused_reference_fallback_when_kernel_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels, "failure", lambda: "RuntimeError: no compiler")
    gen = torch.Generator().manual_seed(SEED)
    value, shapes, starts, ref, proj, per_level, queue = args = make_fused(FUSED_CASES[0], torch.float64, gen)
    grad = torch.randn(1, 9, 16, generator=gen, dtype=torch.float64)
    inputs = [value.requires_grad_(), ref.requires_grad_(), proj.detach().requires_grad_()]
    out = msda_fused.ms_deform_attn_fused(inputs[0], shapes, starts, inputs[1], inputs[2], per_level, queue)
    out.backward(grad)
    for mine, theirs in zip((out, *(t.grad for t in inputs)), fused_ref_all(args, grad), strict=True):
        torch.testing.assert_close(mine, theirs)


def test_maps_beyond_the_cache(ext: Any) -> None:
    """Value batches over 8 MiB take the prefetching path (and slices too large to stage): plain and fused."""
    gen = torch.Generator().manual_seed(SEED)
    dtype = torch.float64
    shapes = torch.tensor([[200, 300], [5, 7]])
    starts = torch.tensor([0, 60000])
    value = torch.randn(1, 60035, 2, 16, generator=gen, dtype=dtype)  # 15 MiB
    loc = torch.rand(1, 6, 2, 2, 3, 2, generator=gen, dtype=dtype) * 1.2 - 0.1
    attn = torch.rand(1, 6, 2, 2, 3, generator=gen, dtype=dtype)
    grad = torch.randn(1, 6, 32, generator=gen, dtype=dtype)
    expected = ref_all(value, shapes, starts, loc, attn, grad)
    out = torch.full((1, 6, 32), float("nan"), dtype=dtype)
    ext.msda_forward(value, shapes, starts, loc, attn, out)
    gv, gl, ga = torch.zeros_like(value), torch.empty_like(loc), torch.empty_like(attn)
    ext.msda_backward(value, shapes, starts, loc, attn, grad, gv, gl, ga)
    for mine, theirs in zip((out, gv, gl, ga), expected, strict=True):
        torch.testing.assert_close(mine, theirs, **tol(dtype))
    ref = torch.rand(1, 6, 3, 2, generator=gen, dtype=dtype)
    proj = torch.randn(1, 6, 2 * 2 * 3 * 3, generator=gen, dtype=dtype)
    args = (value, shapes, starts, ref, proj, False, 1)
    out = torch.full((1, 6, 32), float("nan"), dtype=dtype)
    ext.msda_fused_forward(*args, out)
    gv, gp = torch.full_like(value, float("nan")), torch.empty_like(proj)
    ext.msda_fused_backward(*args, grad, gv, gp)
    expected = fused_ref_all(args, grad)
    for mine, theirs in zip((out, gv, gp), (expected[0], expected[1], expected[3]), strict=True):
        torch.testing.assert_close(mine, theirs, **tol(dtype))
