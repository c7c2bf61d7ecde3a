"""LOONGKIT_DICE_LOSS_MMSEG1: mmseg >= 1.1's rewritten DiceLoss on the fused CPU kernel.

The seed's LOONGKIT_DICE_LOSS covers 0.12.0 <= mmseg <= 1.0.0, whose DiceLoss is a different
formulation (per-class dice with a valid mask, smooth and exponent, class weights). mmseg 1.1
rewrote it: per sample, over all kept classes and pixels at once, ``1 - 2a/(b+c)`` (V-Net) or
``1 - (2a+eps)/(b+c+eps)`` (naive), with sigmoid or softmax activation, ignore_index meaning "drop
that class channel", per-sample weights and avg_factor. Rather than widening the seed variable's
version range (which would change what LOONGKIT_DICE_LOSS=1 means on an upgraded install), this
variant is its own feature with its own variable and range.

The patched ``DiceLoss.forward`` computes the three per-sample sums with ``loongkit::dice_stats``
(one pass over the logits; the backward recomputes the activation from the logits) and hands the
[N] loss to mmseg's own ``weight_reduce_loss``. Inputs the kernel does not take (dense one-hot
targets, non-int64 labels, other devices or dtypes, not 4-D) run the original forward unchanged.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl

TARGET = "mmseg.models.losses.dice_loss"
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
        module = sys.modules[target or TARGET]
        problem = interface_problem(module)
        if problem:
            raise NotApplicable(problem)
        import torch

        from loongkit_ops import kernels
        from loongkit_ops.kernels import ops
        from loongkit_ops.patches.msda import _kernel_ready

        cls = module.DiceLoss
        original = cls.forward
        record = ctx.record

        def unsupported(loss: Any, pred: Any, target: Any) -> bool:
            return not (isinstance(pred, torch.Tensor) and isinstance(target, torch.Tensor)
                        and pred.device.type == "cpu" and pred.dtype in (torch.float32, torch.float64)
                        and pred.dim() == 4 and target.dtype == torch.int64 and target.device.type == "cpu"
                        and target.shape == (pred.shape[0], *pred.shape[2:])
                        and all(hasattr(loss, a) for a in ATTRIBUTES))

        def forward(self: Any, pred: Any, target: Any, weight: Any = None, avg_factor: Any = None,
                    reduction_override: Any = None, ignore_index: Any = 255, **kwargs: Any) -> Any:
            # The kernel is built at the first eligible call (not when mmseg is imported).
            if unsupported(self, pred, target) or not _kernel_ready(kernels, record):
                return original(self, pred, target, weight, avg_factor, reduction_override, ignore_index, **kwargs)
            assert reduction_override in (None, "none", "mean", "sum")
            reduction = reduction_override if reduction_override else self.reduction
            channels = pred.shape[1]
            # Like upstream, the module's ignore_index (not the argument) picks the dropped class.
            ignore = self.ignore_index
            drop = ignore if ignore is not None and 0 <= ignore < channels else -1
            if drop >= 0 and channels == 1:
                return original(self, pred, target, weight, avg_factor, reduction_override, ignore_index, **kwargs)
            record.calls += 1
            stats = ops.dice_stats_op(pred.flatten(2), target.flatten(1), activation_code(self, channels), drop,
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
