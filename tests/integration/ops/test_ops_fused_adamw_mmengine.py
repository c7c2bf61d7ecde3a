"""LOONGKIT_FUSED_ADAMW through mmengine's registries (OPTIMIZERS holds torch.optim.AdamW by reference)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.integration

BUILD = """
import torch
from mmengine.optim import build_optim_wrapper
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
wrapper = build_optim_wrapper(model, dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-3,
                                                                            weight_decay=0.05)))
opt = wrapper.optimizer
assert type(opt) is torch.optim.AdamW, type(opt)
for _ in range(3):
    wrapper.update_params(model(torch.randn(8, 16)).pow(2).mean())
print("fused", opt.param_groups[0]["fused"], getattr(opt, "_step_supports_amp_scaling", False))
sd = wrapper.state_dict()
again = build_optim_wrapper(model, dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-3)))
again.load_state_dict(sd)
print("reloaded", again.optimizer.param_groups[0]["fused"])
"""


def test_mmengine_build_optim_wrapper_is_fused(run_loongkit: Callable[..., Any]) -> None:
    result = run_loongkit(BUILD, env={"LOONGKIT_FUSED_ADAMW": "1"})
    assert result.returncode == 0, result.stderr
    assert "fused True True" in result.stdout and "reloaded True" in result.stdout
    row = result.feature("fused_adamw")
    assert row["active"] and row["calls"] == 3
    assert row["config"] == {"fused": 2, "fallback": {}}


def test_mmengine_without_loongkit_is_unfused(run_loongkit: Callable[..., Any]) -> None:
    result = run_loongkit(BUILD, env={})
    assert result.returncode == 0, result.stderr
    assert "fused None False" in result.stdout
