"""``loongkit compare -- <command>``: the same training command without and with loongkit, one table.

The command runs twice with the same environment and seed: once bare (no LOONGKIT_* variables, no
prelude), once under ``loongkit-run`` with ``LOONGKIT_ALL=<level>``. Per-step figures are read from
the command's own output (``loss``, ``time``, ``data_time`` as mmengine, HuggingFace and most
scripts print them: ``loss: 0.51``, ``loss=0.51``, ``loss 0.51``); peak RSS comes from the kernel
(``wait4``). The table says whether the first N losses match (bitwise, or the largest relative
difference), then shows loongkit's Feature Summary. ``--json`` and ``--png`` write the same data.

``--repeat N`` runs the pair N times, alternating (baseline, loongkit, baseline, ...), so that a
machine whose load changes during the job weighs on both sides alike: step and data times pool every
run's warm steps, the table adds each run's median, and the losses of a side's runs must agree with
each other (a nondeterministic job says so: its loss comparison then measures the job, not loongkit).

Each run shows its progress on stderr: the logged steps so far (lines with a ``loss`` or ``time`` figure),
out of the previous run's count (the first run: out of the script's own ``i/N`` when it prints one), and
the time left at the mean step time so far. On a terminal one line is updated in place; elsewhere (nox,
CI logs) a line is printed every 15 s, none for a shorter run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loongkit_core._boot import PRELUDE_DIR, _same_dir

NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
PATTERNS = {
    "loss": re.compile(rf"(?<![\w.])loss['\"]?\s*[:=]?\s*{NUMBER}"),
    "time": re.compile(rf"(?<![\w.])(?:step_)?time['\"]?\s*[:=]\s*{NUMBER}"),
    "data_time": re.compile(rf"(?<![\w.])data_time['\"]?\s*[:=]\s*{NUMBER}"),
}
# A script's own step counter, "12/40": whole numbers only, not part of a date (2024/01/02) or a decimal.
FRACTION = re.compile(r"(?<![\d/.])(\d+)\s*/\s*(\d+)(?![\d/.])")
PROGRESS_EVERY_S = 15.0  # off a terminal: one progress line per this many seconds (a CI log stays readable)
# Overrides it (tests: a fast cadence). Not LOONGKIT_*: the loongkit run inherits those as settings.
PROGRESS_ENV = "_LOONGKIT_COMPARE_PROGRESS_S"


@dataclass
class RunStats:
    label: str
    returncode: int = 0
    wall_s: float = 0.0
    peak_rss_bytes: int = 0
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    data_times: list[float] = field(default_factory=list)
    output: str = ""
    pooled: bool = False  # the times are already warm ones, pooled from several runs (pool())
    run_step_medians: list[float | None] = field(default_factory=list)  # one per run when pooled

    def warm(self, values: list[float]) -> list[float]:
        if self.pooled:
            return values
        return values[len(values) // 5:] or values  # skip warm-up (compilation, first batches)

    def median(self, values: list[float]) -> float | None:
        warm = self.warm(values)
        return statistics.median(warm) if warm else None

    def logged_steps(self) -> int | None:
        """The steps a completed run logged, as StepCounter counts them (None: failed, or no step logged)."""
        steps = max(len(self.losses), len(self.step_times))
        return steps if self.returncode == 0 and steps else None


def pool(runs: list[RunStats]) -> RunStats:
    """One side's repeated runs as one: every run's warm step and data times, the median wall time,
    the largest peak RSS, the first failing exit code; losses and output (the Summary) of the first run."""
    first = runs[0]
    if len(runs) == 1:
        return first
    return RunStats(first.label, returncode=next((r.returncode for r in runs if r.returncode), 0),
                    wall_s=statistics.median(r.wall_s for r in runs),
                    peak_rss_bytes=max(r.peak_rss_bytes for r in runs), losses=first.losses,
                    step_times=[t for r in runs for t in r.warm(r.step_times)],
                    data_times=[t for r in runs for t in r.warm(r.data_times)], output=first.output, pooled=True,
                    run_step_medians=[r.median(r.step_times) for r in runs])


def repeat_agreement(runs: list[RunStats], n: int) -> str | None:
    """Whether a side's repeated runs logged the same first N losses (None for a single run)."""
    if len(runs) < 2:
        return None
    first = runs[0].losses[:n]
    worst = max(compare_losses(first, r.losses, n)["max_rel_diff"] or 0.0 for r in runs[1:])
    if all(r.losses[:n] == first for r in runs[1:]):
        return f"identical losses in its {len(runs)} runs"
    return f"losses differ between its own {len(runs)} runs by up to {worst:.1e} relative: the job is not deterministic"


