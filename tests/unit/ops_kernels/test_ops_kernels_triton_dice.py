"""The Triton Dice statistics kernels (kernels/triton/dice.py), run by Triton's interpreter on CPU tensors.

A child process with TRITON_INTERPRET=1 runs loongkit::dice_stats (mmseg 1.x: every activation,
drop_class in and out of range, naive) and loongkit::dice_class_stats (mmseg 0.x: ignore_index
255 / a real class / absent, exponents 1, 2 and general) with the backend forced to 'triton' (so
the dispatch in kernels/ops/ is exercised too), forward and backward through autograd, with
torch.empty / empty_like / new_empty poisoned (NaN) so an unwritten element shows. The parent
compares with the fp64 reference and with the C++ kernels. Fresh random inputs every run (seed in
every failure message); the pixel count is not a multiple of the tile and C not a power of two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from loongkit_ops.kernels.ops import dice_class_stats, dice_stats

SEED = int(torch.seed() % 2**31)
# Cityscapes' 19 classes (32 class lanes): S spans 2 pixel tiles in fp32 (BLOCK_S 128), 3 in fp64 (64).
N, C, S = 2, 19, 150
STATS = [(act, drop, naive) for act in (0, 1, 2) for drop, naive in ((-1, False), (0, True), (3, False),
                                                                     (25, True))]
CLASS = [(ignore, e) for ignore, e in ((255, 2.0), (2, 1.0), (-1, 1.5), (255, 0.7))]

SCRIPT = """
    from loongkit_ops.kernels.ops import dice_class_stats, dice_stats
    dice_stats.backend = dice_class_stats.backend = lambda t: ("triton", "")  # CPU tensors through Triton
    seed, n, c, s, stats_cases, class_cases = ARGS
    gen = torch.Generator().manual_seed(seed)
    results = []
    for dtype in (torch.float32, torch.float64):
        logits = torch.randn(n, c, s, generator=gen, dtype=dtype) * 3
        target = torch.randint(-2, c + 2, (n, s), generator=gen)  # negative and >= C labels too
        target[:, :7] = 255
        for act, drop, naive in stats_cases:
            g = torch.randn(n, 3, generator=gen, dtype=dtype)
            x = logits.clone().requires_grad_()
            out = dice_stats.op(x, target, act, drop, naive)
            out.backward(g)
            results.append(dict(kind="stats", args=(act, drop, naive), logits=logits, target=target, grad=g,
                                out=out.detach(), grad_logits=x.grad))
        for ignore, e in class_cases:
            g = torch.randn(n, c, 3, generator=gen, dtype=dtype)
            x = logits.clone().requires_grad_()
            out = dice_class_stats.op(x, target, ignore, e)
            out.backward(g)
            results.append(dict(kind="class", args=(ignore, e), logits=logits, target=target, grad=g,
                                out=out.detach(), grad_logits=x.grad))
    save(results)
"""


def test_triton_kernel_interpreted(ext: Any, run_interpreted: Callable[..., Any]) -> None:
    pytest.importorskip("triton")
    from loongkit_ops.kernels.triton import dice

    # Several pixel tiles per sample, so the partial sums are really reduced.
    assert all(dice._blocks(C, S, dtype)[1] < S for dtype in (torch.float32, torch.float64))
    results = run_interpreted(SCRIPT, SEED, N, C, S, STATS, CLASS)
    assert len(results) == 2 * (len(STATS) + len(CLASS))
    for r in results:
        logits, target, grad, out, grad_logits = r["logits"], r["target"], r["grad"], r["out"], r["grad_logits"]
        dtype = logits.dtype
        msg = f"seed {SEED}, {r['kind']} {r['args']}, {dtype}"
        fn, ref_fn = ((dice_stats.op, dice_stats.reference) if r["kind"] == "stats"
                      else (dice_class_stats.op, dice_class_stats.reference))
        assert out.dtype == dtype and grad_logits.dtype == dtype and grad_logits.shape == logits.shape, msg
        x = logits.detach().double().requires_grad_()
        expected = ref_fn(x, target, *r["args"])
        (expected_grad,) = torch.autograd.grad(expected, x, grad.double())
        # Sums of a few hundred terms of size ~10 (identity activation): relative to the largest value.
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
        for name, mine, theirs in (("stats", out, expected.detach()), ("grad", grad_logits, expected_grad)):
            scale = theirs.abs().max().clamp(min=1)
            torch.testing.assert_close(mine.double() / scale, theirs / scale, **tol,
                                       msg=lambda m, s=f"{name} {msg}": f"{s}: {m}")
        assert dice_stats.backend(logits)[0] == dice_class_stats.backend(logits)[0] == "cpu"
        y = logits.clone().requires_grad_()
        cpu = fn(y, target, *r["args"])
        cpu.backward(grad)
        for name, mine, theirs in (("stats", out, cpu.detach()), ("grad", grad_logits, y.grad)):
            scale = theirs.abs().max().clamp(min=1)
            torch.testing.assert_close(mine / scale, theirs / scale, **tol,
                                       msg=lambda m, s=f"{name} vs C++ kernel {msg}": f"{s}: {m}")
