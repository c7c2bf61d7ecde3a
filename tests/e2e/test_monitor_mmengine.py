"""LOONGKIT_MONITOR on an mmengine Runner (IterBasedTrainLoop with validation inside training): the
steps are the loop's iterations (its optimizer steps do not count twice), validation belongs to no
step, and MAX_STEPS ends the run cleanly from the loop's after_train_iter."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

JOB = r'''
import sys, time
import torch
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from mmengine.runner import Runner
from torch.utils.data import Dataset


class Toy(BaseModel):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, inputs, labels, mode="tensor"):
        out = self.linear(torch.stack(inputs) if isinstance(inputs, list) else inputs)
        labels = torch.stack(labels) if isinstance(labels, list) else labels
        if mode == "loss":
            time.sleep(0.02)  # the planted compute of a step
            return {"loss": ((out.squeeze(-1) - labels) ** 2).mean()}
        return [(o, l) for o, l in zip(out, labels)]


class Data(Dataset):
    def __init__(self, n, delay):
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay)
        return {"inputs": torch.ones(4) * i, "labels": torch.tensor(float(i % 3))}


class Mse(BaseMetric):
    def process(self, data_batch, data_samples):
        self.results.extend(float((o - l) ** 2) for o, l in data_samples)

    def compute_metrics(self, results):
        return {"mse": sum(results) / max(1, len(results))}


runner = Runner(
    model=Toy(), work_dir=sys.argv[1],
    train_dataloader=dict(dataset=Data(64, 0.0), sampler=dict(type="DefaultSampler", shuffle=False), batch_size=2,
                          num_workers=0),
    train_cfg=dict(by_epoch=False, max_iters=12, val_interval=6),
    optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.01), accumulative_counts=2),
    val_dataloader=dict(dataset=Data(4, 0.1), sampler=dict(type="DefaultSampler", shuffle=False), batch_size=2,
                        num_workers=0),
    val_cfg=dict(), val_evaluator=dict(type=Mse), default_hooks=dict(logger=dict(type="LoggerHook", interval=100)),
)
runner.train()
print("TRAINED", flush=True)
'''


def run(run_loongkit: Any, tmp_path: Path, env: dict[str, str] | None = None) -> Any:
    pytest.importorskip("mmengine")
    script = tmp_path / "job.py"
    script.write_text(JOB)
    return run_loongkit(argv=[sys.executable, str(script), str(tmp_path / "work")],
                        env={"LOONGKIT_MONITOR": "1", "OMP_NUM_THREADS": "1", **(env or {})}, timeout=600)


def test_mmengine_iterations_are_the_steps_and_validation_is_paused(run_loongkit: Any, tmp_path: Path) -> None:
    r = run(run_loongkit, tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "TRAINED" in r.stdout
    d = r.feature("monitor")["details"]["monitor"]
    assert d["source"] == "mmengine iterations"
    assert d["steps"] == 12  # 6 optimizer steps (accumulative_counts=2) are not the steps
    assert d["hooks"]["mmengine.runner"].startswith("Runner/FlexibleRunner.call_hook")
    # two validations of 2 batches x 2 samples x 0.1 s: 0.4 s each, in no step
    assert d["paused_s"] == pytest.approx(0.8, abs=0.3)
    assert d["step_p90_s"] < 0.3


def test_mmengine_max_steps(run_loongkit: Any, tmp_path: Path) -> None:
    r = run(run_loongkit, tmp_path, {"LOONGKIT_MONITOR_MAX_STEPS": "4"})
    assert r.returncode == 0, r.stderr[-4000:]
    assert "TRAINED" not in r.stdout
    d = r.feature("monitor")["details"]["monitor"]
    assert d["steps"] == 4 and d["stopped_at_max_steps"] is True
