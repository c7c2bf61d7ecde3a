"""loongkit::dice_stats vs its fp64 reference, opcheck/gradcheck, and the reference path without a kernel
(the loader itself: tests/unit/core/test_kernels.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from loongkit_ops import kernels
from loongkit_ops.kernels.ops import dice_stats

SEED = int(torch.seed() % 2**31)


def inputs(gen: torch.Generator, dtype: torch.dtype, n: int = 3, c: int = 6, s: int = 517) -> tuple:
    logits = torch.randn(n, c, s, generator=gen, dtype=dtype) * 3
    target = torch.randint(-2, c + 2, (n, s), generator=gen)  # negatives clamp to 0, >= c are unlabelled
    target[:, :5] = 255
    return logits, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", [0, 1, 2])
@pytest.mark.parametrize("drop", [-1, 0, 4])
@pytest.mark.parametrize("naive", [False, True])
def test_stats_and_grad_match_reference(ext: Any, dtype: torch.dtype, activation: int, drop: int, naive: bool) -> None:
    gen = torch.Generator().manual_seed(SEED)
    logits, target = inputs(gen, dtype)
    gstats = torch.randn(3, 3, generator=gen, dtype=dtype)
    stats = torch.full((3, 3), float("nan"), dtype=dtype)
    ext.dice_stats_forward(logits, target, activation, drop, naive, stats)
    grad = torch.full_like(logits, float("nan"))
    ext.dice_stats_backward(logits, target, activation, drop, naive, gstats, grad)
    x = logits.double().requires_grad_()
    expected = dice_stats.reference(x, target, activation, drop, naive)
    (expected_grad,) = torch.autograd.grad(expected, x, gstats.double())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(stats.double(), expected.detach(), **tol, msg=lambda m: f"seed {SEED}: {m}")
    torch.testing.assert_close(grad.double(), expected_grad, **tol, msg=lambda m: f"seed {SEED}: {m}")


def test_gradcheck_and_opcheck(ext: Any) -> None:
    gen = torch.Generator().manual_seed(SEED)
    logits, target = inputs(gen, torch.float64, n=2, c=4, s=37)
    for activation in (0, 1, 2):
        assert torch.autograd.gradcheck(lambda x, a=activation: dice_stats.op(x, target, a, 1, False),
                                        (logits.clone().requires_grad_(),))
        torch.library.opcheck(dice_stats.op, (logits.clone().requires_grad_(), target, activation, -1, True))


def test_compile_fullgraph(ext: Any) -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(SEED)
    logits, target = inputs(gen, torch.float32, n=2, c=4, s=37)

    def loss(x: torch.Tensor) -> torch.Tensor:
        a, b, c = dice_stats.op(x * 1.5, target, 2, -1, False).unbind(1)
        return (1 - 2 * a / (b + c + 1e-3)).mean()

    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss(x1).backward()
    torch.compile(loss, backend="aot_eager", fullgraph=True)(x2).backward()
    torch.testing.assert_close(x1.grad, x2.grad)


def test_reference_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels, "failure", lambda: "RuntimeError: boom")
    gen = torch.Generator().manual_seed(SEED)
    logits, target = inputs(gen, torch.float64, n=2, c=4, s=37)
    assert dice_stats.backend(logits) == ("reference", "CPU kernel unavailable: RuntimeError: boom")
    x = logits.clone().requires_grad_()
    dice_stats.op(x, target, 2, 1, False).sum().backward()
    y = logits.clone().requires_grad_()
    dice_stats.reference(y, target, 2, 1, False).sum().backward()
    torch.testing.assert_close(x.grad, y.grad)
