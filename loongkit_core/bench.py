"""``loongkit bench [NAMES...]``: run the micro-benchmarks in ``benchmarks/``, one table of ratios.

Each script in ``benchmarks/`` measures the upstream code (baseline) and loongkit's (ours) in the same
run and prints ``BENCH <case> baseline=<v> ours=<v> ratio=<baseline/ours>`` (seconds, or bytes for
memory cases) and ``SKIP <case>: <why>`` when it cannot run here. This command runs all of them or
the named subset, each in its own interpreter (the one running ``loongkit``), collects those lines
into one table, and writes it as JSON, as a PNG bar chart (needs matplotlib), and as a generated
section of ``docs/benchmarks.md`` with the machine it ran on (``--update-docs``; only the part
between the markers is rewritten, the hand-written sections are left alone).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loongkit_core.compare import _Spinner

BEGIN = "<!-- loongkit bench: generated summary, begin (rewritten by `loongkit bench --update-docs`) -->"
END = "<!-- loongkit bench: generated summary, end -->"
BENCH_LINE = re.compile(r"^BENCH\s+(\S+)\s+(.*)$")
SKIP_LINE = re.compile(r"^SKIP\s+(.*)$")
# Memory cases print bytes; their names say so.
MEMORY_CASE = re.compile(r"(rss|pss|memory|bytes)", re.IGNORECASE)
# Scores print counts (diagnosis_recall: causes confirmed / named); their names say so.
COUNT_CASE = re.compile(r"(recall|precision|count)", re.IGNORECASE)


@dataclass
class Case:
    script: str
    name: str
    baseline: float
    ours: float
    ratio: float
    unit: str  # "s", "bytes" or "count"


@dataclass
class ScriptRun:
    name: str
    returncode: int
    wall_s: float
    cases: list[Case] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    error_tail: str = ""


def default_dir() -> Path:
    """benchmarks/ of the checkout loongkit_core lives in (editable install), else of the cwd."""
    here = Path(__file__).resolve().parents[1] / "benchmarks"
    return here if here.is_dir() else Path.cwd() / "benchmarks"


def discover(directory: Path) -> dict[str, Path]:
    """Benchmark scripts by name (file stem); benchmarks/gpu/ is separate (benchmarks/gpu/run_all.py)."""
    return {p.stem: p for p in sorted(directory.glob("*.py")) if not p.name.startswith("_")}


def parse_output(script: str, text: str) -> tuple[list[Case], list[str]]:
    cases, skipped = [], []
    for line in text.splitlines():
        if match := BENCH_LINE.match(line.strip()):
            fields = dict(part.split("=", 1) for part in match.group(2).split() if "=" in part)
            try:
                baseline, ours, ratio = (float(fields[k]) for k in ("baseline", "ours", "ratio"))
            except (KeyError, ValueError):
                continue  # a malformed line is not a result
            name = match.group(1)
            unit = "bytes" if MEMORY_CASE.search(name) else "count" if COUNT_CASE.search(name) else "s"
            cases.append(Case(script, match.group(1), baseline, ours, ratio, unit))
        elif match := SKIP_LINE.match(line.strip()):
            skipped.append(match.group(1))
    return cases, skipped


def run_script(name: str, path: Path, args: list[str], python: str, timeout: float, echo: bool) -> ScriptRun:
    start = time.perf_counter()
    with _Spinner(f"bench {name}"):
        try:
            proc = subprocess.run([python, str(path), *args], capture_output=True, text=True, timeout=timeout,
                                  cwd=path.parent.parent)
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            code = 124
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err = f"timed out after {timeout:g} s"
    if echo:
        sys.stdout.write(out)
    cases, skipped = parse_output(name, out)
    run = ScriptRun(name, code, time.perf_counter() - start, cases, skipped)
    if code:
        run.error_tail = (err or out)[-1500:]
    return run


def _fmt(value: float, unit: str) -> str:
    if unit == "bytes":
        return f"{value / 2**20:,.1f} MiB"
    if unit == "count":
        return f"{value:g}"
    if abs(value) < 1e-3:
        return f"{value * 1e6:.1f} us"
    if abs(value) < 1:
        return f"{value * 1e3:.2f} ms"
    return f"{value:.2f} s"


def machine() -> dict[str, Any]:
    """The machine, in the words docs/benchmarks.md uses; read from /proc and package metadata only."""
    from loongkit_core import requirements
    from loongkit_core.hardware import detect

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    hw = detect()
    versions = {m: found.version for m in ("torch", "mmcv", "mmengine", "mmdet", "transformers", "triton")
                if (found := requirements.installed(m))}
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "cpus_allowed": len(hw.allowed_cpus) or os.cpu_count(),
        "numa_nodes": len(hw.nodes) or 1,
        "memory_gib": mem_gib,
        "gpus": [f"{g.vendor} {g.pci}" for g in hw.accelerators],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def describe(m: dict[str, Any]) -> str:
    gpus = ", ".join(m["gpus"]) or "no GPU"
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    load = f"; load average at start {m['load_average'][0]:.1f}" if m.get("load_average") else ""
    return (f"{m['cpu']}, {m['cpus_allowed']} CPUs usable, {m['numa_nodes']} NUMA node(s), "
            f"{m['memory_gib']} GiB, {gpus}; Python {m['python']}, {versions}{load}")


def render_table(runs: list[ScriptRun]) -> str:
    rows = [(c.script, c.name, _fmt(c.baseline, c.unit), _fmt(c.ours, c.unit), f"{c.ratio:.2f}x")
            for r in runs for c in r.cases]
    head = ("script", "case", "upstream", "loongkit", "ratio")
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(5)]
    line = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    out = [line.format(*head), "  ".join("-" * w for w in widths)]
    out += [line.format(*row) for row in rows]
    for r in runs:
        out += [f"SKIP {r.name}: {why}" for why in r.skipped]
        if r.returncode:
            out.append(f"FAILED {r.name} (exit {r.returncode}, {r.wall_s:.0f} s): "
                       + (r.error_tail.strip().splitlines() or [""])[-1])
    return "\n".join(out) + "\n"


def render_markdown(runs: list[ScriptRun], m: dict[str, Any], command: str) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        BEGIN,
        "## Summary (generated)",
        "",
        f"`{command}`, {when}, on: {describe(m)}. Ratio = upstream / loongkit, both measured in this run "
        "(> 1: loongkit faster or smaller). One run; the sections below give each benchmark's full "
        "protocol and its noise.",
        "",
        "| script | case | upstream | loongkit | ratio |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {c.script} | `{c.name}` | {_fmt(c.baseline, c.unit)} | {_fmt(c.ours, c.unit)} | {c.ratio:.2f}x |"
              for r in runs for c in r.cases]
    notes = [f"- skipped, {r.name}: {why}" for r in runs for why in r.skipped]
    notes += [f"- failed, {r.name}: exit {r.returncode}" for r in runs if r.returncode]
    if notes:
        lines += ["", *notes]
    lines.append(END)
    return "\n".join(lines) + "\n"


def update_docs(path: Path, block: str) -> None:
    """Replace the generated block, or insert it before the first section of a document without one."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if BEGIN in text and END in text:
        before, rest = text.split(BEGIN, 1)
        after = rest.split(END, 1)[1].lstrip("\n")
        text = before + block + "\n" + after
    else:
        at = text.find("\n## ")
        text = text + "\n" + block if at < 0 else text[:at + 1] + block + "\n" + text[at + 1:]
    path.write_text(text)


