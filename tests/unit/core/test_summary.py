"""The Feature Summary a terminal can show (issue 23): the product's two columns, every stdout line within
LINE_WIDTH, the '*' rule, compact counts, shortened configurations and reasons, wrapped faults and plugin
lines; the full text in the log's rendering (line_width=None) and in the JSON."""

from __future__ import annotations

import json
import os
import random

import pytest

from loongkit_core.feature import Category, Feature, FeatureRecord, State
from loongkit_core.manager import Fault
from loongkit_core.process import ProcessInfo
from loongkit_core.summary import (
    EXTRA_LINES,
    FAULT_LINES,
    LINE_WIDTH,
    NAME_WIDTH,
    WIDTH,
    compact_repr,
    render,
    shorten_text,
    to_json,
)

# ~400 characters, nested, as pytorch's configuration is
BIG_CONFIG = {
    "worker_malloc": {"mmap_threshold": "64MiB", "trim_threshold": "512MiB", "top_pad": "0MiB", "arena_max": 4,
                      "bound": "each worker holds <= its size after a clean batch +25% of that batch (>= 64MiB), "
                               "else trimmed"},
    "serialize": "fork workers, lists of >= 1000 dicts/tuples",
    "nofile": "20000 (already the hard limit)",
    "classes": {f"Class{i}Attention": f"loongkit::kernel_{i}" for i in range(4)},
}
LONG_REASON = ("target not imported: mmcv.ops.multi_scale_deform_attn, mmcv.utils.registry, "
               "mmengine.registry.registry, mmdet3d.models.builder, projects.mmdet3d_plugin.bevformer.modules")


def record(name: str = "feat", *, config: object = None, calls: int = 0, worker_calls: int = 0, workers: int = 0,
           state: State = State.APPLIED, reason: str = "", node: dict[int, dict[str, int]] | None = None
           ) -> FeatureRecord:
    feature = Feature(name=name, env=f"LOONGKIT_{name.upper()}", level=1, category=Category.OTHER,
                      description="test feature", plugin="test")
    return FeatureRecord(feature, state=state, reason=reason, enabled=True, config=config, calls=calls,
                         worker_calls=worker_calls, workers=workers, node=node)


def rows(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + " ") or line.startswith(name + "*")]


def only_row(text: str, name: str) -> str:
    (line,) = rows(text, name)
    return line


def proc() -> ProcessInfo:
    return ProcessInfo(role="main", pid=os.getpid(), host="h", rank=None, local_rank=None, world_size=None,
                       local_world_size=None)


def test_the_products_layout_is_kept() -> None:
    text = render([record("data_container", calls=1), record("numa_affinity", config={"allow_index": False})])
    lines = text.splitlines()
    assert lines[0] == "=" * 28 + " Loongkit Feature Summary " + "=" * 28 and len(lines[0]) == WIDTH
    assert lines[1] == "Enabled Features                 Configurations"
    assert lines[2] == "-" * WIDTH and lines[-1] == "=" * WIDTH
    assert lines[3] == "data_container                 * None  (1 call)"
    assert lines[4] == "numa_affinity                    {'allow_index': False}  [applied, its code did not run]"


def test_a_400_character_config_row_fits_and_the_json_keeps_it_whole() -> None:
    assert len(repr(BIG_CONFIG)) >= 400
    rec = record("pytorch", config=BIG_CONFIG, calls=1, worker_calls=2, workers=2)
    line = only_row(render([rec]), "pytorch")
    assert len(line) <= LINE_WIDTH, line
    assert line.startswith("pytorch" + " " * (NAME_WIDTH - len("pytorch")) + "* {'worker_malloc': ")
    # the first keys (the options there are), whole and in order, a count of the others; the counts whole
    shown = [key for key in BIG_CONFIG if repr(key) + ": " in line]
    assert shown == list(BIG_CONFIG)[:len(shown)] and len(shown) >= 2, line
    assert line.endswith(f"... +{len(BIG_CONFIG) - len(shown)} more}}  (main + 2 workers, 3 calls)"), line
    # the full text: the log's rendering and the JSON Summary
    assert only_row(render([rec], line_width=None), "pytorch") == (
        f"{'pytorch':<{NAME_WIDTH}}* {BIG_CONFIG!r}  (main + 2 workers, 3 calls)")
    payload = to_json([rec], [], proc(), None)
    assert json.loads(json.dumps(payload))["features"][0]["config"] == BIG_CONFIG


