"""loongkit::deformable_aggregation: C++ kernel vs the fp64 reference, gradcheck, opcheck, compile, Triton.

Fresh random inputs every run (seed printed on failure); kernel outputs are poisoned with NaN before
each call so an element the kernel forgets to write fails the comparison. Both sampling rules are
covered: inside_only (the upstream CUDA kernel's: samples not strictly inside (0, 1) dropped) and
grid_sample's (every corner checked on its own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from loongkit_ops import kernels
from loongkit_ops.kernels.ops import daf

SEED = int(torch.seed() % 2**31)
# (bs, anchors, pts, [per camera: level shapes], C, groups): odd group widths cover the vector tails.
CASES = [
    (1, 7, 3, [[(5, 6)]], 8, 1),
    (2, 5, 2, [[(4, 7), (2, 3)], [(3, 5), (1, 2)], [(6, 2), (3, 1)]], 12, 4),
    (1, 4, 4, [[(6, 3), (3, 2), (2, 2)], [(5, 5), (2, 4), (1, 1)]], 35, 5),  # bs*groups < threads: chunks split
]


def layout(per_cam: list) -> tuple[torch.Tensor, torch.Tensor, int]:
    shapes = torch.tensor(per_cam, dtype=torch.int64)  # [cams, levels, 2]
    areas = (shapes[..., 0] * shapes[..., 1]).flatten()
    starts = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]]).reshape(shapes.shape[:2])
    return shapes, starts, int(areas.sum())


def make(case: tuple, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    bs, anchors, pts, per_cam, c, groups = case
    shapes, starts, num_feat = layout(per_cam)
    cams, levels = shapes.shape[:2]
    feat = torch.randn(bs, num_feat, c, generator=gen, dtype=dtype)
    # Locations from -0.3 to 1.3: inside, near the border (half a pixel either side) and outside.
    loc = torch.rand(bs, anchors, pts, cams, 2, generator=gen, dtype=dtype) * 1.6 - 0.3
    weights = torch.rand(bs, anchors, pts, cams, levels, groups, generator=gen, dtype=dtype)
    return feat, shapes, starts, loc, weights


def tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-11, "atol": 1e-11}


def ref_all(feat: torch.Tensor, shapes: torch.Tensor, starts: torch.Tensor, loc: torch.Tensor, w: torch.Tensor,
            grad: torch.Tensor, inside_only: bool) -> tuple[torch.Tensor, ...]:
    f, lc, ww = (t.detach().double().requires_grad_() for t in (feat, loc, w))
    out = daf.reference(f, shapes, starts, lc, ww, inside_only)
    out.backward(grad.double())
    return out.detach(), f.grad, lc.grad, ww.grad


@pytest.mark.parametrize("inside_only", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_kernel_matches_reference(ext: Any, dtype: torch.dtype, case: tuple, threads: int,
                                      inside_only: bool) -> None:
    gen = torch.Generator().manual_seed(SEED)
    feat, shapes, starts, loc, w = make(case, dtype, gen)
    bs, anchors, c = case[0], case[1], case[4]
    grad = torch.randn(bs, anchors, c, generator=gen, dtype=dtype)
    expected = ref_all(feat, shapes, starts, loc, w, grad, inside_only)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full((bs, anchors, c), float("nan"), dtype=dtype)
        ext.daf_forward(feat, shapes, starts, loc, w, inside_only, out)
        gf = torch.zeros_like(feat)
        gl = torch.full_like(loc, float("nan"))
        gw = torch.full_like(w, float("nan"))
        ext.daf_backward(feat, shapes, starts, loc, w, inside_only, grad, gf, gl, gw)
    finally:
        torch.set_num_threads(before)
    for name, mine, theirs in zip(("out", "grad_feat", "grad_loc", "grad_weights"), (out, gf, gl, gw), expected,
                                  strict=True):
        scale = theirs.abs().max().clamp(min=1)  # grad_loc grows with the map size
        torch.testing.assert_close(mine.double() / scale, theirs / scale, **tol(dtype),
                                   msg=lambda m, n=name: f"{n} seed {SEED}: {m}")


def test_inside_only_rule_drops_border_samples(ext: Any) -> None:
    """A location on or outside (0, 1) contributes nothing under the upstream rule, though grid_sample
    would still blend the border pixels for one less than half a pixel outside."""
    gen = torch.Generator().manual_seed(SEED)
    feat, shapes, starts, loc, w = make(CASES[0], torch.float64, gen)
    loc = loc.clamp(0.1, 0.9)  # every other sample strictly inside, where the two rules agree
    loc[0, 0, 0, 0] = torch.tensor([0.0, 0.5])
    loc[0, 1, 0, 0] = torch.tensor([-0.01, 0.5])  # within half a pixel of the left border (W=6)
    loc[0, 2, 0, 0] = torch.tensor([0.5, 1.0])
    loc[0, 3, 0, 0] = torch.tensor([0.5, float("nan")])
    strict = daf.op(feat, shapes, starts, loc, w, True)
    loose = daf.op(feat, shapes, starts, loc.nan_to_num(0.5), w, False)
    # Only point 0 of anchors 0-3 changes: remove it and the two rules agree on those anchors.
    w0 = w.clone()
    w0[0, :4, 0] = 0
    torch.testing.assert_close(strict[0, :4], daf.op(feat, shapes, starts, loc.nan_to_num(0.5),
                                                                          w0, False)[0, :4])
    assert not torch.allclose(strict[0, 1], loose[0, 1])  # grid_sample's rule blends the border pixel


def test_grid_sample_rule_matches_grid_sample(ext: Any) -> None:
    """inside_only=False is DeformableFeatureAggregation's grid_sample path (align_corners=False, zeros)."""
    gen = torch.Generator().manual_seed(SEED)
    feat, shapes, starts, loc, w = make(CASES[1], torch.float64, gen)
    bs, anchors, pts, per_cam, c, groups = CASES[1]
    out = daf.op(feat, shapes, starts, loc, w, False)
    expected = torch.zeros(bs, anchors, groups, c // groups, dtype=torch.float64)
    for cam, levels in enumerate(per_cam):
        for level, (h, wd) in enumerate(levels):
            start = int(starts[cam, level])
            fm = feat[:, start:start + h * wd].transpose(1, 2).reshape(bs, c, h, wd)
            s = F.grid_sample(fm, loc[:, :, :, cam] * 2 - 1, align_corners=False)  # [bs, C, anchors, pts]
            s = s.permute(0, 2, 3, 1).reshape(bs, anchors, pts, groups, c // groups)
            expected += (s * w[:, :, :, cam, level, :, None]).sum(2)
    torch.testing.assert_close(out, expected.reshape(bs, anchors, c))


def test_backward_deterministic(ext: Any) -> None:
    gen = torch.Generator().manual_seed(SEED)
    feat, shapes, starts, loc, w = make(CASES[1], torch.float32, gen)
    grad = torch.randn(2, 5, 12, generator=gen)
    runs = []
    for _ in range(3):
        gf, gl, gw = torch.zeros_like(feat), torch.empty_like(loc), torch.empty_like(w)
        ext.daf_backward(feat, shapes, starts, loc, w, True, grad, gf, gl, gw)
        runs.append((gf, gl, gw))
    assert all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r, strict=True))


