"""`loongkit compare`: both runs, parsed metrics, loss match, the Summary, JSON."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loongkit_core.compare import (
    PROGRESS_ENV,
    RunStats,
    StepCounter,
    _Spinner,
    compare_losses,
    first_loss_difference,
    parse_metrics,
    pool,
    progress_text,
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


def test_step_counter_counts_as_parse_metrics_reads() -> None:
    """Streamed line by line, the live count is what the finished output parses to: the larger of the loss and
    time counts, lines holding several (\\f), nothing after the Feature Summary."""
    lines = [
        "step 0 loss: 1.0 time: 0.1\n",
        "val_loss: 9.0 data_time: 0.2\n",  # neither a training loss nor a step time
        "time: 0.3\n",
        "loss=0.9\x0closs=0.8 time: 0.2\n",  # one streamed line, two for str.splitlines
        "no numbers here\n",
        "{'loss': 0.7, 'grad_norm': 1.0}\n",
        "============================ Loongkit Feature Summary ====\n",
        "loss: 5.0 time: 5.0\n",
    ]
    counter = StepCounter()
    for line in lines:
        counter.feed(line)
    metrics = parse_metrics("".join(lines))
    assert counter.state[0] == max(len(metrics["loss"]), len(metrics["time"])) == 4
    assert RunStats("x", losses=metrics["loss"], step_times=metrics["time"]).logged_steps() == 4
    assert RunStats("x", returncode=1, losses=[1.0]).logged_steps() is None and RunStats("x").logged_steps() is None


def test_step_counter_takes_the_scripts_total_once_two_steps_agree() -> None:
    def total(lines: list[str]) -> list[int | None]:
        counter, seen = StepCounter(hint=True), []
        for line in lines:
            counter.feed(line)
            seen.append(counter.script_total)
        return seen

    assert total([f"Iter(train) [{i}/40] time: 0.5 loss: 1.0" for i in (1, 2, 3)]) == [None, 40, 40]
    assert total([f"step {i}/6 loss: 1.0" for i in (0, 1)]) == [None, 6]  # 0-based
    # A date stays put while the count moves; an epoch's own counter restarts; logging every 10th step.
    assert total([f"01/05 10:00:0{i} - loss: 1.0" for i in (1, 2, 3)]) == [None, None, None]
    assert total(["[1][1/2] loss: 1", "[1][2/2] loss: 1", "[2][1/2] loss: 1"]) == [None, 2, None]
    assert total([f"[{i}/50] loss: 1" for i in (10, 20)]) == [None, None]


def test_progress_text() -> None:
    # 5 steps in 20 s after the first (4 s each), 3 left, the current one 1 s along: ~11 s left.
    assert progress_text(5, 8, 0.0, 10.0, 26.0, 27.0) == "step 5/8, 27 s so far, ~11 s left"
    assert progress_text(1, 8, 0.0, 10.0, 10.0, 12.0) == "step 1/8, 12 s so far"  # one step: no mean yet
    assert progress_text(9, 8, 0.0, 1.0, 9.0, 9.5) == "step 9, 10 s so far"  # more than the previous run
    assert progress_text(3, None, 0.0, 1.0, 3.0, 4.0) == "step 3, 4 s so far"
    assert progress_text(0, None, 0.0, 0.0, 0.0, 15.0) == "no step logged yet, 15 s so far"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_updates_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal: in place every 0.5 s (whatever the interval for pipes), blanked at the end."""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    counter = StepCounter()
    with _Spinner("loongkit compare: baseline", counter, total=4, every=60.0):
        counter.feed("loss: 1.0\n")
        counter.feed("loss: 0.5\n")
        time.sleep(0.8)
    text = terminal.getvalue()
    assert "\n" not in text and text.startswith("\rloongkit compare: baseline step 2/4, ")
    assert text.endswith("\r") and text.rsplit("\r", 2)[1].strip() == ""


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
    env[PROGRESS_ENV] = "120"  # the default 15 s, with room for a loaded machine: this run is shorter
    r = subprocess.run([LOONGKIT, "compare", "--json", str(out), "--", sys.executable, str(script)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "loongkit compare:" not in r.stderr  # shorter than the interval: no progress line
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


# Eight steps of ~0.3 s, flushed as a training log to a pipe is; no torch, so that start-up stays short.
SLOW = """
import time
for step in range(8):
    time.sleep(0.3)
    print(f"step {step} loss: {1.0 / (step + 1):.6f} time: 0.3", flush=True)
"""


def test_compare_progress_off_a_terminal(tmp_path: Path) -> None:
    """Piped (nox, CI), each run longer than the interval prints progress lines to stderr: the step count,
    out of the previous run's count from the second run on, and the time left; stdout keeps the table."""
    script = tmp_path / "train.py"
    script.write_text(SLOW)
    env = clean_environ()
    env.update(LOONGKIT_LOGDIR=str(tmp_path / "logs"), **{PROGRESS_ENV: "0.5"})
    r = subprocess.run([LOONGKIT, "compare", "--", sys.executable, str(script)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("loongkit compare: ")]
    assert "\r" not in r.stderr and lines, r.stderr
    pattern = re.compile(r"loongkit compare: (baseline|loongkit) (?:step (\d+)(?:/(\d+))?|no step logged yet), "
                         r"\d+ s so far(?:, ~\d+ s left)?")
    runs: dict[str, list[tuple[int, str | None]]] = {"baseline": [], "loongkit": []}
    for line in lines:
        match = pattern.fullmatch(line)
        assert match, line
        runs[match.group(1)].append((int(match.group(2) or 0), match.group(3)))
    assert runs["baseline"] and runs["loongkit"], lines
    assert all(total is None for _, total in runs["baseline"])  # the first run: no total to go by
    assert all(total == "8" for steps, total in runs["loongkit"] if steps), lines  # the baseline's 8 steps
    assert any(steps for steps, _ in runs["loongkit"]) and any("s left" in line for line in lines), lines
    assert "loongkit compare:" not in r.stdout
    assert "first 8 losses: bitwise identical" in r.stdout
    assert "  baseline: 1.0000 0.5000 0.3333 0.2500 0.2000 0.1667 0.1429 0.1250" in r.stdout
