"""``loongkit tune`` on the suite's jobs, its choice checked against what the suite measures itself.

For each job: ``loongkit tune`` runs with a fixed budget and prints its verdict (a confirmed winner with
its claimed gain and spread, or "keep the job as it is"). Then the suite measures, on its own, the whole
job (every step, the job's own clock) under a fixed list of settings that covers tune's space on this
machine and beyond it (the levels, every worker count up to the CPUs and 2x and 4x the CPUs, the thread
fix) plus tune's choice, in rounds
whose order rotates, and takes each setting's median over the rounds. Scores:

* choice: tune's choice (its winner, or the job as it is) is within the noise of the best setting the
  suite measured (noise: the baseline's own spread over the rounds, at least NOISE_FLOOR);
* claim: a winner's measured gain lies in the spread tune stated (its pairs' range, widened by the
  noise tune printed), the measured gain taken within the suite's own noise (it is a measurement too);
* keep: on every healthy control tune keeps the job as it is.

A helper of ``diagnosis.py --tune`` (``loongkit bench`` skips ``_``-prefixed files).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NOISE_FLOOR = 0.05  # the suite's runs are whole jobs of a few seconds on 2 shared CPUs
ROUNDS = 3
WORKERS = ("LOONGKIT_DATALOADER_WORKERS", "LOONGKIT_DATALOADER_WORKERS_COUNT")


def reference_settings(cpus: int) -> dict[str, dict[str, str]]:
    """What the suite measures besides tune's choice: tune's space on a CPU machine, written out."""
    settings: dict[str, dict[str, str]] = {"baseline": {}}
    for level in (1, 2, 3):
        settings[f"ALL={level}"] = {"LOONGKIT_ALL": str(level)}
    # Every count up to the CPUs, then beyond them: workers that wait on I/O overlap even on few CPUs, so
    # the best count of such a job lies outside a search that stays within the CPUs.
    for n in (*range(0, cpus + 1), 2 * cpus, 4 * cpus):
        settings[f"workers={n}"] = {WORKERS[0]: "1", WORKERS[1]: str(n)}
    settings["ALL=1 +CONFIG_GUARDS_APPLY_FIX"] = {"LOONGKIT_ALL": "1", "LOONGKIT_CONFIG_GUARDS": "1",
                                                  "LOONGKIT_CONFIG_GUARDS_APPLY_FIX": "1"}
    return settings


@dataclass
class TuneVerdict:
    case: str
    control: bool
    winner: str  # "keep" or the winner's key
    env: dict[str, str]
    claimed: float | None
    low: float | None
    high: float | None
    tune_noise: float
    verdict: str
    elapsed_s: float
    measured: dict[str, float] = field(default_factory=dict)  # setting -> median job step (s)
    noise: float = NOISE_FLOOR
    error: str = ""
    account: dict[str, Any] = field(default_factory=dict)  # tune's own: its search, confirmation, standings

    @property
    def best(self) -> tuple[str, float]:
        return min(self.measured.items(), key=lambda kv: kv[1])

    @property
    def chosen_step(self) -> float | None:
        return self.measured.get("tune's choice")

    @property
    def within_noise(self) -> bool:
        chosen = self.chosen_step
        return chosen is not None and chosen <= self.best[1] * (1 + self.noise)

    @property
    def measured_gain(self) -> float | None:
        chosen, base = self.chosen_step, self.measured.get("baseline")
        return base / chosen if chosen and base else None

    @property
    def claim_holds(self) -> bool | None:
        """None without a winner (nothing claimed). Both figures are measurements: tune's spread (its pairs'
        range, widened by its noise) and the suite's gain (within the suite's own noise) must overlap."""
        if self.claimed is None or self.low is None or self.high is None or self.measured_gain is None:
            return None
        low, high = self.low * (1 - self.tune_noise), self.high * (1 + self.tune_noise)
        return low <= self.measured_gain * (1 + self.noise) and self.measured_gain * (1 - self.noise) <= high


def run_tune(job: Path, cfg: dict[str, Any], work: Path, budget_s: float, steps: int) -> dict[str, Any]:
    out = work / f"tune-{os.getpid()}-{len(list(work.glob('tune-*')))}"
    argv = [sys.executable, "-m", "loongkit_core.cli", "tune", "--steps", str(steps), "--budget",
            f"{budget_s / 60:.3f}", "--out", str(out), "--", sys.executable, str(job), json.dumps(cfg)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOONGKIT_")}
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=budget_s + 300, cwd=work)
    path = out / "tune.json"
    if proc.returncode != 0 or not path.exists():
        return {"error": f"tune rc {proc.returncode}: {(proc.stdout + proc.stderr)[-800:]}"}
    return json.loads(path.read_text())


def run_job(job: Path, cfg: dict[str, Any], env_extra: dict[str, str], work: Path) -> float | None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOONGKIT_")}
    env.pop("OMP_NUM_THREADS", None)
    env.update(env_extra)
    argv = [sys.executable, "-m", "loongkit_core.launcher", sys.executable, str(job), json.dumps(cfg)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=work)
    result = next((json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    return float(result["step_s"]) if proc.returncode == 0 and result else None


def judge(name: str, cfg: dict[str, Any], control: bool, job: Path, work: Path, budget_s: float, steps: int,
          cpus: int) -> TuneVerdict:
    cfg = {**cfg, "print_loss": True}
    doc = run_tune(job, cfg, work, budget_s, steps)
    if "error" in doc:
        return TuneVerdict(name, control, "?", {}, None, None, None, 0.0, "", 0.0, error=doc["error"])
    winner = doc.get("winner") or {}
    conf = doc.get("confirmation") or {}
    verdict = TuneVerdict(name, control, winner.get("key", "keep"), dict(winner.get("env") or {}),
                          conf.get("gain") if winner else None, conf.get("low") if winner else None,
                          conf.get("high") if winner else None, float(doc.get("noise") or 0.0),
                          str(doc.get("verdict", "")), float(doc.get("elapsed_s") or 0.0))
    verdict.account = {"search_verdict": doc.get("search_verdict"), "confirmation": conf,
                       "ranked": [{k: s.get(k) for k in ("key", "status", "reason", "median_step_s", "speedup")}
                                  | {"trials": len(s.get("trials") or [])} for s in doc.get("ranked") or []],
                       "skipped": doc.get("skipped")}
    settings = {**reference_settings(cpus), "tune's choice": verdict.env}
    runs: dict[str, list[float]] = {k: [] for k in settings}
    names = list(settings)
    for r in range(ROUNDS):
        for key in names[r % len(names):] + names[:r % len(names)]:
            step = run_job(job, cfg, settings[key], work)
            if step is not None:
                runs[key].append(step)
    verdict.measured = {k: statistics.median(v) for k, v in runs.items() if v}
    base = runs.get("baseline") or []
    if len(base) >= 2:
        verdict.noise = max(NOISE_FLOOR, (max(base) - min(base)) / statistics.median(base))
    if "tune's choice" not in verdict.measured or "baseline" not in verdict.measured:
        verdict.error = "the suite could not measure tune's choice or the baseline"
    return verdict


def line(v: TuneVerdict) -> str:
    if v.error:
        return f"tune {v.case:24s} ERROR {v.error}"
    best, best_s = v.best
    chosen = v.chosen_step or 0.0
    head = f"tune {v.case:24s} {'control ' if v.control else ''}choice: {v.winner}"
    if v.claimed is not None:
        head += f" (claimed {v.claimed:.2f}x, pairs {v.low:.2f}-{v.high:.2f}x, noise {v.tune_noise:.1%})"
    gain = v.measured_gain
    head += f" | measured {gain:.2f}x" if gain else ""
    head += (f" | suite's best {best} {best_s * 1e3:.1f} ms, choice {chosen * 1e3:.1f} ms: "
             + ("within" if v.within_noise else "NOT within") + f" the noise ({v.noise:.0%})")
    if v.claim_holds is not None:
        head += " | claim " + ("holds" if v.claim_holds else "OUTSIDE its spread")
    if v.control:
        head += " | " + ("kept" if v.winner == "keep" else "DID NOT KEEP")
    return head + f" | tune {v.elapsed_s:.0f} s"


def totals(verdicts: list[TuneVerdict]) -> dict[str, Any]:
    ok = [v for v in verdicts if not v.error]
    claims = [v for v in ok if v.claim_holds is not None]
    controls = [v for v in ok if v.control]
    return {"jobs": len(ok), "within_noise": sum(v.within_noise for v in ok), "claims": len(claims),
            "claims_hold": sum(bool(v.claim_holds) for v in claims), "controls": len(controls),
            "kept": sum(v.winner == "keep" for v in controls), "errors": [v.case for v in verdicts if v.error]}