@pytest.mark.parametrize("inside_only", [True, False])
def test_op_autograd_and_gradcheck(ext: Any, inside_only: bool) -> None:
    gen = torch.Generator().manual_seed(SEED)
    feat, shapes, starts, loc, w = make(CASES[1], torch.float64, gen)
    inputs = [feat.requires_grad_(), loc.requires_grad_(), w.requires_grad_()]
    assert torch.autograd.gradcheck(
        lambda f, lc, ww: daf.op(f, shapes, starts, lc, ww, inside_only), inputs, eps=1e-7,
        atol=1e-5)


def test_opcheck(ext: Any) -> None:
    gen = torch.Generator().manual_seed(SEED)
    for dtype in (torch.float32, torch.float64):
        feat, shapes, starts, loc, w = make(CASES[1], dtype, gen)
        args = (feat.requires_grad_(), shapes, starts, loc.requires_grad_(), w.requires_grad_(), True)
        torch.library.opcheck(daf.op, args)
        grad = torch.randn(2, 5, 12, generator=gen, dtype=dtype)
        torch.library.opcheck(daf.backward_op,
                              (grad, feat.detach(), shapes, starts, loc.detach(), w.detach(), False))


def test_torch_compile_fullgraph(ext: Any) -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(SEED)
    feat, shapes, starts, loc, w = make(CASES[1], torch.float32, gen)
    proj = torch.randn(12, 3, generator=gen)

    def block(f: torch.Tensor, lc: torch.Tensor, ww: torch.Tensor) -> torch.Tensor:
        out = daf.op(f * 2, shapes, starts, lc.clamp(0, 1), ww.softmax(-2), True)
        return (out @ proj).sum()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    eager_in = [t.clone().requires_grad_() for t in (feat, loc, w)]
    comp_in = [t.clone().requires_grad_() for t in (feat, loc, w)]
    block(*eager_in).backward()
    compiled(*comp_in).backward()
    for a, b in zip(eager_in, comp_in, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_reference_fallback_when_kernel_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels, "failure", lambda: "RuntimeError: no compiler")
    gen = torch.Generator().manual_seed(SEED)
    feat, shapes, starts, loc, w = make(CASES[0], torch.float64, gen)
    assert daf.backend(feat) == ("reference", "CPU kernel unavailable: RuntimeError: no compiler")
    inputs = [feat.requires_grad_(), loc.requires_grad_(), w.requires_grad_()]
    out = daf.op(inputs[0], shapes, starts, inputs[1], inputs[2], True)
    out.backward(torch.ones_like(out))
    expected = ref_all(feat, shapes, starts, loc, w, torch.ones_like(out), True)
    for mine, theirs in zip((out, *(t.grad for t in inputs)), expected, strict=True):
        torch.testing.assert_close(mine, theirs)
    assert daf.backend(feat.half())[0] == "reference"


