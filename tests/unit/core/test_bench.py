"""`loongkit bench`: BENCH/SKIP parsing, the table, JSON, and the generated block of docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loongkit_core import bench

FAST = '''import sys
print("warming up")
print("BENCH fast_step baseline=0.0200 ours=0.0100 ratio=2.00")
print("BENCH fast_peak_rss baseline=2097152 ours=1048576 ratio=2.00")
print("BENCH broken baseline=x ours=1 ratio=1")
print("SKIP fast_gpu: no CUDA device")
print("quick" if "--quick" in sys.argv else "full")
'''
FAILING = "import sys\nprint('BENCH half baseline=1 ours=2 ratio=0.5')\nsys.exit(3)\n"


def test_parse_output() -> None:
    cases, skipped = bench.parse_output("fast", FAST.replace('print("', "").replace('")', ""))
    assert [(c.name, c.unit, c.ratio) for c in cases] == [("fast_step", "s", 2.0), ("fast_peak_rss", "bytes", 2.0)]
    assert skipped == ["fast_gpu: no CUDA device"]


def test_scores_are_counts_not_seconds() -> None:
    cases, _ = bench.parse_output("diagnosis", "BENCH diagnosis_recall baseline=13 ours=13 ratio=1.00")
    assert [(c.name, c.unit) for c in cases] == [("diagnosis_recall", "count")]
    assert bench._fmt(13.0, "count") == "13"


def test_update_docs_keeps_other_sections(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nIntro.\n\n## Someone's section\n\nTheir numbers.\n")
    run = bench.ScriptRun("fast", 0, 1.0, [bench.Case("fast", "fast_step", 0.02, 0.01, 2.0, "s")])
    m = {"cpu": "cpu", "cpus_allowed": 2, "numa_nodes": 1, "memory_gib": 8.0, "gpus": [], "python": "3.11",
         "platform": "linux", "versions": {"torch": "2.13.0"}, "load_average": [0.5, 0.5, 0.5]}
    bench.update_docs(doc, bench.render_markdown([run], m, "loongkit bench"))
    first = doc.read_text()
    assert first.index("Intro.") < first.index(bench.BEGIN) < first.index("## Someone's section")
    assert "| fast | `fast_step` | 20.00 ms | 10.00 ms | 2.00x |" in first
    run.cases[0].ratio = 3.0
    bench.update_docs(doc, bench.render_markdown([run], m, "loongkit bench"))
    second = doc.read_text()
    assert second.count(bench.BEGIN) == 1 and "3.00x" in second and "2.00x" not in second
    assert second.endswith("## Someone's section\n\nTheir numbers.\n")


def test_cli_end_to_end(tmp_path: Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "fast.py").write_text(FAST)
    (tmp_path / "benchmarks" / "failing.py").write_text(FAILING)
    (tmp_path / "benchmarks" / "_helper.py").write_text("raise SystemExit(9)\n")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "loongkit_core.cli", "bench", "--dir", str(tmp_path / "benchmarks")]
    listed = subprocess.run([*cmd, "--list"], capture_output=True, text=True, timeout=60)
    assert listed.stdout.split() == ["failing", "fast"]
    r = subprocess.run([*cmd, "fast", "--quick", "--json", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "fast_step" in r.stdout and "2.00x" in r.stdout and "SKIP fast: fast_gpu: no CUDA device" in r.stdout
    data = json.loads(out.read_text())
    assert data["command"] == "loongkit bench fast --quick" and data["machine"]["cpus_allowed"] >= 1
    assert [c["name"] for c in data["runs"][0]["cases"]] == ["fast_step", "fast_peak_rss"]
    r = subprocess.run([*cmd, "failing"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "FAILED failing (exit 3" in r.stdout and "half" in r.stdout
    r = subprocess.run([*cmd, "nosuch"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "available: failing, fast" in r.stderr