def parse_metrics(text: str) -> dict[str, list[float]]:
    """Per-line metrics from a training log; one value per line per metric."""
    out: dict[str, list[float]] = {k: [] for k in PATTERNS}
    for line in text.splitlines():
        if "Feature Summary" in line:
            break
        for key, pattern in PATTERNS.items():
            match = pattern.search(line)
            if match:
                try:
                    out[key].append(float(match.group(1)))
                except ValueError:
                    pass
    return out


def _environ(base: dict[str, str], loongkit: bool, level: int, summary_json: str) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith("LOONGKIT_")}
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not _same_dir(p, PRELUDE_DIR)]
    if loongkit:  # loongkit-run puts the prelude on PYTHONPATH itself
        env["LOONGKIT_ALL"] = str(level)
        env["LOONGKIT_SUMMARY_JSON"] = summary_json
        env.update({k: v for k, v in base.items() if k.startswith("LOONGKIT_") and k != "LOONGKIT_ALL"})
    if parts:
        env["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        env.pop("PYTHONPATH", None)
    return env


class StepCounter:
    """A run's logged steps as its output streams, counted as :func:`parse_metrics` will read them: the larger
    of its loss and time counts (at most one each per line), up to the Feature Summary.

    With ``hint``, also the total the script's own ``i/N`` gives, once two consecutive steps agree on it
    (same N, i tracking the count, 1- or 0-based): a date never does, a per-epoch counter ("[2][1/50]")
    stops agreeing when its second epoch starts, and then no total is shown.
    ``state`` is one tuple (steps, first step's and latest step's time.monotonic()) so that the display
    thread reads a consistent triple.
    """

    def __init__(self, hint: bool = False) -> None:
        self.losses = 0
        self.times = 0
        self.state: tuple[int, float, float] = (0, 0.0, 0.0)
        self.script_total: int | None = None
        self._hint = hint
        self._candidates: set[tuple[int, int]] = set()
        self._done = False

    def feed(self, line: str) -> None:
        # Three substring scans reject almost every line; the regexes run only where a pattern
        # could match (each pattern contains "loss" or "time" literally).
        if self._done or ("loss" not in line and "time" not in line and "Feature Summary" not in line):
            return
        before = max(self.losses, self.times)
        for part in line.splitlines():  # parse_metrics' lines: one streamed line may hold several (\f, \x1c, ...)
            if "Feature Summary" in part:
                self._done = True
                break
            if PATTERNS["loss"].search(part):
                self.losses += 1
            if PATTERNS["time"].search(part):
                self.times += 1
        steps = max(self.losses, self.times)
        if steps > before:
            now = time.monotonic()
            self.state = (steps, self.state[1] if before else now, now)
            if self._hint:
                self._read_total(line, steps)

    def _read_total(self, line: str, steps: int) -> None:
        found: set[tuple[int, int]] = set()
        for i, n in FRACTION.findall(line):
            offset, total = int(i) - steps, int(n)
            if offset in (0, -1) and total >= steps:
                found.add((offset, total))
        self.script_total = max((total for _, total in found & self._candidates), default=None)
        self._candidates = found


def progress_text(steps: int, total: int | None, start: float, first: float, last: float, now: float) -> str:
    """``step 12/40, 21 s so far, ~48 s left``. The time left is the mean step time since the first step (the
    start-up before it is no step) times the steps left, less the time the current step has already run."""
    if total is not None and steps > total:
        total = None  # this run logs more than the previous one: no total to go by
    text = f"step {steps}/{total}" if total else f"step {steps}" if steps else "no step logged yet"
    text += f", {now - start:.0f} s so far"
    if total and steps >= 2:
        left = (last - first) / (steps - 1) * (total - steps) - (now - last)
        text += f", ~{max(left, 0.0):.0f} s left"
    return text


def progress_every() -> float:
    """Seconds between progress lines off a terminal (PROGRESS_EVERY_S, or PROGRESS_ENV); 0: none."""
    try:
        every = float(os.environ.get(PROGRESS_ENV, PROGRESS_EVERY_S))
    except ValueError:
        return PROGRESS_EVERY_S
    return every if math.isfinite(every) and every > 0 else 0.0


class _Spinner:
    """A one-line progress indicator on stderr for long phases.

    On a terminal: one line updated in place every 0.5 s, the elapsed seconds, or with ``steps`` the step
    count, total and time left (:func:`progress_text`). Elsewhere (a pipe: nox, CI logs) only with ``steps``
    and ``every``: a line every ``every`` seconds, so none for a phase shorter than that.
    """

    def __init__(self, label: str, steps: StepCounter | None = None, total: int | None = None,
                 every: float = 0.0) -> None:
        self.label = label
        self.steps = steps
        self.total = total
        self.stream = sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.period = 0.5 if self.tty else every
        self._width = 0  # the longest line written in place, to blank it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        start = time.monotonic()
        while not self._stop.wait(self.period):
            now = time.monotonic()
            if self.steps is None:
                line = f"{self.label} ... {now - start:5.0f} s"
            else:
                steps, first, last = self.steps.state
                total = self.total if self.total is not None else self.steps.script_total
                line = f"{self.label} {progress_text(steps, total, start, first, last, now)}"
            if self.tty:
                self.stream.write("\r" + line.ljust(self._width))
                self._width = max(self._width, len(line))
            else:
                self.stream.write(line + "\n")
            self.stream.flush()

    def __enter__(self) -> _Spinner:
        if self.tty or (self.steps is not None and self.period > 0):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
            if self.tty:
                self.stream.write("\r" + " " * self._width + "\r")
                self.stream.flush()


def run_once(command: list[str], env: dict[str, str], label: str, echo: bool, progress: str | None = None,
             total: int | None = None) -> RunStats:
    """Run ``command`` once; ``total``: the previous completed run's logged steps, for the progress line."""
    stats = RunStats(label)
    counter = StepCounter(hint=total is None)
    start = time.perf_counter()
    with _Spinner(f"loongkit compare: {progress or label}", counter, total, progress_every()):
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        chunks = []
        for line in proc.stdout:
            chunks.append(line)
            counter.feed(line)
            if echo:
                sys.stdout.write(f"[{label}] {line}")
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    stats.wall_s = time.perf_counter() - start
    stats.returncode = proc.returncode
    # ru_maxrss of wait4 is the child's own peak (KiB); descendants (workers, ranks) add their own.
    stats.peak_rss_bytes = max(usage.ru_maxrss, 0) * 1024
    stats.output = "".join(chunks)
    metrics = parse_metrics(stats.output)
    stats.losses, stats.step_times, stats.data_times = metrics["loss"], metrics["time"], metrics["data_time"]
    return stats


def compare_losses(a: list[float], b: list[float], n: int) -> dict[str, Any]:
    pairs = list(zip(a[:n], b[:n], strict=False))
    if not pairs:
        return {"compared": 0, "bitwise": False, "max_rel_diff": None}
    rel = [abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in pairs]
    return {"compared": len(pairs), "bitwise": all(x == y for x, y in pairs), "max_rel_diff": max(rel)}


def first_difference(a: list[float], b: list[float], n: int) -> dict[str, Any] | None:
    """Where the first N losses first differ, by how much, and in float32 ulps of the baseline value.

    A feature that changes the computation shows a large first difference; one that only reorders
    float32 arithmetic differs first by an ulp or two, then training amplifies it step by step.
    """
    for i, (x, y) in enumerate(zip(a[:n], b[:n], strict=False)):
        if x != y:
            ulp = 2.0 ** (math.floor(math.log2(abs(x))) - 23) if x else 2.0**-149
            return {"index": i, "rel_diff": abs(x - y) / max(abs(x), abs(y), 1e-12), "ulps": abs(x - y) / ulp}
    return None


def first_loss_difference(a: list[float], b: list[float]) -> float | None:
    """Relative difference of the first losses: same weights, same batch, so only the code differs
    (later losses also carry what training made of the earlier steps' rounding)."""
    if not a or not b:
        return None
    return abs(a[0] - b[0]) / max(abs(a[0]), abs(b[0]), 1e-12)


def render_table(base: RunStats, ours: RunStats, losses: dict[str, Any], tolerance: float,
                 first_tolerance: float | None = None, agreement: tuple[str | None, str | None] = (None, None),
                 ) -> str:
    def fmt(value: float | None, scale: float = 1.0, unit: str = "") -> str:
        return "n/a" if value is None else f"{value * scale:.2f}{unit}"

    def ratio(b: float | None, o: float | None) -> str:
        return "n/a" if not b or not o else f"{b / o:.2f}x"

    rows = [
        ("wall time", fmt(base.wall_s, unit=" s"), fmt(ours.wall_s, unit=" s"), ratio(base.wall_s, ours.wall_s)),
        ("step time (median, warm)", fmt(base.median(base.step_times), 1000, " ms"),
         fmt(ours.median(ours.step_times), 1000, " ms"),
         ratio(base.median(base.step_times), ours.median(ours.step_times))),
        ("data time (median, warm)", fmt(base.median(base.data_times), 1000, " ms"),
         fmt(ours.median(ours.data_times), 1000, " ms"),
         ratio(base.median(base.data_times), ours.median(ours.data_times))),
        ("peak RSS (main process)", fmt(base.peak_rss_bytes, 2**-20, " MiB"), fmt(ours.peak_rss_bytes, 2**-20, " MiB"),
         ratio(base.peak_rss_bytes, ours.peak_rss_bytes)),
        ("exit code", str(base.returncode), str(ours.returncode), ""),
    ]
    if base.pooled or ours.pooled:
        def each(stats: RunStats) -> str:
            return "/".join("n/a" if m is None else f"{m * 1000:.0f}" for m in stats.run_step_medians) + " ms"

        pairs = [b / o for b, o in zip(base.run_step_medians, ours.run_step_medians, strict=False) if b and o]
        spread = f"{min(pairs):.2f}-{max(pairs):.2f}x" if pairs else ""
        rows.insert(2, ("  each run's median", each(base), each(ours), spread))
    width = max(len(r[0]) for r in rows) + 2
    col = max(16, *(len(r[1]) + 2 for r in rows), *(len(r[2]) + 2 for r in rows))  # repeats widen the row
    rule = max(72, width + 2 * col + 12)
    lines = ["=" * rule, f"{'loongkit compare':<{width}}{'baseline':>{col}}{'loongkit':>{col}}{'speed-up':>12}",
             "-" * rule]
    lines += [f"{name:<{width}}{b:>{col}}{o:>{col}}{r:>12}" for name, b, o, r in rows]
    lines.append("-" * rule)
    n = losses["compared"]
    if n:
        verdict = ("bitwise identical" if losses["bitwise"] else
                   f"max relative difference {losses['max_rel_diff']:.2e} "
                   f"({'within' if losses['max_rel_diff'] <= tolerance else 'OUTSIDE'} tolerance {tolerance:g})")
        lines.append(f"first {n} losses: {verdict}")
        first = first_difference(base.losses, ours.losses, n)
        if first:
            lines.append(f"  identical up to loss #{first['index']}; there it differs by {first['rel_diff']:.1e} "
                         f"relative (~{first['ulps']:.0f} float32 ulp)")
        first0 = first_loss_difference(base.losses, ours.losses)
        if first_tolerance is not None and first0 is not None:
            lines.append(f"  loss #0 (same weights, same batch): {first0:.1e} relative "
                         f"({'within' if first0 <= first_tolerance else 'OUTSIDE'} tolerance {first_tolerance:g})")
        lines.append("  baseline: " + " ".join(f"{x:.4f}" for x in base.losses[:min(n, 8)]))
        lines.append("  loongkit: " + " ".join(f"{x:.4f}" for x in ours.losses[:min(n, 8)]))
    else:
        lines.append("no 'loss' values found in the output: nothing to compare")
    for stats, note in zip((base, ours), agreement, strict=True):
        if note:
            lines.append(f"{stats.label}: {note}")
    lines.append("=" * rule)
    return "\n".join(lines) + "\n"


def write_png(path: str, base: RunStats, ours: RunStats) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot (pip install matplotlib)"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for stats, style in ((base, "-"), (ours, "--")):
        ax1.plot(stats.losses, style, label=stats.label)
        ax2.plot([t * 1000 for t in stats.step_times], style, label=stats.label)
    ax1.set(title="loss", xlabel="logged step")
    ax2.set(title="step time (ms)", xlabel="logged step")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def main(args: argparse.Namespace) -> int:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        sys.stderr.write("usage: loongkit compare [options] -- <training command>\n")
        return 2
    tmp = tempfile.mkdtemp(prefix="loongkit-compare-")
    summary_json = os.path.join(tmp, "summary.json")
    base_env = dict(os.environ)
    for item in args.env or []:
        key, _, value = item.partition("=")
        base_env[key] = value
    launcher = shutil.which("loongkit-run") or os.path.join(os.path.dirname(sys.executable), "loongkit-run")
    base_runs: list[RunStats] = []
    our_runs: list[RunStats] = []
    total: int | None = None  # the previous completed run's step count: both sides train the same steps
    for i in range(args.repeat):  # alternating, so load that changes over time weighs on both sides
        suffix = f" {i + 1}/{args.repeat}" if args.repeat > 1 else ""
        base_runs.append(run_once(command, _environ(base_env, False, args.level, summary_json), "baseline",
                                  args.echo, progress=f"baseline{suffix}", total=total))
        total = base_runs[-1].logged_steps() or total
        # The first loongkit run's Summary JSON is the one reported (later runs write elsewhere).
        our_json = summary_json if i == 0 else os.path.join(tmp, f"summary.{i}.json")
        our_runs.append(run_once([launcher, *command], _environ(base_env, True, args.level, our_json), "loongkit",
                                 args.echo, progress=f"loongkit{suffix}", total=total))
        total = our_runs[-1].logged_steps() or total
    base, ours = pool(base_runs), pool(our_runs)
    losses = compare_losses(base.losses, ours.losses, args.losses)
    agreement = (repeat_agreement(base_runs, args.losses), repeat_agreement(our_runs, args.losses))
    table = render_table(base, ours, losses, args.tolerance, args.first_tolerance, agreement)
    sys.stdout.write(table)
    summary = json.loads(Path(summary_json).read_text()) if os.path.exists(summary_json) else None
    start = ours.output.find("=" * 28 + " Loongkit Feature Summary")
    if start >= 0:
        sys.stdout.write(ours.output[start:])
    else:
        sys.stdout.write("(the loongkit run printed no Feature Summary)\n")
    if base.returncode or ours.returncode:
        tail = (ours if ours.returncode else base).output[-3000:]
        sys.stdout.write(f"--- output tail of the failing run ---\n{tail}\n")
    if args.json:
        payload = {"command": command, "level": args.level, "repeat": args.repeat, "losses": losses,
                   "repeat_agreement": {"baseline": agreement[0], "loongkit": agreement[1]},
                   "first_difference": first_difference(base.losses, ours.losses, args.losses),
                   "first_loss": {"rel_diff": first_loss_difference(base.losses, ours.losses),
                                  "tolerance": args.first_tolerance},
                   "baseline": {k: v for k, v in asdict(base).items() if k != "output"},
                   "loongkit": {k: v for k, v in asdict(ours).items() if k != "output"},
                   "summary": summary}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    if args.png:
        note = write_png(args.png, base, ours)
        if note:
            sys.stdout.write(note + "\n")
    ok = base.returncode == 0 and ours.returncode == 0
    matched = losses["compared"] == 0 or losses["bitwise"] or losses["max_rel_diff"] <= args.tolerance
    first0 = first_loss_difference(base.losses, ours.losses)
    if args.first_tolerance is not None and first0 is not None and first0 > args.first_tolerance:
        matched = False
    return 0 if ok and (matched or not args.strict_losses) else 1


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="run a training command without and with loongkit; one comparison table")
    p.add_argument("--level", type=int, default=1, choices=(1, 2, 3), help="LOONGKIT_ALL for the loongkit run")
    p.add_argument("--losses", type=int, default=20, help="how many first losses to compare")
    p.add_argument("--tolerance", type=float, default=1e-3, help="max relative loss difference counted as a match")
    p.add_argument("--first-tolerance", type=float, default=None,
                   help="also check the first loss alone (same weights and batch in both runs) against this")
    p.add_argument("--strict-losses", action="store_true", help="exit 1 when the losses do not match")
    p.add_argument("--env", action="append", help="KEY=VALUE for both runs (repeatable)")
    p.add_argument("--json", help="write the comparison as JSON here")
    p.add_argument("--png", help="write a plot of losses and step times here (needs matplotlib)")
    p.add_argument("--echo", action="store_true", help="stream both runs' output, prefixed")
    p.add_argument("--repeat", type=_positive, default=1,
                   help="run the pair N times, alternating; times pool every run's warm steps (default 1)")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p.set_defaults(func=main)
