"""The feature's implementation: imported only when LOONGKIT_EXAMPLE_ANOMALY is enabled."""

from __future__ import annotations

import functools

from pydantic_settings import SettingsConfigDict

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_core.kit import FeatureImpl
from loongkit_core.settings import LkBool, LoongkitSettings


class AnomalyOptions(LoongkitSettings):
    """LOONGKIT_EXAMPLE_ANOMALY_CHECK_NAN: also raise on NaN produced in the backward pass."""

    model_config = SettingsConfigDict(env_prefix="LOONGKIT_EXAMPLE_ANOMALY_", extra="ignore")
    check_nan: LkBool = True


class Anomaly(FeatureImpl):
    options = AnomalyOptions

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        import torch

        options: AnomalyOptions = ctx.config  # type: ignore[assignment]
        set_anomaly = getattr(torch.autograd, "set_detect_anomaly", None)
        if set_anomaly is None:
            raise NotApplicable("torch.autograd.set_detect_anomaly is missing")
        previous = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        set_anomaly(True, check_nan=options.check_nan)
        # Every change goes through ctx.patcher, so the default deactivate (ctx.patcher.undo()) puts
        # back the mode found, and the original Tensor.backward.
        ctx.patcher.defer(functools.partial(set_anomaly, *previous))
        # Count backward passes so the Summary can star the feature only when autograd really ran.
        ctx.patcher.patch(torch.Tensor, "backward", ctx.counted(torch.Tensor.backward))
        ctx.log.info("autograd anomaly detection on", check_nan=options.check_nan)
