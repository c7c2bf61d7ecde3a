"""`loongkit compare`: both runs, parsed metrics, loss match, the Summary, JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from loongkit_core.compare import (
    RunStats,
    compare_losses,
    first_loss_difference,
    parse_metrics,
    pool,
    render_table,
    repeat_agreement,
)
from loongkit_core.testing import clean_environ

LOONGKIT = shutil.which("loongkit") or str(Path(sys.executable).parent / "loongkit")


def test_parse_common_log_formats() -> None:
    text = "\n".join([
        "Epoch(train) [1][10/50]  lr: 1.0e-02  eta: 0:01:00  time: 0.2500  data_time: 0.0100  loss: 1.2345",
        "{'loss': 0.75, 'grad_norm': 1.0, 'learning_rate': 5e-05, 'epoch': 0.1}",
        "step    3 loss: 0.500000 time: 0.0100 data_time: 0.0010",
        "val_loss: 9.0",  # not the training loss
        "no numbers here",
    ])
    metrics = parse_metrics(text)
    assert metrics["loss"] == [1.2345, 0.75, 0.5]
    assert metrics["time"] == [0.25, 0.01] and metrics["data_time"] == [0.01, 0.001]


def test_compare_losses() -> None:
    assert compare_losses([1.0, 2.0], [1.0, 2.0], 5) == {"compared": 2, "bitwise": True, "max_rel_diff": 0.0}
    result = compare_losses([1.0, 2.0], [1.0, 2.002], 5)
    assert not result["bitwise"] and abs(result["max_rel_diff"] - 0.002 / 2.002) < 1e-12


def test_first_loss_checked_apart() -> None:
    # Later losses carry training's amplification of rounding; the first one only the code's own difference.
    base, ours = RunStats("baseline", losses=[10.0, 9.0, 8.0]), RunStats("loongkit", losses=[10.00001, 9.1, 8.2])
    assert abs(first_loss_difference(base.losses, ours.losses) - 1e-6) < 1e-9
    assert first_loss_difference([], ours.losses) is None
    losses = compare_losses(base.losses, ours.losses, 3)
    within = render_table(base, ours, losses, 0.05, first_tolerance=2e-5)
    assert "loss #0 (same weights, same batch): 1.0e-06 relative (within tolerance 2e-05)" in within
    assert "(within tolerance 0.05)" in within
    outside = render_table(base, ours, losses, 0.05, first_tolerance=1e-7)
    assert "relative (OUTSIDE tolerance 1e-07)" in outside
    assert "(same weights, same batch)" not in render_table(base, ours, losses, 0.05)  # only when asked


def test_repeated_runs_pool_their_warm_steps() -> None:
    # Each run's first fifth is warm-up; the pooled side keeps every run's warm steps and no second trim.
    a = RunStats("baseline", wall_s=10.0, peak_rss_bytes=5, losses=[3.0, 2.0], step_times=[9.0] + [1.0] * 4)
    b = RunStats("baseline", wall_s=30.0, peak_rss_bytes=7, losses=[3.0, 2.0], step_times=[9.0] + [3.0] * 4)
    pooled = pool([a, b])
    assert pooled.step_times == [1.0] * 4 + [3.0] * 4 and pooled.median(pooled.step_times) == 2.0
    assert pooled.wall_s == 20.0 and pooled.peak_rss_bytes == 7 and pooled.run_step_medians == [1.0, 3.0]
    assert pool([a]) is a and repeat_agreement([a], 5) is None
    assert repeat_agreement([a, b], 5) == "identical losses in its 2 runs"
    c = RunStats("baseline", losses=[3.0, 2.2])
    assert "differ between its own 2 runs by up to 9.1e-02 relative" in (repeat_agreement([a, c], 5) or "")
    ours = pool([RunStats("loongkit", losses=[3.0, 2.0], step_times=[9.0] + [0.5] * 4),
                 RunStats("loongkit", losses=[3.0, 2.0], step_times=[9.0] + [2.0] * 4)])
    table = render_table(pooled, ours, compare_losses(pooled.losses, ours.losses, 5), 0.05,
                         agreement=(repeat_agreement([a, c], 5), None))
    assert "1.60x" in table  # pooled medians 2.0 / 1.25
    each = next(line for line in table.splitlines() if line.startswith("  each run's median"))
    assert "1000/3000 ms" in each and "500/2000 ms" in each and each.endswith("1.50-2.00x")
    assert "baseline: losses differ between its own 2 runs" in table


SCRIPT = """
import torch
torch.manual_seed(0)
w = torch.zeros(4, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
for step in range(6):
    loss = ((w - torch.arange(4.0)) ** 2).sum()
    opt.zero_grad(); loss.backward(); opt.step()
    print(f"step {step} loss: {loss.item():.6f} time: 0.001")
"""


def test_compare_end_to_end(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "cmp.json"
    env = clean_environ()
    env["LOONGKIT_LOGDIR"] = str(tmp_path / "logs")
    r = subprocess.run([LOONGKIT, "compare", "--json", str(out), "--", sys.executable, str(script)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "first 6 losses: bitwise identical" in r.stdout
    assert "Loongkit Feature Summary" in r.stdout and "allow_tf32" in r.stdout
    data = json.loads(out.read_text())
    assert data["losses"]["bitwise"] and len(data["baseline"]["losses"]) == 6
    assert data["summary"]["features"]  # the loongkit run's JSON Summary


def test_compare_repeat_alternates_and_checks_each_side(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    mark = "import os\nopen(os.environ['ORDER'], 'a').write(os.environ.get('LOONGKIT_ALL', '-'))\n"
    script.write_text(SCRIPT + "\n" + mark)
    out, order = tmp_path / "cmp.json", tmp_path / "order"
    env = clean_environ()
    env.update(LOONGKIT_LOGDIR=str(tmp_path / "logs"), ORDER=str(order))
    r = subprocess.run([LOONGKIT, "compare", "--repeat", "2", "--json", str(out), "--", sys.executable, str(script)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert order.read_text() == "-1-1"  # baseline, loongkit, baseline, loongkit
    assert "baseline: identical losses in its 2 runs" in r.stdout
    assert "loongkit: identical losses in its 2 runs" in r.stdout and "  each run's median" in r.stdout
    data = json.loads(out.read_text())
    assert data["repeat"] == 2 and data["summary"]["features"]
    bad = subprocess.run([LOONGKIT, "compare", "--repeat", "0", "--", sys.executable, str(script)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "must be at least 1" in bad.stderr
