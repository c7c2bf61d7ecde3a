"""DataLoader workers (fork, spawn, forkserver) and torchrun ranks: roles, worker hooks, one Summary."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from loongkit_core.testing import free_port, install_fake_plugin

pytest.importorskip("torch")

# A feature that registers a DataLoader worker-start callback writing "<role> <worker_id>" per worker.
WORKER_PLUGIN = '''
import os
from loongkit_core.feature import Category, Feature
from loongkit_core.kit import FeatureImpl, PluginSpec
from loongkit_core import workers

plugin = PluginSpec("workerdemo")


class Tag(FeatureImpl):
    def activate(self, ctx, target):
        out = os.environ["WORKER_MARKS"]

        def tag(worker_id):
            with open(os.path.join(out, f"{os.getpid()}"), "w") as fh:
                fh.write(f"{ctx.env.process.role} {worker_id}")
            ctx.mark_active()

        workers.on_worker_start(tag, owner="worker_tag")


plugin.add(Feature(name="worker_tag", env="LOONGKIT_WORKER_TAG", level=1, category=Category.OTHER,
                   description="tags DataLoader workers"), impl="worker_plugin:Tag")
'''

LOADER = '''
import sys, torch
from torch.utils.data import DataLoader, TensorDataset

def main():
    ds = TensorDataset(torch.arange(16.0).reshape(8, 2))
    ctx = sys.argv[1]
    total = 0.0
    for epoch in range(2):
        for (batch,) in DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=ctx,
                                    persistent_workers=(epoch == 0 and ctx == "spawn") and False):
            total += float(batch.sum())
    print("total", total)

if __name__ == "__main__":
    main()
'''


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_dataloader_workers(tmp_path: Path, run_loongkit, context: str) -> None:  # type: ignore[no-untyped-def]
    site = install_fake_plugin(tmp_path / "site", "worker_plugin", WORKER_PLUGIN, entry_point="worker_plugin:plugin")
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "train.py"
    script.write_text(LOADER)
    env = {"PYTHONPATH": str(site), "LOONGKIT_WORKER_TAG": "1", "LOONGKIT_ALLOW_TF32": "1",
           "WORKER_MARKS": str(marks)}
    r = run_loongkit(env=env, argv=[sys.executable, str(script), context], cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "total 240.0" in r.stdout
    assert r.summaries_printed == 1, r.stdout
    tags = sorted(p.read_text() for p in marks.iterdir())
    assert len(tags) == 4, tags  # 2 workers x 2 epochs, each a fresh process
    assert all(t.split()[0] == "worker" for t in tags), tags
    assert sorted(t.split()[1] for t in tags) == ["0", "0", "1", "1"]
    # The callback ran in the workers, not the main process; the main's record cannot see it
    # for spawn/forkserver (separate interpreters), which is why the Summary is per main process.
    assert r.feature("allow_tf32")["state"] in ("applied", "active")


TRAIN_DDP = '''
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
print("rank", dist.get_rank(), "done", flush=True)
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_torchrun_two_ranks(tmp_path: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    script = tmp_path / "ddp.py"
    script.write_text(TRAIN_DDP)
    env = {"LOONGKIT_ALLOW_TF32": "1", "OMP_NUM_THREADS": "1"}
    r = run_loongkit(env=env, argv=[torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), str(script)],
                     cwd=str(tmp_path), timeout=240)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("done") == 2
    assert r.summaries_printed == 1, r.stdout  # local rank 0 only
    logs = sorted(p.name for p in r.logdir.glob("*.log"))
    assert any("rank0" in name for name in logs) and any("rank1" in name for name in logs), logs
    assert len([n for n in logs if "rank" in n]) == 2  # the torchrun agent itself logs nothing
    for log in r.logdir.glob("*rank*.log"):
        assert "Loongkit Feature Summary" in log.read_text()  # every rank's Summary goes to its log
    assert r.summary_path is not None
    json_files = sorted(p.name for p in r.summary_path.parent.glob("summary*.json"))
    assert json_files == ["summary.json", "summary.rank1.json"], json_files
