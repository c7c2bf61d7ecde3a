"""The Summary tells the truth across processes: work done only in DataLoader workers (fork, spawn,
forkserver, persistent, dying) and in other torchrun ranks reaches the main process's Summary, with
call counts; and a process that trains nothing keeps its stdout clean."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from loongkit_core.testing import free_port, install_fake_plugin

pytest.importorskip("torch")

# A third-party feature that patches a function of the user's own module; the job calls it only inside
# DataLoader workers (like PhotoMetricDistortion in a pipeline).
PLUGIN = '''
from loongkit_core.feature import Category, Feature
from loongkit_core.kit import FeatureImpl, PluginSpec

plugin = PluginSpec("counting")


class Fast(FeatureImpl):
    def activate(self, ctx, target):
        import userlib
        ctx.patcher.patch(userlib, "augment", ctx.counted(userlib.augment))


plugin.add(Feature(name="fast_augment", env="LOONGKIT_FAST_AUGMENT", level=1, category=Category.DATA,
                   description="counts augment calls", targets=("userlib",)), impl="counting_plugin:Fast")
'''

USERLIB = '''
def augment(x):
    return x * 2
'''

LOADER = '''
import os, sys, time, torch
from torch.utils.data import DataLoader, Dataset
import userlib

class DS(Dataset):
    def __init__(self, die):
        self.die = die
    def __len__(self):
        return 12
    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        out = userlib.augment(torch.tensor([float(i)]))
        if self.die and info.id == 1 and i >= 6:
            time.sleep(2.5)  # long enough for the worker's periodic report, then die without notice
            os._exit(9)
        return out

def main():
    ctx, persistent, die = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
    loader = DataLoader(DS(die), batch_size=1, num_workers=2, multiprocessing_context=ctx,
                        persistent_workers=persistent)
    seen = 0
    try:
        for epoch in range(2):
            for batch in loader:
                seen += 1
    except RuntimeError as exc:
        print("worker died:", type(exc).__name__)
    print("seen", seen)

if __name__ == "__main__":
    main()
'''


def _setup(tmp_path: Path) -> tuple[Path, Path]:
    site = install_fake_plugin(tmp_path / "site", "counting_plugin", PLUGIN, entry_point="counting_plugin:plugin")
    (site / "userlib.py").write_text(USERLIB)
    script = tmp_path / "train.py"
    script.write_text(LOADER)
    return site, script


def _row(stdout: str, name: str) -> str:
    rows = [line for line in stdout.splitlines() if line.startswith(name)]
    assert len(rows) == 1, stdout
    return rows[0]


@pytest.mark.slow
@pytest.mark.parametrize(("context", "persistent"), [("fork", "0"), ("spawn", "0"), ("forkserver", "0"),
                                                     ("fork", "1"), ("spawn", "1")])
def test_worker_only_activity_is_starred_with_counts(tmp_path: Path, run_loongkit, context: str,  # type: ignore[no-untyped-def]
                                                     persistent: str) -> None:
    site, script = _setup(tmp_path)
    r = run_loongkit(env={"PYTHONPATH": str(site), "LOONGKIT_FAST_AUGMENT": "1"},
                     argv=[sys.executable, str(script), context, persistent, "0"], cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "seen 24" in r.stdout
    row = r.feature("fast_augment")
    # 12 items x 2 epochs, all in workers; the main process itself never called it.
    assert row["calls"] == 0 and row["worker_calls"] == 24 and row["workers"] == 2, row
    assert row["active"] and row["state"] == "active"
    text = _row(r.stdout, "fast_augment")
    assert re.search(r"fast_augment\s+\*", text) and "(2 workers, 24 calls)" in text, text
    # Workers that logged nothing left no log file; the main's log holds the Summary.
    logs = list(r.logdir.glob("*.log"))
    assert len(logs) == 1 and all(p.stat().st_size > 0 for p in logs), [p.name for p in logs]


@pytest.mark.slow
def test_a_worker_that_dies_keeps_what_it_reported(tmp_path: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    site, script = _setup(tmp_path)
    r = run_loongkit(env={"PYTHONPATH": str(site), "LOONGKIT_FAST_AUGMENT": "1"},
                     argv=[sys.executable, str(script), "fork", "0", "1"], cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "worker died" in r.stdout
    row = r.feature("fast_augment")
    # Worker 0 finished or was stopped (its loop returned or SIGTERM); worker 1 flushed before dying.
    assert row["workers"] == 2 and row["worker_calls"] >= 7, row


@pytest.mark.slow
def test_torchrun_local_rank0_shows_the_node(tmp_path: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    site, _ = _setup(tmp_path)
    ddp = tmp_path / "ddp.py"
    ddp.write_text('''
import os, sys, torch, torch.distributed as dist
import userlib
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 1:  # only rank 1 uses the feature, in its main process and in its workers
    from torch.utils.data import DataLoader
    for _ in DataLoader([torch.zeros(1)] * 4, batch_size=1, num_workers=2,
                        collate_fn=lambda b: userlib.augment(b[0])):
        pass
    userlib.augment(torch.zeros(1))
dist.barrier()
dist.destroy_process_group()
''')
    torchrun = Path(sys.executable).with_name("torchrun")
    r = run_loongkit(env={"PYTHONPATH": str(site), "LOONGKIT_FAST_AUGMENT": "1"},
                     argv=[str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), str(ddp)],
                     cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.summaries_printed == 1, r.stdout
    text = _row(r.stdout, "fast_augment")
    assert re.search(r"fast_augment\s+\*", text), text
    assert "(rank 1 of 2, 2 workers, 5 calls)" in text, text
    assert "No activity report" not in r.stdout  # both ranks reported (node rows name global ranks)
    rank0 = r.feature("fast_augment")  # LOONGKIT_SUMMARY_JSON without {rank}: rank 0's own file
    assert rank0["calls"] == 0 and rank0["worker_calls"] == 0
    assert rank0["node"]["1"] == {"calls": 1, "worker_calls": 4, "workers": 2}, rank0
    rank1 = r.summary_path.with_name("summary.rank1.json").read_text()
    assert '"worker_calls": 4' in rank1


def test_a_process_that_trains_nothing_prints_nothing(tmp_path: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    r = run_loongkit("print(1)", env={"LOONGKIT_ALL": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == "1\n"
    assert "Loongkit Feature Summary" in r.logs()  # still in its log
    r = run_loongkit("import site; print(site.getsitepackages()[0])", env={"LOONGKIT_ALL": "3"})
    assert r.stdout.count("\n") == 1 and "Loongkit" not in r.stdout


def test_a_helper_that_imports_torch_keeps_stdout_clean(tmp_path: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    # NGPU=$(python -c "import torch; print(torch.cuda.device_count())") in a container-wide setup.
    r = run_loongkit("import torch; print(torch.cuda.device_count())", env={"LOONGKIT_ALL": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().isdigit() and r.summaries_printed == 0, r.stdout
    assert "Loongkit Feature Summary" in r.logs()


def test_an_optimizer_step_makes_it_a_training_job(tmp_path: Path, run_loongkit) -> None:  # type: ignore[no-untyped-def]
    code = ("import torch\n"
            "m = torch.nn.Linear(2, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "m(torch.ones(1, 2)).sum().backward(); opt.step(); print('stepped')\n")
    r = run_loongkit(code, env={"LOONGKIT_ALLOW_TF32": "1"})  # a feature that does not run on a CPU
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("stepped\n") and r.summaries_printed == 1, r.stdout


def test_the_command_loongkit_run_started_prints_when_it_imports_a_target(tmp_path: Path) -> None:
    import subprocess

    from loongkit_core.testing import clean_environ

    env = clean_environ()
    env.update({"LOONGKIT_ALLOW_TF32": "1", "LOONGKIT_LOGDIR": str(tmp_path / "logs")})
    run = Path(sys.executable).with_name("loongkit-run")
    direct = subprocess.run([str(run), sys.executable, "-c", "import torch"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert direct.returncode == 0, direct.stderr
    assert direct.stdout.count("Loongkit Feature Summary") == 1, direct.stdout
    # ... but not the Pythons a script it started runs (their pid is not the one loongkit-run exec'd).
    script = tmp_path / "job.sh"
    script.write_text(f'N=$({sys.executable} -c "import torch; print(7)")\necho "got $N"\n')
    inner = subprocess.run([str(run), "bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert inner.returncode == 0, inner.stderr
    assert inner.stdout == "got 7\n", inner.stdout
