"""LOONGKIT_COMPILE_PI0PYTORCH on the published lerobot (from the registry): `nox -s published-lerobot`.

lerobot's ``PI0Policy.forward`` computes the loss with ``self.model.forward(...)``: a compile of the module's
call alone is applied but never runs there (the Summary read "[applied, its code did not run]", 0 calls).
The job (lerobot_pi0_job.py) trains the real ``PI0Policy`` for three steps beside an eager copy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lerobot.policies.pi0.modeling_pi0", reason="lerobot is installed by nox -s published-lerobot")
pytestmark = pytest.mark.published

JOB = Path(__file__).with_name("lerobot_pi0_job.py")
GROUP = "lerobot.policies.pi0.modeling_pi0.PI0Pytorch"


def test_pi0_policy_training_step_is_compiled(tmp_path: Path, run_loongkit: Any) -> None:
    out = tmp_path / "job.json"
    r = run_loongkit(argv=[sys.executable, str(JOB), str(out)], env={"LOONGKIT_COMPILE_PI0PYTORCH": "1"},
                     timeout=1500)
    print(r.stdout[-4000:], r.stderr[-4000:])
    assert r.returncode == 0
    row = r.feature("compile_pi0pytorch")
    assert row["state"] == "active", row  # starred: its compiled forward ran
    assert row["calls"] == 3  # the three training steps of the compiled policy; the eager copy's are not
    config = row["config"]
    assert config["compiled"] == {GROUP: 1} and config["fallback"] == {}
    assert config["compiles"] >= 1 and config["compile_seconds"] > 0
    assert config["eager"] == {GROUP: "already compiled by config.compile_model"}  # lerobot's own switch
    result = json.loads(out.read_text())
    for ours, eager in zip(result["losses"], result["eager_losses"], strict=True):
        assert ours == pytest.approx(eager, rel=1e-5)
    assert result["grad0_params"] > 50 and result["grad0_max_rel"] < 1e-4, result
