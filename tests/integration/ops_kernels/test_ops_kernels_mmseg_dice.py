"""LOONGKIT_DICE_LOSS_MMSEG1 against the real mmseg 1.x DiceLoss (fresh random inputs every run)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.integration

dice_mod = pytest.importorskip("mmseg.models.losses.dice_loss")

from loongkit_ops import kernels  # noqa: E402
from loongkit_ops.patches.dice import DiceLossMmseg1  # noqa: E402
from loongkit_ops.plugin import plugin  # noqa: E402

from loongkit_core.context import ActivationContext, NotApplicable  # noqa: E402

SEED = int(torch.seed() % 2**31)
TOL = {torch.float32: {"rtol": 2e-5, "atol": 1e-6}, torch.float64: {"rtol": 1e-10, "atol": 1e-12}}


@pytest.fixture(scope="module", autouse=True)
def ext() -> Any:
    module = kernels.load()
    assert module is not None, kernels.failure()
    return module


def activation() -> tuple[DiceLossMmseg1, ActivationContext]:
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == "dice_loss_mmseg1")
    ctx = ActivationContext.standalone(feature, logger="test")
    return DiceLossMmseg1(feature), ctx


def loss_and_grad(loss: Any, pred: torch.Tensor, target: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x = pred.clone().requires_grad_()
    out = loss(x, target, **kw)
    out.sum().backward()
    return out.detach(), x.grad


CONFIGS = [
    {"use_sigmoid": True},
    {"use_sigmoid": False},
    {"use_sigmoid": False, "naive_dice": True},
    {"use_sigmoid": True, "naive_dice": True, "ignore_index": 3},
    {"use_sigmoid": False, "ignore_index": 0, "loss_weight": 0.7, "eps": 1e-2},
    {"activate": False, "ignore_index": -1},
    {"use_sigmoid": False, "reduction": "none"},
    {"use_sigmoid": False, "reduction": "sum", "ignore_index": None},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_patched_equals_upstream(dtype: torch.dtype, config: dict) -> None:
    gen = torch.Generator().manual_seed(SEED)
    n, c, h, w = 3, 7, 19, 33
    pred = torch.randn(n, c, h, w, generator=gen, dtype=dtype) * 3
    if not config.get("activate", True):
        pred = pred.sigmoid()
    target = torch.randint(0, c, (n, h, w), generator=gen)
    target[torch.rand(n, h, w, generator=gen) < 0.1] = 255  # ignored pixels
    target[0, 0, :3] = -1  # clamps to class 0 upstream
    loss = dice_mod.DiceLoss(**config)
    kwargs_list = [{}]
    if config.get("reduction", "mean") != "sum":
        kwargs_list += [{"weight": torch.rand(n, generator=gen, dtype=dtype)}, {"avg_factor": 5}]
    expected = [loss_and_grad(loss, pred, target, **kw) for kw in kwargs_list]
    impl, ctx = activation()
    impl.activate(ctx, "mmseg.models.losses.dice_loss")
    try:
        got = [loss_and_grad(loss, pred, target, **kw) for kw in kwargs_list]
        assert ctx.record.calls == len(kwargs_list)
    finally:
        impl.deactivate(ctx)
    for kw, (el, eg), (gl, gg) in zip(kwargs_list, expected, got, strict=True):
        torch.testing.assert_close(gl, el, **TOL[dtype], msg=lambda m, kw=kw: f"loss {kw} seed {SEED}: {m}")
        torch.testing.assert_close(gg, eg, **TOL[dtype], msg=lambda m, kw=kw: f"grad {kw} seed {SEED}: {m}")


def test_cityscapes_like_shape() -> None:
    gen = torch.Generator().manual_seed(SEED)
    pred = torch.randn(2, 19, 128, 256, generator=gen)
    target = torch.randint(0, 19, (2, 128, 256), generator=gen)
    target[:, :10] = 255
    loss = dice_mod.DiceLoss(use_sigmoid=False)
    el, eg = loss_and_grad(loss, pred, target)
    impl, ctx = activation()
    impl.activate(ctx, "mmseg.models.losses.dice_loss")
    try:
        gl, gg = loss_and_grad(loss, pred, target)
    finally:
        impl.deactivate(ctx)
    torch.testing.assert_close(gl, el, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gg, eg, rtol=1e-4, atol=1e-9)


def test_dense_targets_and_other_dtypes_use_the_original() -> None:
    gen = torch.Generator().manual_seed(SEED)
    loss = dice_mod.DiceLoss(use_sigmoid=False)
    pred = torch.randn(2, 4, 5, 6, generator=gen)
    dense = torch.rand(2, 4, 5, 6, generator=gen)
    impl, ctx = activation()
    impl.activate(ctx, "mmseg.models.losses.dice_loss")
    try:
        torch.testing.assert_close(loss(pred, dense), ctx.patcher.original(dice_mod.DiceLoss, "forward")(loss, pred,
                                                                                                         dense))
        loss(pred.bfloat16(), torch.randint(0, 4, (2, 5, 6), generator=gen))
        assert ctx.record.calls == 0
    finally:
        impl.deactivate(ctx)


def test_interface_differs_is_not_applicable(monkeypatch: pytest.MonkeyPatch) -> None:
    class DiceLoss:  # mmseg 0.x-style forward
        def __init__(self, use_sigmoid: bool = False, loss_weight: float = 1.0) -> None:
            pass

        def forward(self, pred: Any, target: Any, avg_factor: Any = None, reduction_override: Any = None,
                    **kwargs: Any) -> Any:
            return pred

    fake = types.ModuleType("fake_dice")
    fake.__dict__.update(DiceLoss=DiceLoss, dice_loss=dice_mod.dice_loss,
                         weight_reduce_loss=dice_mod.weight_reduce_loss,
                         _expand_onehot_labels_dice=dice_mod._expand_onehot_labels_dice)
    monkeypatch.setitem(sys.modules, "fake_dice", fake)
    impl, ctx = activation()
    with pytest.raises(NotApplicable, match=r"interface differs: DiceLoss\.forward"):
        impl.activate(ctx, "fake_dice")
    monkeypatch.setitem(sys.modules, "fake_dice2", types.ModuleType("fake_dice2"))
    with pytest.raises(NotApplicable, match="lacks"):
        impl.activate(ctx, "fake_dice2")


RUN = """
import torch
from mmseg.models.losses import DiceLoss
loss = DiceLoss(use_sigmoid=False)
x = torch.randn(2, 5, 8, 8, requires_grad=True)
loss(x, torch.randint(0, 5, (2, 8, 8))).backward()
"""


def test_end_to_end_summary(run_loongkit: Callable[..., Any]) -> None:
    result = run_loongkit(RUN, env={"LOONGKIT_DICE_LOSS_MMSEG1": "1", "LOONGKIT_DICE_LOSS": "1"})
    assert result.returncode == 0, result.stderr
    row = result.feature("dice_loss_mmseg1")
    assert row["active"] and row["calls"] == 1, row
    seed_row = result.feature("dice_loss")  # the seed's 0.x variable never touches mmseg 1.2's loss
    assert seed_row["state"] == "not applicable" and "mmseg" in seed_row["reason"], seed_row


def test_apply_undo_apply() -> None:
    """The default deactivate (ctx.patcher.undo()) leaves mmseg's DiceLoss exactly as found; applying again
    patches again."""
    module = sys.modules["mmseg.models.losses.dice_loss"]
    prior = dict(vars(module.DiceLoss))
    gen = torch.Generator().manual_seed(SEED)
    pred = torch.randn(2, 4, 5, 6, generator=gen)
    target = torch.randint(0, 4, (2, 5, 6), generator=gen)
    impl, ctx = activation()
    for round_ in (1, 2):
        impl.activate(ctx, "mmseg.models.losses.dice_loss")
        assert vars(module.DiceLoss)["forward"] is not prior["forward"]
        module.DiceLoss(use_sigmoid=False)(pred, target)
        assert ctx.record.calls == round_
        impl.deactivate(ctx)
        assert dict(vars(module.DiceLoss)) == prior and len(ctx.patcher) == 0
