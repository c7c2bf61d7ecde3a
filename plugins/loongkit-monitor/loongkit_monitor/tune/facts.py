"""What applies on this machine, asked of loongkit itself (never a hard-coded list of features).

* ``loongkit features --json`` under ``LOONGKIT_ALL=<max level>``: every installed feature, its
  level, category and options, whether it applies here (requirements, hardware, platform) and
  whether ``LOONGKIT_ALL`` enables it (a hardware policy may say off by default);
* ``loongkit doctor --json``: GPUs, NUMA nodes, L3 caches, allowed CPUs;
* ``loongkit numa plan --json`` (only when NUMA affinity applies): symmetric or asymmetric topology
  and the options' defaults from the CPU-vendor policy;
* ``loongkit malloc-env <allocator>`` (only when LOONGKIT_MALLOC applies): which allocator libraries
  are installed.

Each is a subprocess of this interpreter (``python -m loongkit_core.cli``), with the same
environment the trials get, so the answers are the ones the trials will see.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loongkit_monitor.plugin import MALLOC, NUMA_AFFINITY

# (argv, environ) -> (returncode, stdout); replaced in tests.
Runner = Callable[[Sequence[str], Mapping[str, str]], tuple[int, str]]

ALLOCATORS = ("jemalloc", "tcmalloc")


@dataclass(frozen=True)
class FeatureFact:
    name: str
    env: str
    level: int
    category: str
    options: tuple[str, ...] = ()
    applies: bool = False
    reason: str = ""  # why it does not apply (empty when it does)
    enabled_by_all: bool = False  # LOONGKIT_ALL=<max level> enables it (no hardware policy says off)


@dataclass
class Facts:
    features: dict[str, FeatureFact] = field(default_factory=dict)
    gpus: int = 0
    numa_nodes: int = 1
    l3_caches: int = 1
    cpus: int = 1
    numa_topology: str = ""  # the plan's description ("symmetric (...)", "asymmetric (...)"), "" if not asked
    numa_options: dict[str, bool] = field(default_factory=dict)  # option -> its default here
    allocators: dict[str, bool] = field(default_factory=dict)  # jemalloc/tcmalloc -> installed
    notes: list[str] = field(default_factory=list)  # what could not be asked, and why

    def applies(self, name: str) -> bool:
        fact = self.features.get(name)
        return fact is not None and fact.applies

    @property
    def asymmetric(self) -> bool:
        return self.numa_topology.startswith("asymmetric")

    @property
    def l3_per_node(self) -> float:
        return self.l3_caches / max(1, self.numa_nodes)


def default_runner(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[int, str]:
    try:
        proc = subprocess.run(list(argv), env=dict(environ), capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 1, f"{type(exc).__name__}: {exc}"
    return proc.returncode, proc.stdout if proc.returncode == 0 else (proc.stderr or proc.stdout)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "loongkit_core.cli", *args]


def _json(runner: Runner, argv: Sequence[str], environ: Mapping[str, str], notes: list[str]) -> Any:
    code, out = runner(argv, environ)
    what = " ".join(argv[3:]) if argv[:3] == _cli() else " ".join(argv)
    if code != 0:
        notes.append(f"`loongkit {what}` failed: {out.strip().splitlines()[-1] if out.strip() else code}")
        return None
    try:
        return json.loads(out)
    except ValueError as exc:
        notes.append(f"`loongkit {what}` printed no JSON: {exc}")
        return None


def _count_cpus(cpulist: str) -> int:
    total = 0
    for part in cpulist.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            total += int(hi or lo) - int(lo) + 1
        except ValueError:
            continue
    return total


def parse_features(doc: Mapping[str, Any]) -> dict[str, FeatureFact]:
    out: dict[str, FeatureFact] = {}
    for row in doc.get("features") or []:
        verdict = str(row.get("applies_here", ""))
        out[row["name"]] = FeatureFact(
            name=row["name"], env=row["env"], level=int(row["level"]), category=str(row.get("category", "")),
            options=tuple(row.get("options") or ()), applies=verdict == "yes",
            reason="" if verdict == "yes" else verdict, enabled_by_all=bool(row.get("enabled_now")))
    return out


def gather(environ: Mapping[str, str], max_level: int, runner: Runner = default_runner) -> Facts:
    """Ask loongkit what applies here. ``environ`` is the trials' base (no feature switches)."""
    facts = Facts()
    probe_env = {**environ, "LOONGKIT_ALL": str(max_level)}
    doc = _json(runner, _cli("features", "--json"), probe_env, facts.notes)
    if doc:
        facts.features = parse_features(doc)
        facts.notes.extend(f"plugin fault: {f.get('plugin')}: {f.get('error')}" for f in doc.get("faults") or [])
    doctor = _json(runner, _cli("doctor", "--json"), environ, facts.notes)
    if doctor:
        facts.gpus = len(doctor.get("gpus") or [])
        facts.numa_nodes = max(1, len(doctor.get("numa_nodes") or {}))
        facts.l3_caches = max(1, int(doctor.get("l3_caches") or 1))
        facts.cpus = max(1, _count_cpus(str(doctor.get("allowed_cpus") or "")))
    if facts.applies(NUMA_AFFINITY.name):
        plan = _json(runner, _cli("numa", "plan", "--json"), environ, facts.notes)
        if plan:
            facts.numa_topology = str(plan.get("topology") or "")
            facts.numa_options = {k: bool(v) for k, v in (plan.get("options") or {}).items()}
    if facts.applies(MALLOC.name):
        for name in ALLOCATORS:
            code, _ = runner(_cli("malloc-env", name), environ)
            facts.allocators[name] = code == 0
    return facts
