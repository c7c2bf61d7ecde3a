"""loongkit::dice_class_stats (mmseg 0.x DiceLoss sums) vs its fp64 reference; gradcheck, opcheck, compile."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from loongkit_ops import kernels
from loongkit_ops.kernels.ops import dice_class_stats

SEED = int(torch.seed() % 2**31)


def inputs(gen: torch.Generator, dtype: torch.dtype, n: int = 3, c: int = 6, s: int = 517) -> tuple:
    logits = torch.randn(n, c, s, generator=gen, dtype=dtype) * 3
    target = torch.randint(-2, c + 2, (n, s), generator=gen)  # negatives clamp to 0, >= c to c-1
    target[:, :5] = 255
    return logits, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ignore", [255, 2, -1])
@pytest.mark.parametrize("exponent", [1.0, 2.0, 1.5, 3.0])
def test_stats_and_grad_match_reference(ext: Any, dtype: torch.dtype, ignore: int, exponent: float) -> None:
    gen = torch.Generator().manual_seed(SEED)
    logits, target = inputs(gen, dtype)
    gstats = torch.randn(3, 6, 3, generator=gen, dtype=dtype)
    stats = torch.full((3, 6, 3), float("nan"), dtype=dtype)  # poisoned: every element must be written
    ext.dice_class_stats_forward(logits, target, ignore, exponent, stats)
    grad = torch.full_like(logits, float("nan"))
    ext.dice_class_stats_backward(logits, target, ignore, exponent, gstats, grad)
    x = logits.double().requires_grad_()
    expected = dice_class_stats.reference(x, target, ignore, exponent)
    (expected_grad,) = torch.autograd.grad(expected, x, gstats.double())
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-11}
    torch.testing.assert_close(stats.double(), expected.detach(), **tol, msg=lambda m: f"seed {SEED}: {m}")
    gtol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(grad.double(), expected_grad, **gtol, msg=lambda m: f"seed {SEED}: {m}")


def test_reference_semantics() -> None:
    """The rules the kernel is held to, on a hand-checkable case: 255 -> class C-1 in t, masked in a."""
    logits = torch.zeros(1, 3, 4, dtype=torch.float64)  # p = 1/3 everywhere
    target = torch.tensor([[0, 2, 255, -4]])
    a, b, t = dice_class_stats.reference(logits, target, 255, 2.0).unbind(-1)
    third = 1 / 3
    torch.testing.assert_close(a, torch.tensor([[2 * third, 0.0, third]], dtype=torch.float64))  # 255 masked
    torch.testing.assert_close(b, torch.full((1, 3), 4 * third**2, dtype=torch.float64))
    torch.testing.assert_close(t, torch.tensor([[2.0, 0.0, 2.0]], dtype=torch.float64))  # 255 counted in C-1


def test_gradcheck_opcheck_and_exponent_check(ext: Any) -> None:
    gen = torch.Generator().manual_seed(SEED)
    logits, target = inputs(gen, torch.float64, n=2, c=4, s=37)
    for exponent in (1.0, 2.0, 2.5):
        assert torch.autograd.gradcheck(lambda x, e=exponent: dice_class_stats.op(x, target, 1, e),
                                        (logits.clone().requires_grad_(),))
        torch.library.opcheck(dice_class_stats.op, (logits.clone().requires_grad_(), target, 255, exponent))
    with pytest.raises(RuntimeError, match="exponent"):
        ext.dice_class_stats_forward(logits, target, 255, 0.0, torch.empty(2, 4, 3, dtype=torch.float64))


def test_compile_fullgraph(ext: Any) -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(SEED)
    logits, target = inputs(gen, torch.float32, n=2, c=4, s=37)

    def loss(x: torch.Tensor) -> torch.Tensor:
        a, b, t = dice_class_stats.op(x * 1.5, target, 255, 2.0).unbind(-1)
        return (1 - (2 * a + 1) / (b + t + 1)).mean()

    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss(x1).backward()
    torch.compile(loss, backend="aot_eager", fullgraph=True)(x2).backward()
    torch.testing.assert_close(x1.grad, x2.grad)


def test_reference_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels, "failure", lambda: "RuntimeError: boom")
    gen = torch.Generator().manual_seed(SEED)
    logits, target = inputs(gen, torch.float64, n=2, c=4, s=37)
    x = logits.clone().requires_grad_()
    stats = dice_class_stats.op(x, target, 255, 2.0)
    stats.sum().backward()
    y = logits.clone().requires_grad_()
    dice_class_stats.reference(y, target, 255, 2.0).sum().backward()
    torch.testing.assert_close(x.grad, y.grad)