def test_a_long_class_map_names_what_fits_and_counts_the_rest() -> None:
    classes = {f"Patched{i}DeformableAttention3D": f"loongkit::ms_deform_attn_fused_{i}" for i in range(12)}
    line = only_row(render([record("bevformer", config=classes, calls=7)]), "bevformer")
    assert len(line) <= LINE_WIDTH, line
    shown = [name for name in classes if repr(name) in line]
    assert 0 < len(shown) < len(classes) and shown == list(classes)[:len(shown)], line  # in order
    assert line.endswith(f"... +{len(classes) - len(shown)} more}}  (7 calls)"), line


def test_the_star_is_whether_the_code_ran() -> None:
    ran = [record("a", calls=3), record("b", worker_calls=1, workers=1),
           record("c", node={0: {"calls": 0, "worker_calls": 0, "workers": 0},
                             1: {"calls": 5, "worker_calls": 0, "workers": 0}})]
    idle = [record("d"), record("e", state=State.ARMED, reason=LONG_REASON), record("f", state=State.FAILED,
                                                                                       reason="boom"),
            record("g", config=BIG_CONFIG)]
    text = render([*ran, *idle])
    for rec in ran:
        line = only_row(text, rec.feature.name)
        assert line[NAME_WIDTH] == "*" and "[" not in line[NAME_WIDTH:], line
    for rec in idle:
        line = only_row(text, rec.feature.name)
        assert line[NAME_WIDTH] == " " and line.endswith("]") and "calls)" not in line, line
        assert len(line) <= LINE_WIDTH
    assert only_row(text, "d").endswith("None  [applied, its code did not run]")
    assert only_row(text, "f").endswith("None  [failed: boom]")
    # a star row with a long config is shortened, never unstarred
    assert only_row(render([record("g", config=BIG_CONFIG, calls=1)]), "g")[NAME_WIDTH] == "*"


@pytest.mark.parametrize(("kwargs", "counts"), [
    ({"calls": 1}, "(1 call)"),
    ({"calls": 12, "worker_calls": 1240, "workers": 2}, "(main + 2 workers, 1,252 calls)"),
    ({"worker_calls": 24, "workers": 2}, "(2 workers, 24 calls)"),
    ({"node": {0: {"calls": 16, "worker_calls": 0, "workers": 1}, 1: {"calls": 16, "worker_calls": 0, "workers": 1}}},
     "(ranks 0,1 of 2, 2 workers, 32 calls)"),
    ({"node": {0: {"calls": 0, "worker_calls": 0, "workers": 0}, 1: {"calls": 5, "worker_calls": 0, "workers": 2}}},
     "(rank 1 of 2, 2 workers, 5 calls)"),
    # eight ranks as a range, a gap as a list
    ({"node": {r: {"calls": 1000, "worker_calls": 0, "workers": 4} for r in range(8)}},
     "(ranks 0-7 of 8, 32 workers, 8,000 calls)"),
    ({"node": {r: {"calls": int(r != 4), "worker_calls": 0, "workers": 0} for r in range(8)}},
     "(ranks 0-3,5-7 of 8, 7 calls)"),
])
def test_counts_stay_whole_and_compact(kwargs: dict[str, object], counts: str) -> None:
    for config in (None, BIG_CONFIG):
        line = only_row(render([record("x", config=config, **kwargs)]), "x")  # type: ignore[arg-type]
        assert line.endswith("  " + counts) and line[NAME_WIDTH] == "*" and len(line) <= LINE_WIDTH, line


def test_a_long_reason_is_shortened_readably_and_kept_whole_elsewhere() -> None:
    names = LONG_REASON.split(": ", 1)[1].split(", ")
    armed = record("bevformer", state=State.ARMED, reason=LONG_REASON)
    line = only_row(render([armed]), "bevformer")
    assert len(line) <= LINE_WIDTH, line
    # names that fit, whole, then a count of the others
    shown = [n for n in names if n in line]
    assert shown == names[:len(shown)] and shown, line
    assert line.endswith(f"None  [target not imported: {', '.join(shown)} +{len(names) - len(shown)} more]"), line
    # prose: cut at a word, on one line even when the message had several
    prose = "failed: " + "RuntimeError('the kernel could not be built\nbecause the compiler said no " * 6 + "')"
    failed = record("ops", state=State.FAILED, reason=prose.split(": ", 1)[1], config={"fused": 1})
    line = only_row(render([failed]), "ops")
    assert len(line) <= LINE_WIDTH and line.endswith("...]") and "\n" not in line, line
    assert line.startswith(f"{'ops':<{NAME_WIDTH}}  {{'fused': 1}}  [failed: RuntimeError('the kernel"), line
    # a long reason beside a long config: each gets a share, both still say something
    both = only_row(render([record("g", config=BIG_CONFIG, state=State.ARMED, reason=LONG_REASON)]), "g")
    assert len(both) <= LINE_WIDTH and "'worker_malloc': " in both and "[target not imported: mmcv." in both, both
    # the full text: the log's rendering and the JSON
    assert only_row(render([armed], line_width=None), "bevformer").endswith(f"  [{LONG_REASON}]")
    assert to_json([armed], [], proc(), None)["features"][0]["reason"] == LONG_REASON  # type: ignore[index]