def write_png(path: str, runs: list[ScriptRun]) -> str | None:
    cases = [c for r in runs for c in r.cases]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no chart written (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(cases) + 1.5))
    ratios = [max(c.ratio, 1e-3) for c in cases]  # log axis: clamp non-positive ratios
    ax.barh([f"{c.script}: {c.name}" for c in cases], ratios,
            color=["tab:green" if r >= 1 else "tab:red" for r in ratios])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("upstream / loongkit (log scale; > 1 is better)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def main(args: argparse.Namespace) -> int:
    directory = Path(args.dir) if args.dir else default_dir()
    scripts = discover(directory)
    if args.list:
        print("\n".join(scripts))
        return 0
    unknown = [n for n in args.names if n not in scripts]
    if unknown:
        sys.stderr.write(f"unknown benchmark(s): {', '.join(unknown)}; available: {', '.join(scripts)}\n")
        return 2
    chosen = args.names or list(scripts)
    extra = ["--quick"] if args.quick else []
    m = machine()
    runs = []
    for name in chosen:
        run = run_script(name, scripts[name], extra, args.python or sys.executable, args.timeout, args.echo)
        sys.stderr.write(f"bench {name}: {len(run.cases)} case(s), {run.wall_s:.0f} s"
                         + (f", exit {run.returncode}" if run.returncode else "") + "\n")
        runs.append(run)
    sys.stdout.write(render_table(runs))
    command = "loongkit bench" + "".join(f" {n}" for n in args.names) + (" --quick" if args.quick else "")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "machine": m,
                                               "runs": [asdict(r) for r in runs]}, indent=2))
    if args.png:
        note = write_png(args.png, runs)
        if note:
            sys.stdout.write(note + "\n")
    if args.update_docs:
        update_docs(Path(args.update_docs), render_markdown(runs, m, command))
        sys.stdout.write(f"updated the generated summary in {args.update_docs}\n")
    return 1 if any(r.returncode for r in runs) else 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="run the benchmarks (all or NAMES), one table of ratios vs upstream")
    p.add_argument("names", nargs="*", help="benchmark names (file stems in benchmarks/); default: all")
    p.add_argument("--quick", action="store_true", help="pass --quick to every script (each < 1 min)")
    p.add_argument("--json", help="write the results and the machine description as JSON here")
    p.add_argument("--png", help="write a bar chart of the ratios here (needs matplotlib)")
    p.add_argument("--update-docs", metavar="MD", help="rewrite the generated summary block in this file "
                   "(e.g. docs/benchmarks.md); other sections are kept")
    p.add_argument("--dir", help="the benchmarks directory (default: the checkout's benchmarks/)")
    p.add_argument("--python", help="interpreter for the scripts (default: this one)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per script")
    p.add_argument("--echo", action="store_true", help="also print each script's own output")
    p.add_argument("--list", action="store_true", help="list the benchmark names and exit")
    p.set_defaults(func=main)
