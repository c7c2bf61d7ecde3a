"""mmseg's DiceLoss on fused CPU kernels: two features, one per formulation.

LOONGKIT_DICE_LOSS (the seed's variable, 0.12.0 <= mmseg <= 1.0.0): mmseg 0.x's loss. Per class i
(skipping i == ignore_index) and sample n, with p = softmax(pred), t = one-hot of
clamp(target, 0, C-1) and valid = target != ignore_index:
``1 - (2 * sum(p*t*valid) + smooth) / (sum(p^e + t^e) + smooth)``, averaged over the batch, times
class_weight[i], summed and divided by C (ignored class included in C); the valid mask is on the
numerator only, so an ignored pixel (255 -> class C-1) still counts in class C-1's denominator.
The patched forward gets the [N, C] sums from ``loongkit::dice_class_stats`` (one pass over the
logits, fused backward) and keeps upstream's reduction (mmseg's own ``weight_reduce_loss``).

LOONGKIT_DICE_LOSS_MMSEG1 (mmseg >= 1.1): mmseg 1.1 rewrote it: per sample, over all kept classes
and pixels at once, ``1 - 2a/(b+c)`` (V-Net) or ``1 - (2a+eps)/(b+c+eps)`` (naive), with sigmoid or
softmax activation, ignore_index meaning "drop that class channel", per-sample weights and
avg_factor. Rather than widening the seed variable's version range (which would change what
LOONGKIT_DICE_LOSS=1 means on an upgraded install), this variant is its own feature with its own
variable and range. Its patched ``DiceLoss.forward`` computes the three per-sample sums with
``loongkit::dice_stats`` (one pass over the logits; the backward recomputes the activation from the
logits) and hands the [N] loss to mmseg's own ``weight_reduce_loss``.

Both: inputs the kernels do not take (dense one-hot targets, float labels, other devices or dtypes,
options outside what the kernel computes) run the original forward unchanged, and the kernels are
built at the first eligible call, not when mmseg is imported.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl

FORWARD_PARAMS = ["self", "pred", "target", "weight", "avg_factor", "reduction_override", "ignore_index", "kwargs"]
DICE_LOSS_PARAMS = ["pred", "target", "weight", "eps", "reduction", "naive_dice", "avg_factor", "ignore_index"]
ATTRIBUTES = ("use_sigmoid", "activate", "reduction", "naive_dice", "loss_weight", "eps", "ignore_index")


def interface_problem(module: Any) -> str | None:
    """None when ``module`` is mmseg 1.1+'s dice_loss module, else what differs."""
    cls = getattr(module, "DiceLoss", None)
    fn = getattr(module, "dice_loss", None)
    if cls is None or not callable(fn) or not callable(getattr(module, "weight_reduce_loss", None)):
        return f"interface differs: {module.__name__} lacks DiceLoss, dice_loss or weight_reduce_loss"
    if not callable(getattr(module, "_expand_onehot_labels_dice", None)):
        return "interface differs: no _expand_onehot_labels_dice (not the mmseg >= 1.1 formulation)"
    try:
        fparams = list(inspect.signature(cls.forward).parameters)
        dparams = list(inspect.signature(fn).parameters)
        iparams = list(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return "interface differs: cannot read DiceLoss signatures"
    if fparams != FORWARD_PARAMS:
        return f"interface differs: DiceLoss.forward{tuple(fparams)}"
    if dparams != DICE_LOSS_PARAMS:
        return f"interface differs: dice_loss{tuple(dparams)}"
    missing = [a for a in ATTRIBUTES if a not in iparams]
    if missing:
        return f"interface differs: DiceLoss.__init__ lacks {missing}"
    return None


def activation_code(loss: Any, channels: int) -> int:
    """0 identity, 1 sigmoid, 2 softmax: DiceLoss.forward's rule (no softmax over a single class)."""
    if not loss.activate:
        return 0
    if loss.use_sigmoid:
        return 1
    return 2 if channels != 1 else 0


class DiceLossMmseg1(FeatureImpl):
    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        module = sys.modules[target or self.feature.targets[0]]
        problem = interface_problem(module)
        if problem:
            raise NotApplicable(problem)
        import torch

        from loongkit_ops.kernels.ops import dice_stats
        from loongkit_ops.patches import kernel

        cls = module.DiceLoss
        original = cls.forward
        count = ctx.count

        def unsupported(loss: Any, pred: Any, target: Any) -> bool:
            return not (isinstance(pred, torch.Tensor) and isinstance(target, torch.Tensor)
                        and pred.device.type == "cpu" and pred.dtype in (torch.float32, torch.float64)
                        and pred.dim() == 4 and target.dtype == torch.int64 and target.device.type == "cpu"
                        and target.shape == (pred.shape[0], *pred.shape[2:])
                        and all(hasattr(loss, a) for a in ATTRIBUTES))

        def forward(self: Any, pred: Any, target: Any, weight: Any = None, avg_factor: Any = None,
                    reduction_override: Any = None, ignore_index: Any = 255, **kwargs: Any) -> Any:
            # The kernel is built at the first eligible call (not when mmseg is imported).
            if unsupported(self, pred, target) or not kernel.ready(ctx):
                return original(self, pred, target, weight, avg_factor, reduction_override, ignore_index, **kwargs)
            assert reduction_override in (None, "none", "mean", "sum")
            reduction = reduction_override if reduction_override else self.reduction
            channels = pred.shape[1]
            # Like upstream, the module's ignore_index (not the argument) picks the dropped class.
            ignore = self.ignore_index
            drop = ignore if ignore is not None and 0 <= ignore < channels else -1
            if drop >= 0 and channels == 1:
                return original(self, pred, target, weight, avg_factor, reduction_override, ignore_index, **kwargs)
            count()
            stats = dice_stats.op(pred.flatten(2), target.flatten(1), activation_code(self, channels), drop,
                                      bool(self.naive_dice))
            a, b, c = stats.unbind(1)
            c = c.float()  # upstream's one-hot target is float32 whatever pred's dtype: so are c and c + eps
            eps = self.eps
            d = (2 * a + eps) / (b + c + eps) if self.naive_dice else (2 * a) / ((b + eps) + (c + eps))
            loss = 1 - d
            if weight is not None:
                assert weight.ndim == loss.ndim
                assert len(weight) == len(pred)
            return self.loss_weight * module.weight_reduce_loss(loss, weight, reduction, avg_factor)

        forward.__doc__ = original.__doc__
        forward.__wrapped__ = original  # type: ignore[attr-defined]
        ctx.patcher.patch(cls, "forward", forward)
        ctx.set_config({"mmseg.DiceLoss": "loongkit::dice_stats (CPU)"})
        ctx.log.info("mmseg DiceLoss uses the fused CPU kernel", target=module.__name__)


# ------------------------------------------------------------------------------------------------
# mmseg 0.x (LOONGKIT_DICE_LOSS)

FORWARD0_PARAMS = ["self", "pred", "target", "avg_factor", "reduction_override", "kwargs"]
DICE_LOSS0_PARAMS = ["pred", "target", "valid_mask", "smooth", "exponent", "class_weight", "ignore_index"]
ATTRIBUTES0 = ("smooth", "exponent", "reduction", "class_weight", "loss_weight", "ignore_index")


def _reducer(module: Any) -> Any:
    """mmseg 0.x's ``weight_reduce_loss`` (in the module that defines ``weighted_loss``), or None."""
    owner = sys.modules.get(getattr(getattr(module, "weighted_loss", None), "__module__", "") or "")
    fn = getattr(owner, "weight_reduce_loss", None)
    return fn if callable(fn) else None


def interface_problem0(module: Any) -> str | None:
    """None when ``module`` is mmseg 0.x's dice_loss module, else what differs."""
    cls = getattr(module, "DiceLoss", None)
    fn = getattr(module, "dice_loss", None)
    if cls is None or not callable(fn) or not callable(getattr(module, "binary_dice_loss", None)):
        return f"interface differs: {module.__name__} lacks DiceLoss, dice_loss or binary_dice_loss"
    if _reducer(module) is None:
        return "interface differs: no weight_reduce_loss beside mmseg's weighted_loss"
    try:
        fparams = list(inspect.signature(cls.forward).parameters)
        dparams = list(inspect.signature(inspect.unwrap(fn)).parameters)
        iparams = list(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return "interface differs: cannot read DiceLoss signatures"
    if fparams != FORWARD0_PARAMS:
        return f"interface differs: DiceLoss.forward{tuple(fparams)}"
    if dparams != DICE_LOSS0_PARAMS:
        return f"interface differs: dice_loss{tuple(dparams)} (not the mmseg 0.x formulation)"
    missing = [a for a in ATTRIBUTES0 if a not in iparams]
    if missing:
        return f"interface differs: DiceLoss.__init__ lacks {missing}"
    names = getattr(getattr(cls.forward, "__code__", None), "co_names", ())
    if "softmax" not in names or "dice_loss" not in names:
        return "interface differs: DiceLoss.forward does not softmax and call dice_loss"
    return None


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class DiceLossMmseg0(FeatureImpl):
    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        module = sys.modules[target or self.feature.targets[0]]
        problem = interface_problem0(module)
        if problem:
            raise NotApplicable(problem)
        import torch

        from loongkit_ops.kernels.ops import dice_class_stats
        from loongkit_ops.patches import kernel

        cls = module.DiceLoss
        original = cls.forward
        reducer = _reducer(module)
        count = ctx.count

        def eligible(loss: Any, pred: Any, target: Any) -> bool:
            if not (isinstance(pred, torch.Tensor) and isinstance(target, torch.Tensor)
                    and pred.device.type == "cpu" and pred.dtype in (torch.float32, torch.float64)
                    and pred.dim() >= 2 and pred.shape[1] > 0 and pred.numel() > 0
                    and target.device.type == "cpu" and target.dtype in (torch.int64, torch.int32)
                    and target.shape == (pred.shape[0], *pred.shape[2:])):
                return False
            if not all(hasattr(loss, a) for a in ATTRIBUTES0):
                return False
            ignore, channels = loss.ignore_index, pred.shape[1]
            # exponent <= 0 makes 0^e special; an all-ignored class list makes upstream return a float.
            return (isinstance(ignore, int) and not isinstance(ignore, bool) and _number(loss.exponent)
                    and loss.exponent > 0 and _number(loss.smooth) and not (channels == 1 and ignore == 0))

        def forward(self: Any, pred: Any, target: Any, avg_factor: Any = None, reduction_override: Any = None,
                    **kwargs: Any) -> Any:
            if not eligible(self, pred, target):
                return original(self, pred, target, avg_factor, reduction_override, **kwargs)
            class_weight = None
            if self.class_weight is not None:
                class_weight = pred.new_tensor(self.class_weight)
                if class_weight.shape != (pred.shape[1],):  # let upstream report (or accept) it
                    return original(self, pred, target, avg_factor, reduction_override, **kwargs)
            # The kernel is built here, at the first eligible call (not when mmseg is imported).
            if not kernel.ready(ctx):
                return original(self, pred, target, avg_factor, reduction_override, **kwargs)
            assert reduction_override in (None, "none", "mean", "sum")
            reduction = reduction_override if reduction_override else self.reduction
            n, channels = pred.shape[:2]
            count()
            stats = dice_class_stats.op(pred.reshape(n, channels, -1), target.reshape(n, -1).long(),
                                            self.ignore_index, float(self.exponent))
            a, b, t = stats.unbind(-1)
            per_class = (1 - (a * 2 + self.smooth) / (b + t + self.smooth)).mean(0)  # binary_dice_loss: batch mean
            if class_weight is not None:
                per_class = per_class * class_weight
            ignore = self.ignore_index
            if 0 <= ignore < channels:  # that class is skipped but still counted in the division
                per_class = torch.cat([per_class[:ignore], per_class[ignore + 1:]])
            loss = per_class.sum() / channels
            return self.loss_weight * reducer(loss, None, reduction, avg_factor)

        forward.__doc__ = original.__doc__
        forward.__wrapped__ = original  # type: ignore[attr-defined]
        ctx.patcher.patch(cls, "forward", forward)
        ctx.set_config({"mmseg.DiceLoss": "loongkit::dice_class_stats (CPU)"})
        ctx.log.info("mmseg 0.x DiceLoss uses the fused CPU kernel", target=module.__name__)
