"""The candidate settings tune tries, built from what applies here and ordered by the baseline's figures.

Groups:

* ``levels``: ``LOONGKIT_ALL=1..max_level``, each only when it enables more applicable features than
  the level below (else it is the same trial twice);
* ``options`` (max level >= 2): each applicable level-2 feature on top of ``LOONGKIT_ALL=1``, and the
  option variants that mean something on this hardware: the allocator libraries that are
  installed, NUMA L3 partitioning where a node has several L3 caches, the asymmetric options where
  the topology is asymmetric, CONFIG_GUARDS' fix where the job oversubscribes its CPUs;
* ``workers``: the DataLoader worker count (LOONGKIT_DATALOADER_WORKERS_COUNT) around the job's own,
  from the baseline's worker count and allowed CPUs;
* ``gpu``: TF32 and the compile features, alone, only where there is a GPU.

Every candidate is also the baseline's monitor (LOONGKIT_MONITOR=1, added by the trial runner). What
is left out is returned with its reason, so the report can say why it was not tried.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from loongkit_monitor.advice import workers_memory_holds
from loongkit_monitor.plugin import CONFIG_GUARDS, DATALOADER_WORKERS, MALLOC, NUMA_AFFINITY
from loongkit_monitor.tune.facts import Facts, FeatureFact
from loongkit_monitor.tune.figures import Figures

BASELINE, LEVELS, OPTIONS, WORKERS, GPU, COMBINED = "baseline", "levels", "options", "workers", "gpu", "combined"
DATA, COMPUTE = "data", "compute"

WORKERS_ENV = "LOONGKIT_DATALOADER_WORKERS"
WORKERS_COUNT_ENV = "LOONGKIT_DATALOADER_WORKERS_COUNT"
# Tune's own features: on in every trial (the monitor) or a dimension of its own (the worker count).
OWN_FEATURES = frozenset({"monitor", DATALOADER_WORKERS.name})
NUMA_PREFIX = "LOONGKIT_NUMA_AFFINITY_"
DATA_CATEGORY = "Data preprocessing"


@dataclass(frozen=True)
class Part:
    """One setting a candidate is made of (``ALL=1``, ``+MALLOC``, ``workers=3``): what leaving it out
    of the candidate removes, when tune checks that every part of a winner earns its place."""

    label: str
    env: tuple[tuple[str, str], ...]
    group: str
    level: int
    topic: str = COMPUTE
    enables: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Candidate:
    key: str  # the table's label: "ALL=2", "ALL=1 +MALLOC(jemalloc)", "workers=4"
    env: tuple[tuple[str, str], ...]  # set on top of the trial's base environment
    group: str
    level: int  # highest loongkit level it enables (0: none beyond the monitor)
    topic: str = COMPUTE
    why: str = ""
    enables: frozenset[str] = field(default=frozenset(), compare=False)  # feature variables it turns on
    parts: tuple[Part, ...] = field(default=(), compare=False)  # () : the candidate is one part

    @property
    def pieces(self) -> tuple[Part, ...]:
        """The parts, the candidate itself when it was built as one."""
        if self.parts or self.group == BASELINE:
            return self.parts
        return (Part(self.key, self.env, self.group, self.level, self.topic, self.enables),)

    @property
    def environ(self) -> dict[str, str]:
        return dict(self.env)

    @property
    def settings(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.env) or "(monitor only)"


@dataclass(frozen=True)
class Skipped:
    label: str
    reason: str


def baseline() -> Candidate:
    return Candidate("baseline", (), BASELINE, 0, why="the job as it is (only the monitor on)")


def _candidate(key: str, env: Mapping[str, str], group: str, level: int, topic: str, why: str,
               enables: Iterable[str] = ()) -> Candidate:
    return Candidate(key, tuple(env.items()), group, level, topic, why, frozenset(enables))


def _usable(facts: Facts) -> list[FeatureFact]:
    return [f for f in facts.features.values() if f.applies and f.name not in OWN_FEATURES]


def _level_set(facts: Facts, level: int) -> frozenset[str]:
    """The applicable features LOONGKIT_ALL=level turns on here."""
    return frozenset(f.env for f in _usable(facts) if f.enabled_by_all and f.level <= level)


def level_candidates(facts: Facts, max_level: int) -> tuple[list[Candidate], list[Skipped]]:
    out: list[Candidate] = []
    skipped: list[Skipped] = []
    previous: frozenset[str] = frozenset()
    for level in range(1, max_level + 1):
        enabled = _level_set(facts, level)
        label = f"ALL={level}"
        if not enabled:
            skipped.append(Skipped(label, f"no feature of level <= {level} applies here"))
        elif enabled == previous:
            skipped.append(Skipped(label, f"enables no applicable feature beyond ALL={level - 1} here"))
        else:
            added = sorted(enabled - previous)
            out.append(_candidate(label, {"LOONGKIT_ALL": str(level)}, LEVELS, level, COMPUTE,
                                  f"adds {', '.join(added)}", enabled))
        previous = enabled
    return out, skipped


def _short(env: str) -> str:
    return env.removeprefix("LOONGKIT_")


def option_candidates(facts: Facts, figures: Figures | None, max_level: int) -> tuple[list[Candidate], list[Skipped]]:
    """Level-2 features one at a time on top of ALL=1, and the option variants that apply here."""
    out: list[Candidate] = []
    skipped: list[Skipped] = []
    if max_level < 2:
        return out, [Skipped("level-2 options", f"--max-level {max_level}")]
    base = _level_set(facts, 1)
    all2 = _level_set(facts, 2)

    level1 = Part("ALL=1", (("LOONGKIT_ALL", "1"),), LEVELS, 1, COMPUTE, base)

    def add(key: str, extra: Mapping[str, str], topic: str, why: str, enables: Iterable[str] = ()) -> None:
        env = {"LOONGKIT_ALL": "1", **extra}
        option = Part(key.removeprefix("ALL=1 "), tuple(extra.items()), OPTIONS, 2, topic, frozenset(enables))
        out.append(Candidate(key, tuple(env.items()), OPTIONS, 2, topic, why, base | frozenset(enables),
                             (level1, option)))

    for f in sorted((f for f in _usable(facts) if f.level == 2), key=lambda f: f.name):
        topic = DATA if f.category == DATA_CATEGORY else COMPUTE
        if base | {f.env} == all2 and all2 != base:
            skipped.append(Skipped(f"ALL=1 +{_short(f.env)}", "the only level-2 feature here: same as ALL=2"))
        else:
            add(f"ALL=1 +{_short(f.env)}", {f.env: "1"}, topic, f.category, [f.env])
        if f.name == MALLOC.name:
            for allocator, installed in sorted(facts.allocators.items()):
                label = f"ALL=1 +MALLOC({allocator})"
                if installed:
                    add(label, {f.env: "1", "LOONGKIT_MALLOC_ALLOCATOR": allocator}, DATA,
                        f"{allocator} is installed", [f.env])
                else:
                    skipped.append(Skipped(label, f"{allocator} is not installed"))
    for name, fact in sorted(facts.features.items()):
        if fact.level == 2 and not fact.applies and name not in OWN_FEATURES:
            skipped.append(Skipped(f"ALL=1 +{_short(fact.env)}", fact.reason))
    _numa_variants(facts, add, skipped)
    _guards_fix(facts, figures, add, skipped)
    return out, skipped


def _numa_variants(facts: Facts, add: object, skipped: list[Skipped]) -> None:
    if not facts.applies(NUMA_AFFINITY.name):
        reason = facts.features[NUMA_AFFINITY.name].reason if NUMA_AFFINITY.name in facts.features else "not installed"
        skipped.append(Skipped("NUMA affinity variants", reason))
        return
    assert callable(add)
    env = facts.features[NUMA_AFFINITY.name].env
    if facts.l3_per_node > 1:
        for option in ("partition_per_llc", "separate_by_roles"):
            flipped = not facts.numa_options.get(option, False)
            name = NUMA_PREFIX + option.upper()
            add(f"ALL=1 +{_short(name)}={int(flipped)}", {env: "1", name: str(int(flipped))}, COMPUTE,
                f"{facts.l3_caches} L3 caches on {facts.numa_nodes} NUMA node(s); default here {int(not flipped)}",
                [env])
    else:
        skipped.append(Skipped("PARTITION_PER_LLC / SEPARATE_BY_ROLES", "one L3 cache per NUMA node here"))
    if facts.asymmetric:
        asym = {env: "1", NUMA_PREFIX + "ALLOW_ASYMMETRIC": "1"}
        variants: list[tuple[str, dict[str, str]]] = [
            ("ALLOW_ASYMMETRIC", {}),
            ("+TRAIN_ON_GPULESS", {NUMA_PREFIX + "TRAIN_ON_GPULESS": "1"}),
            ("+DATA_WORKER_ON_GPULESS", {NUMA_PREFIX + "DATA_WORKER_ON_GPULESS": "1"}),
            ("+DATA_WORKER_GPULESS_ONLY", {NUMA_PREFIX + "DATA_WORKER_ON_GPULESS": "1",
                                           NUMA_PREFIX + "DATA_WORKER_GPULESS_ONLY": "1"}),
        ]
        for label, extra in variants:
            add(f"ALL=1 +NUMA {label}", {**asym, **extra}, COMPUTE, facts.numa_topology, [env])
    else:
        skipped.append(Skipped("asymmetric NUMA options", f"topology: {facts.numa_topology or 'symmetric'}"))


def _guards_fix(facts: Facts, figures: Figures | None, add: object, skipped: list[Skipped]) -> None:
    label = "ALL=1 +CONFIG_GUARDS_APPLY_FIX"
    if not facts.applies(CONFIG_GUARDS.name):
        skipped.append(Skipped(label, facts.features[CONFIG_GUARDS.name].reason
                               if CONFIG_GUARDS.name in facts.features else "not installed"))
        return
    cpus = (figures.cpus_allowed if figures and figures.cpus_allowed else None) or facts.cpus
    threads = figures.torch_threads if figures is not None else None
    if figures is None or (figures.workers + 1 <= cpus and (threads or 0) <= cpus):
        workers = "unknown" if figures is None else str(figures.workers)
        skipped.append(Skipped(label, f"the job does not oversubscribe its CPUs ({workers} workers + main, "
                                      f"{threads or '?'} torch threads, {cpus:g} CPUs): nothing to fix"))
        return
    assert callable(add)
    env = facts.features[CONFIG_GUARDS.name].env
    why = (f"{figures.workers} workers + main > {cpus:g} CPUs" if figures.workers + 1 > cpus
           else f"{threads} torch threads > {cpus:g} CPUs")
    add(label, {env: "1", "LOONGKIT_CONFIG_GUARDS_APPLY_FIX": "1"}, DATA if figures.workers + 1 > cpus else COMPUTE,
        why, [env])


def worker_counts(current: int, per_rank_cpus: int, *, data_bound: bool, saturated: bool,
                  most: int | None = None) -> list[int]:
    """Worker counts to try instead of ``current``, the most promising first.

    Around the job's own count (half, double) and at the CPU budget (all CPUs, all but the main
    process's); 0 and 1 on small machines. More than the CPUs (up to twice them) only when the job
    waits for data while its workers leave CPUs idle: waiting workers overlap, and more workers than
    CPUs keep the CPUs loading through each batch's handoff. ``most``: the count the memory allows.
    """
    cpus = max(1, per_rank_cpus)
    values = {current // 2, current * 2, cpus - 1, cpus}
    if cpus <= 4:
        values |= {0, 1}
    io_bound = data_bound and not saturated
    if io_bound:
        values |= {max(2, current * 2), 2 * cpus}  # waiting workers overlap even on one CPU
    limit = max(2 * cpus, current * 2, 2) if io_bound else cpus
    if most is not None:
        limit = min(limit, max(most, current))
    chosen = sorted(v for v in values if 0 <= v <= limit and v != current)
    if data_bound and not saturated:
        chosen.sort(key=lambda v: (v < current, -v))  # more workers first, then the nearest fewer
    elif saturated:
        chosen.sort(key=lambda v: (v > current, -v if v < current else v))  # fewer first, nearest first
    else:
        chosen.sort(key=lambda v: (abs(v - current), v))
    return chosen[:4]


def _memory_cap(figures: Figures) -> int | None:
    """The monitor's memory rule on the baseline's figures (a worker's RSS, or the main's before there
    are workers: a forked worker starts as its copy); None when the monitor did not see the memory."""
    def number(key: str) -> float | None:
        value = figures.raw.get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    main = number("main_rss_bytes")
    return workers_memory_holds(figures.workers, number("worker_rss_bytes") or main, main,
                                number("memory_limit_bytes"))


def worker_candidates(figures: Figures | None, facts: Facts) -> tuple[list[Candidate], list[Skipped]]:
    if figures is None:
        return [], [Skipped("DataLoader workers", "no baseline figures")]
    if figures.steps and figures.workers == 0 and figures.data_wait_share is None:
        return [], [Skipped("DataLoader workers", "the monitor saw no DataLoader")]
    cpus = figures.cpus_allowed or facts.cpus
    # A rank that may use the whole machine shares it with the other ranks; a bound rank has its own.
    per_rank = max(1, int(cpus // max(1, figures.ranks) if cpus >= facts.cpus else cpus))
    counts = worker_counts(figures.workers, per_rank, data_bound=figures.data_bound,
                           saturated=figures.workers_saturated, most=_memory_cap(figures))
    # The count the baseline's monitor advises comes first: it is derived from this job's per-sample cost,
    # its step and its CPUs (and may exceed the CPUs where the workers wait on I/O), which a fixed list
    # around the job's own count does not reach.
    advised = [r.count for r in figures.recommendations
               if r.kind == "workers" and r.count is not None and r.count != figures.workers]
    wait = "unknown" if figures.data_wait_share is None else f"{figures.data_wait_share:.0%}"
    why = f"job uses {figures.workers}, {cpus:g} CPUs allowed, data wait {wait}"
    tried = list(dict.fromkeys([*advised[:1], *counts]))
    out = [_candidate(f"workers={n}", {WORKERS_ENV: "1", WORKERS_COUNT_ENV: str(n)}, WORKERS, 0, DATA,
                      why + (": the monitor's advice" if n in advised else ""), [WORKERS_ENV])
           for n in tried]
    return out, ([] if out else [Skipped("DataLoader workers", "no other count fits the CPUs")])


def gpu_candidates(facts: Facts, max_level: int) -> tuple[list[Candidate], list[Skipped]]:
    wanted = [f for f in _usable(facts)
              if f.level <= max_level and (f.category == "Precision control" or "compile" in f.name)]
    if facts.gpus == 0:
        return [], [Skipped("TF32 / compile features alone", "no GPU here")]
    out = [_candidate(f"{_short(f.env)} alone", {f.env: "1"}, GPU, f.level, COMPUTE, f.category, [f.env])
           for f in sorted(wanted, key=lambda f: f.name)]
    return out, ([] if out else [Skipped("TF32 / compile features alone", "none applies here")])


def combine(features: Candidate, workers: Candidate) -> Candidate:
    """The best feature setting and the best worker count together."""
    env = {**features.environ, **workers.environ}
    return Candidate(f"{features.key} + {workers.key}", tuple(env.items()), COMBINED,
                     max(features.level, workers.level), workers.topic,
                     f"best of {features.group} and of workers together", features.enables | workers.enables,
                     features.pieces + workers.pieces)


def of_parts(parts: Sequence[Part]) -> Candidate:
    """The candidate made of ``parts`` (the baseline when there are none)."""
    if not parts:
        return baseline()
    if len(parts) == 1:
        p = parts[0]
        return Candidate(p.label, p.env, p.group, p.level, p.topic, "", p.enables)
    env: dict[str, str] = {}
    for p in parts:
        env.update(p.env)
    return Candidate(" ".join(p.label if i == 0 or p.label.startswith("+") else f"+ {p.label}"
                              for i, p in enumerate(parts)), tuple(env.items()), COMBINED,
                     max(p.level for p in parts), parts[-1].topic, "", frozenset().union(*(p.enables for p in parts)),
                     tuple(parts))


def without(candidate: Candidate, part: Part) -> Candidate:
    """``candidate`` with ``part`` left out (leave-one-out ablation of a winner)."""
    return of_parts([p for p in candidate.pieces if p != part])


def _recommended(candidate: Candidate, recommendations: Sequence[str]) -> bool:
    names = set(candidate.enables) | {k for k, _ in candidate.env}
    if candidate.group == WORKERS:
        names |= {"num_workers", "workers"}
    return any(name in text for text in recommendations for name in names)


def order(candidates: Sequence[Candidate], figures: Figures | None) -> list[Candidate]:
    """The search order: what the baseline's monitor recommends first; then, for a data-bound job,
    the data settings (worker counts, data options) before the compute ones, else the levels, the
    GPU features, the options and the worker counts."""
    recs = [r.setting for r in figures.recommendations] if figures else []
    data_first = bool(figures and figures.data_bound)
    group_rank = ({WORKERS: 0, OPTIONS: 1, LEVELS: 2, GPU: 3} if data_first
                  else {LEVELS: 0, GPU: 1, OPTIONS: 2, WORKERS: 3})

    def key(item: tuple[int, Candidate]) -> tuple[int, int, int, int]:
        index, c = item
        topic = 0 if (c.topic == DATA) == data_first else 1
        return (0 if _recommended(c, recs) else 1, topic, group_rank.get(c.group, 9), index)

    return [c for _, c in sorted(enumerate(candidates), key=key)]


def build(facts: Facts, figures: Figures | None, max_level: int) -> tuple[list[Candidate], list[Skipped]]:
    """Every candidate for this job on this machine, in search order, and what was left out."""
    candidates: list[Candidate] = []
    skipped: list[Skipped] = []
    for made, left in (level_candidates(facts, max_level), option_candidates(facts, figures, max_level),
                       worker_candidates(figures, facts), gpu_candidates(facts, max_level)):
        candidates.extend(made)
        skipped.extend(left)
    seen: set[tuple[tuple[str, str], ...]] = set()
    unique = []
    for c in candidates:
        if c.env not in seen:
            seen.add(c.env)
            unique.append(c)
    return order(unique, figures), skipped