def test_shorten_text() -> None:
    assert shorten_text("short", 10) == "short"
    assert shorten_text("target not imported: a.b, c.d, e.f", 32) == "target not imported: a.b +2 more"
    assert shorten_text("target not imported: a.b, c.d, e.f", 31) == "target not imported: a.b..."
    cut = shorten_text("the quick brown fox jumps over the lazy dog", 20)
    assert cut == "the quick brown..." and len(cut) <= 20


def test_a_long_fault_wraps_within_the_width() -> None:
    error = "ValueError('" + "the plugin could not read /sys/devices/system/node/node0/cpulist: " * 3 + "')"
    fault = Fault("numa", "activate", error, traceback="Traceback...", feature="numa_affinity")
    text = render([record("numa_affinity", calls=1)], [fault])
    lines = text.splitlines()
    start = lines.index("Plugin faults:")
    fault_lines = lines[start + 1:-1]
    assert fault_lines[0].startswith("  numa (activate, feature numa_affinity): ValueError('the plugin could not")
    assert 1 < len(fault_lines) <= FAULT_LINES and all(line.startswith("    ") for line in fault_lines[1:])
    assert all(len(line) <= LINE_WIDTH for line in lines), text
    # a short fault is one line, as before; the full one is in the log's rendering and the JSON
    short = render([], [Fault("bad", "load", "RuntimeError('boom in load')")]).splitlines()
    assert "  bad (load): RuntimeError('boom in load')" in short
    assert f"  numa (activate, feature numa_affinity): {error}" in render([], [fault], line_width=None)
    assert to_json([], [fault], proc(), None)["faults"] == [fault.to_json()]


def test_plugin_lines_wrap_under_their_indentation_and_short_ones_are_untouched() -> None:
    extra = ["Training monitor (rank 0; steps = optimizer AdamW.step)",
             "    rank 1: 59.0 ms / 52.0 ms / 0.2 ms  <- straggler",
             "  main process: " + ", ".join(f"figure {i} is {i * 1.5:.1f} ms" for i in range(20)),
             "Off by hardware policy: a, b (" + "word " * 200 + ")"]
    lines = render([record("monitor", calls=1)], extra=extra).splitlines()
    assert extra[0] in lines and extra[1] in lines  # a short line, even its double spaces, as it was
    assert all(len(line) <= LINE_WIDTH for line in lines)
    at = lines.index(next(line for line in lines if line.startswith("  main process: figure 0 is")))
    assert lines[at + 1].startswith("    figure")  # continuation: two deeper than the line's own indentation
    long = [line for line in lines if line.startswith("Off by hardware policy")]
    assert long and lines[lines.index(long[0]) + EXTRA_LINES - 1].endswith(" ...")  # capped
    assert "word " * 200 in render([], extra=extra, line_width=None)  # the log's Summary has it all


def test_compact_repr_fits_any_budget_and_keeps_small_values() -> None:
    assert compact_repr({"a": 1}, 100) == "{'a': 1}"
    assert compact_repr(["x" * 50, 1, 2], 30) == "['" + "x" * 17 + "...', 1, 2]"  # small values stay whole
    assert compact_repr(list(range(100_000)), 40).endswith(" more]")
    rng = random.Random(23)

    def value(depth: int) -> object:
        kind = rng.randrange(6 if depth < 3 else 3)
        if kind == 0:
            return rng.randrange(10 ** rng.randrange(1, 30))
        if kind == 1:
            return "".join(rng.choice("ab 'c\"\n\\é") for _ in range(rng.randrange(60)))
        if kind == 2:
            return rng.choice([None, True, 1.5])
        if kind == 3:
            return {f"k{i}": value(depth + 1) for i in range(rng.randrange(8))}
        if kind == 4:
            return [value(depth + 1) for _ in range(rng.randrange(8))]
        return tuple(value(depth + 1) for _ in range(rng.randrange(4)))

    for _ in range(300):
        v = value(0)
        for budget in (3, 8, 20, 60, 87, 200):
            text = compact_repr(v, budget)
            assert len(text) <= budget, (budget, text, v)
            if len(repr(v)) <= budget:
                assert text == repr(v)
