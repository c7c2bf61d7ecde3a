"""A real small job under LOONGKIT_ALL=1 (issue 23): every line of the Summary it prints on stdout fits a
terminal (LINE_WIDTH), the '*' column agrees with the JSON, and the log file keeps the rows in full."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongkit_core.summary import LINE_WIDTH, NAME_WIDTH

# A few AdamW steps on a tiny model fed by two forked DataLoader workers: pytorch (with its ~400-character
# configuration), monitor (its section under the table), fused_adamw, config_guards ... all have rows.
JOB = """
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = TensorDataset(torch.randn(32, 8), torch.randn(32, 2))
for x, y in DataLoader(data, batch_size=8, num_workers=2, multiprocessing_context="fork"):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("trained")
"""


def summary_block(text: str) -> list[str]:
    start = text.index("Loongkit Feature Summary")
    start = text.rfind("\n", 0, start) + 1  # the whole title line
    end = text.index("\n" + "=" * 20, start)
    return text[start:text.index("\n", end + 1)].splitlines()


def test_a_real_job_prints_no_summary_line_over_the_width(run_loongkit: Any, tmp_path: Path) -> None:
    r = run_loongkit(JOB, {"LOONGKIT_ALL": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("trained\n") and r.summaries_printed == 1, r.stdout
    printed = summary_block(r.stdout)
    too_long = [line for line in printed if len(line) > LINE_WIDTH]
    assert not too_long, "\n".join(printed)
    assert any(line.startswith("Training monitor (") for line in printed)  # its section went the same way
    # the '*' column is the JSON's "active", row by row
    features = r.summary["features"]
    assert any(f["active"] for f in features) and any(not f["active"] for f in features)
    for f in features:
        (row,) = [line for line in printed if line.startswith(f"{f['name']:<{NAME_WIDTH}}")]
        assert row[NAME_WIDTH] == ("*" if f["active"] else " "), row
    pytorch = r.feature("pytorch")
    assert pytorch["active"] and pytorch["workers"] == 2 and "worker_malloc" in pytorch["config"]
    # the log file keeps every row in full (some are wider than a terminal: shortened on stdout only)
    logged = summary_block(r.logs())
    assert max(map(len, logged)) > LINE_WIDTH
    for f in features:
        assert any(line.startswith(f"{f['name']:<{NAME_WIDTH}}") for line in logged), f["name"]
    full_row = next(line for line in logged if line.startswith("pytorch "))
    assert f"'mmap_threshold': {pytorch['config']['worker_malloc']['mmap_threshold']!r}" in full_row, full_row
