"""LOONGKIT_DICE_LOSS against the real mmseg 0.x DiceLoss (mmseg 0.30 in the stack1 venv), fresh random
inputs every run: loss and gradient, across smooth, exponent, class weights, ignore_index, reductions."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.stack1]

mmseg = pytest.importorskip("mmseg")
if not mmseg.__version__.startswith("0."):
    pytest.skip(f"needs mmseg 0.x, found {mmseg.__version__}", allow_module_level=True)
dice_mod = pytest.importorskip("mmseg.models.losses.dice_loss")

from loongkit_ops import kernels  # noqa: E402
from loongkit_ops.patches.dice import DiceLossMmseg0  # noqa: E402
from loongkit_ops.plugin import plugin  # noqa: E402

from loongkit_core.context import ActivationContext, NotApplicable  # noqa: E402

SEED = int(torch.seed() % 2**31)
TOL = {torch.float32: {"rtol": 2e-5, "atol": 1e-6}, torch.float64: {"rtol": 1e-10, "atol": 1e-13}}
TARGET = "mmseg.models.losses.dice_loss"


@pytest.fixture(scope="module", autouse=True)
def ext() -> Any:
    module = kernels.load()
    assert module is not None, kernels.failure()
    return module


def activation() -> tuple[DiceLossMmseg0, ActivationContext]:
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == "dice_loss")
    ctx = ActivationContext.standalone(feature, logger="test")
    return DiceLossMmseg0(feature), ctx


def loss_and_grad(loss: Any, pred: torch.Tensor, target: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x = pred.clone().requires_grad_()
    out = loss(x, target, **kw)
    out.sum().backward()
    return out.detach(), x.grad


CONFIGS = [
    {},
    {"smooth": 0.5, "exponent": 1},
    {"exponent": 3, "loss_weight": 0.4},
    {"exponent": 1.5, "smooth": 1e-3},
    {"class_weight": [0.5, 1.0, 2.0, 0.1, 1.0, 3.0, 0.7]},
    {"ignore_index": 3},  # class 3 skipped, its pixels masked in the numerator
    {"ignore_index": 0, "class_weight": [1.0, 2.0, 1.0, 1.0, 0.5, 1.0, 1.0]},
    {"ignore_index": -1},
    {"reduction": "none"},
    {"reduction": "sum"},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_patched_equals_upstream(dtype: torch.dtype, config: dict) -> None:
    gen = torch.Generator().manual_seed(SEED)
    n, c, h, w = 3, 7, 19, 33
    pred = torch.randn(n, c, h, w, generator=gen, dtype=dtype) * 3
    target = torch.randint(0, c, (n, h, w), generator=gen)
    target[torch.rand(n, h, w, generator=gen) < 0.1] = 255  # ignored, and class C-1 in the denominator
    target[0, 0, :3] = -1  # clamps to class 0; ignored when ignore_index=-1
    target[1, 2, :4] = c + 3  # clamps to class C-1 and counts as valid
    loss = dice_mod.DiceLoss(**config)
    kwargs_list: list[dict] = [{}, {"reduction_override": "none"}]
    if config.get("reduction", "mean") == "mean":
        kwargs_list.append({"avg_factor": 5})
    expected = [loss_and_grad(loss, pred, target, **kw) for kw in kwargs_list]
    impl, ctx = activation()
    impl.activate(ctx, TARGET)
    try:
        got = [loss_and_grad(loss, pred, target, **kw) for kw in kwargs_list]
        assert ctx.record.calls == len(kwargs_list)
    finally:
        impl.deactivate(ctx)
    for kw, (el, eg), (gl, gg) in zip(kwargs_list, expected, got, strict=True):
        assert gl.dtype == el.dtype and gl.shape == el.shape
        torch.testing.assert_close(gl, el, **TOL[dtype], msg=lambda m, kw=kw: f"loss {kw} seed {SEED}: {m}")
        torch.testing.assert_close(gg, eg, **TOL[dtype], msg=lambda m, kw=kw: f"grad {kw} seed {SEED}: {m}")


def test_other_shapes_and_label_dtypes() -> None:
    gen = torch.Generator().manual_seed(SEED)
    loss = dice_mod.DiceLoss(class_weight=[1.0, 0.5, 2.0])
    pred3 = torch.randn(2, 3, 50, generator=gen, dtype=torch.float64)  # [N, C, L]
    target3 = torch.randint(0, 4, (2, 50), generator=gen, dtype=torch.int32)
    pred5 = torch.randn(1, 3, 4, 5, 6, generator=gen, dtype=torch.float64).transpose(3, 4)  # non-contiguous
    target5 = torch.randint(0, 3, (1, 4, 6, 5), generator=gen)
    cases = [(pred3, target3), (pred5, target5)]
    expected = [loss_and_grad(loss, p, t) for p, t in cases]
    impl, ctx = activation()
    impl.activate(ctx, TARGET)
    try:
        got = [loss_and_grad(loss, p, t) for p, t in cases]
        assert ctx.record.calls == 2
    finally:
        impl.deactivate(ctx)
    for (el, eg), (gl, gg) in zip(expected, got, strict=True):
        torch.testing.assert_close(gl, el, **TOL[torch.float64])
        torch.testing.assert_close(gg, eg, **TOL[torch.float64])


def test_cityscapes_like_shape() -> None:
    gen = torch.Generator().manual_seed(SEED)
    pred = torch.randn(2, 19, 128, 256, generator=gen)
    target = torch.randint(0, 19, (2, 128, 256), generator=gen)
    target[:, :10] = 255
    loss = dice_mod.DiceLoss()
    el, eg = loss_and_grad(loss, pred, target)
    impl, ctx = activation()
    impl.activate(ctx, TARGET)
    try:
        gl, gg = loss_and_grad(loss, pred, target)
    finally:
        impl.deactivate(ctx)
    torch.testing.assert_close(gl, el, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gg, eg, rtol=1e-4, atol=1e-10)


def test_unsupported_inputs_use_the_original() -> None:
    gen = torch.Generator().manual_seed(SEED)
    pred = torch.randn(2, 4, 5, 6, generator=gen)
    labels = torch.randint(0, 4, (2, 5, 6), generator=gen)
    impl, ctx = activation()
    impl.activate(ctx, TARGET)
    try:
        original = ctx.patcher.original(dice_mod.DiceLoss, "forward")
        for loss, p, t in [(dice_mod.DiceLoss(), pred, labels.float()),  # float labels
                           (dice_mod.DiceLoss(), pred.bfloat16(), labels),
                           (dice_mod.DiceLoss(exponent=0), pred, labels),
                           (dice_mod.DiceLoss(ignore_index=255.0), pred, labels)]:
            torch.testing.assert_close(loss(p, t), original(loss, p, t))
        with pytest.raises(IndexError):  # a short class_weight still fails as upstream does
            dice_mod.DiceLoss(class_weight=[1.0, 2.0])(pred, labels)
        assert ctx.record.calls == 0
    finally:
        impl.deactivate(ctx)


def test_interface_differs_is_not_applicable(monkeypatch: pytest.MonkeyPatch) -> None:
    class DiceLoss:  # mmseg 1.1+-style forward
        def __init__(self, use_sigmoid: bool = False, loss_weight: float = 1.0) -> None:
            pass

        def forward(self, pred: Any, target: Any, weight: Any = None, avg_factor: Any = None,
                    reduction_override: Any = None, ignore_index: int = 255, **kwargs: Any) -> Any:
            return pred

    fake = types.ModuleType("fake_dice0")
    fake.__dict__.update(DiceLoss=DiceLoss, dice_loss=dice_mod.dice_loss, binary_dice_loss=dice_mod.binary_dice_loss,
                         weighted_loss=dice_mod.weighted_loss)
    monkeypatch.setitem(sys.modules, "fake_dice0", fake)
    impl, ctx = activation()
    with pytest.raises(NotApplicable, match=r"interface differs: DiceLoss\.forward"):
        impl.activate(ctx, "fake_dice0")

    def dice_loss(pred: Any, target: Any, weight: Any = None, eps: float = 1e-3) -> Any:
        return pred

    fake.__dict__.update(DiceLoss=dice_mod.DiceLoss, dice_loss=dice_loss)
    with pytest.raises(NotApplicable, match=r"not the mmseg 0\.x formulation"):
        impl.activate(ctx, "fake_dice0")
    monkeypatch.setitem(sys.modules, "fake_dice0b", types.ModuleType("fake_dice0b"))
    with pytest.raises(NotApplicable, match="lacks"):
        impl.activate(ctx, "fake_dice0b")


RUN = """
import torch
from mmseg.models.losses import DiceLoss
loss = DiceLoss(exponent=2, smooth=1, class_weight=[1.0, 2.0, 1.0, 0.5, 1.0])
x = torch.randn(2, 5, 8, 8, requires_grad=True)
t = torch.randint(0, 5, (2, 8, 8))
t[:, 0] = 255
loss(x, t).backward()
assert torch.isfinite(x.grad).all()
"""


def test_end_to_end_summary(run_loongkit: Callable[..., Any]) -> None:
    result = run_loongkit(argv=[sys.executable, "-c", RUN], env={"LOONGKIT_DICE_LOSS": "1"})
    assert result.returncode == 0, result.stderr
    row = result.feature("dice_loss")
    assert row["active"] and row["calls"] == 1, row


def test_end_to_end_mmseg_out_of_range(run_loongkit: Callable[..., Any], tmp_path: Path) -> None:
    """Metadata saying mmseg 1.2.0 (first on sys.path): outside 0.12.0..1.0.0, so not applicable."""
    meta = tmp_path / "site" / "mmsegmentation-1.2.0.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: mmsegmentation\nVersion: 1.2.0\n")
    result = run_loongkit(argv=[sys.executable, "-c", RUN],
                          env={"LOONGKIT_DICE_LOSS": "1", "PYTHONPATH": str(tmp_path / "site")})
    assert result.returncode == 0, result.stderr
    row = result.feature("dice_loss")
    assert row["state"] == "not applicable" and "1.2.0" in row["reason"], row


def test_end_to_end_version_gate(run_loongkit: Callable[..., Any]) -> None:
    """The 1.x feature's range excludes mmseg 0.30: it says so and leaves the loss alone."""
    result = run_loongkit(argv=[sys.executable, "-c", RUN], env={"LOONGKIT_DICE_LOSS_MMSEG1": "1"})
    assert result.returncode == 0, result.stderr
    row = result.feature("dice_loss_mmseg1")
    assert not row["active"] and "mmseg" in str(row), row
