"""Multi-process reliability: persistent and crashing DataLoader workers, torchrun results unchanged."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from loongkit_core.testing import free_port

pytest.importorskip("torch")

WORKERS = '''
import sys, torch
from torch.utils.data import DataLoader, Dataset

class DS(Dataset):
    def __init__(self, crash_at):
        self.items = [{"x": float(i)} for i in range(2000)]  # a list of dicts: LOONGKIT_PYTORCH's target
        self.crash_at = crash_at
    def __len__(self):
        return 16
    def __getitem__(self, i):
        if i == self.crash_at:
            raise ValueError(f"bad sample {i}")
        return torch.tensor(self.items[i]["x"])

if __name__ == "__main__":
    ctx, crash = sys.argv[1], int(sys.argv[2])
    loader = DataLoader(DS(crash), batch_size=4, num_workers=2, persistent_workers=True,
                        multiprocessing_context=ctx)
    for epoch in range(2):
        print("epoch", epoch, sum(float(b.sum()) for b in loader), flush=True)
'''


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_persistent_workers_two_epochs(tmp_path: Path, run_loongkit, context: str) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "w.py"
    script.write_text(WORKERS)
    r = run_loongkit(env={"LOONGKIT_ALL": "1"}, argv=[sys.executable, str(script), context, "-1"], cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("120.0") == 2 and r.summaries_printed == 1


@pytest.mark.slow
def test_worker_exception_propagates_unchanged(tmp_path: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "w.py"
    script.write_text(WORKERS)
    bare = run_loongkit(env={}, prelude=False, argv=[sys.executable, str(script), "fork", "5"], cwd=str(tmp_path))
    ours = run_loongkit(env={"LOONGKIT_ALL": "1"}, argv=[sys.executable, str(script), "fork", "5"],
                        cwd=str(tmp_path))
    assert bare.returncode == ours.returncode == 1
    assert "ValueError: bad sample 5" in bare.stderr and "ValueError: bad sample 5" in ours.stderr
    assert ours.summaries_printed == 1 and bare.summaries_printed == 0


DDP = '''
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(dist.get_rank())
for _ in range(5):
    x = torch.randn(32, 8, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
if dist.get_rank() == 0:
    torch.save({k: v.clone() for k, v in model.module.state_dict().items()}, os.environ["OUT"])
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_torchrun_level1_results_match(tmp_path: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    import torch

    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    script = tmp_path / "ddp.py"
    script.write_text(DDP)
    results = {}
    for label, env, prelude in (("bare", {}, False), ("ours", {"LOONGKIT_ALL": "1"}, True)):
        port = str(free_port())
        out = tmp_path / f"{label}.pt"
        r = run_loongkit(env={**env, "OUT": str(out), "OMP_NUM_THREADS": "1"}, prelude=prelude,
                         argv=[torchrun, "--nproc-per-node", "2", "--master-port", port, str(script)],
                         cwd=str(tmp_path), timeout=300)
        assert r.returncode == 0, r.stderr
        results[label] = torch.load(out)
        if label == "ours":
            assert r.summaries_printed == 1
            assert r.feature("fused_adamw")["active"]
    for key, value in results["bare"].items():
        # fused AdamW (a level-1 feature) differs from the for-each path by ~1 float32 ulp per step
        torch.testing.assert_close(results["ours"][key], value, rtol=1e-5, atol=1e-6)