def test_bad_shapes_are_rejected(ext: Any) -> None:
    gen = torch.Generator().manual_seed(SEED)
    feat, shapes, starts, loc, w = make(CASES[1], torch.float32, gen)
    with pytest.raises(RuntimeError, match="groups"):
        ext.daf_forward(feat[..., :11].contiguous(), shapes, starts, loc, w, True, torch.empty(2, 5, 11))
    with pytest.raises(RuntimeError, match="outside"):
        ext.daf_forward(feat[:, :10].contiguous(), shapes, starts, loc, w, True, torch.empty(2, 5, 12))


TRITON_SCRIPT = """
    from loongkit_ops.kernels.ops import daf
    from loongkit_ops.kernels.triton import daf as triton_daf
    (seed,) = ARGS; gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for dtype, inside, (bs, a, p, per_cam, c, groups) in (
            (torch.float32, True, (2, 3, 2, [[(3, 4), (2, 2)], [(2, 5), (1, 3)]], 8, 2)),
            (torch.float64, False, (1, 4, 3, [[(4, 3)]], 6, 3))):
        shapes = torch.tensor(per_cam); areas = (shapes[..., 0] * shapes[..., 1]).flatten()
        starts = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]]).reshape(shapes.shape[:2])
        cams, levels = shapes.shape[:2]
        f = torch.randn(bs, int(areas.sum()), c, generator=gen, dtype=dtype)
        loc = torch.rand(bs, a, p, cams, 2, generator=gen, dtype=dtype) * 1.6 - 0.3
        w = torch.rand(bs, a, p, cams, levels, groups, generator=gen, dtype=dtype)
        g = torch.randn(bs, a, c, generator=gen, dtype=dtype)
        out = triton_daf.forward(f, shapes, starts, loc, w, inside)
        gf, gl, gw = triton_daf.backward(g, f, shapes, starts, loc, w, inside)
        rf, rl, rw = (t.double().requires_grad_() for t in (f, loc, w))
        ref = daf.reference(rf, shapes, starts, rl, rw, inside); ref.backward(g.double())
        for mine, theirs in ((out, ref), (gf, rf.grad), (gl, rl.grad), (gw, rw.grad)):
            err = ((mine.double() - theirs).abs() / (theirs.abs() + 1)).max().item()
            worst = max(worst, err / (1e-5 if dtype == torch.float32 else 1e-12))
    save(worst)
"""


def test_triton_kernel_interpreted(run_interpreted: Callable[..., Any]) -> None:
    worst = run_interpreted(TRITON_SCRIPT, SEED, poison=False)
    assert worst < 1.0, f"seed {SEED}: error {worst} x tolerance"
