"""The Feature Summary: the product's table, plus reasons, faults and the log path; and its JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from loongkit_core.feature import FeatureRecord, State

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at boot (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    from loongkit_core.manager import Fault
    from loongkit_core.process import ProcessInfo

WIDTH = 82
NAME_WIDTH = 31
TITLE = " Loongkit Feature Summary "
# The longest line printed on stdout: a terminal shows it on one line. The JSON Summary and a log file
# keep the full text (render(..., line_width=None)).
LINE_WIDTH = 120
ELLIPSIS = "..."  # ASCII: a "…" on a non-UTF-8 stdout would raise and lose the whole Summary
FAULT_LINES = 3  # a fault's message wraps onto at most this many lines on stdout
EXTRA_LINES = 4  # as much for one line of a plugin's section


def _config_value(config: object) -> object:
    dump = getattr(config, "model_dump", None)  # option models (pydantic) show as their fields
    return dump() if callable(dump) else config


def display_config(config: object, budget: int | None = None) -> str:
    """The "Configurations" column: a dict for option models, ``None`` for no options; at most
    ``budget`` characters when given (see :func:`compact_repr`)."""
    value = _config_value(config)
    if value is None:
        return "None"
    return repr(value) if budget is None else compact_repr(value, budget)


def compact_repr(value: object, budget: int) -> str:
    """``repr(value)`` in at most ``budget`` characters (3 at least). A dict, list, tuple or set keeps
    as many entries as fit, each key whole, and counts the others (``+N more``); the values left share
    what remains equally (short ones stay whole, long ones are cut to ``...``), so the keys (what was
    patched, which options there are) show before any one long value. A string is cut inside its quotes."""
    text = repr(value)
    if len(text) <= budget:
        return text
    if isinstance(value, dict) and value:
        return _entries("{", "}", [(repr(k) + ": ", v) for k, v in value.items()], budget)
    if isinstance(value, (list, tuple)) and value:
        brackets = ("[", "]") if isinstance(value, list) else ("(", ")")
        return _entries(*brackets, [("", v) for v in value], budget)
    if isinstance(value, (set, frozenset)) and value:
        return _entries("{", "}", [("", v) for v in value], budget)
    if isinstance(value, str):
        if budget < len(ELLIPSIS) + 3:  # "'x...'" at least
            return ELLIPSIS
        n = budget - 5
        while n > 0 and len(repr(value[:n])) + len(ELLIPSIS) > budget:  # escapes take more room
            n -= 1
        quoted = repr(value[:n])
        return quoted[:-1] + ELLIPSIS + quoted[-1]
    return _clip(text, budget)


def _entries(open_: str, close: str, entries: list[tuple[str, object]], budget: int) -> str:
    def layout(k: int, cap: int) -> str:
        parts = [key + compact_repr(v, cap) for key, v in entries[:k]]
        if k < len(entries):
            parts.append(f"{ELLIPSIS} +{len(entries) - k} more")
        return open_ + ", ".join(parts) + close

    # as many entries as fit with their values cut to "..." (an entry takes 5 characters at least,
    # so a list of thousands is not laid out thousands of times)
    k = min(len(entries), budget // 5 + 1)
    while k >= 0 and len(layout(k, len(ELLIPSIS))) > budget:
        k -= 1
    if k < 0:
        return open_ + ELLIPSIS + close if budget >= len(ELLIPSIS) + 2 else ELLIPSIS
    # then the widest common cap on their values that still fits (binary search: width grows with cap)
    lo, hi = len(ELLIPSIS), max((len(repr(v)) for _, v in entries[:k]), default=len(ELLIPSIS))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(layout(k, mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return layout(k, lo)


def _clip(text: str, budget: int) -> str:
    if len(text) <= budget:
        return text
    # "1..." or "<cl..." says nothing more than "..."
    return text[:budget - len(ELLIPSIS)] + ELLIPSIS if budget >= 2 * len(ELLIPSIS) else ELLIPSIS


def shorten_text(text: str, budget: int) -> str:
    """Prose (a reason) in at most ``budget`` characters, on one line. ``prefix: a, b, c`` with names for
    items (module, class, variable names) keeps the names that fit and counts the others (``+N more``);
    other text is cut at a word boundary, with ``...``."""
    text = " ".join(text.split())  # a multi-line exception message would break the table
    if len(text) <= budget:
        return text
    head, sep, tail = text.partition(": ")
    items = tail.split(", ") if sep else []
    if len(items) > 1 and all(item and " " not in item for item in items):
        for k in range(len(items) - 1, 0, -1):
            candidate = f"{head}: {', '.join(items[:k])} +{len(items) - k} more"
            if len(candidate) <= budget:
                return candidate
    cut = text[:max(budget - len(ELLIPSIS), 0)]
    space = cut.rfind(" ")
    if space > len(cut) // 2:  # a word boundary, unless it would drop half of what fits
        cut = cut[:space]
    return cut.rstrip(" ,;:") + ELLIPSIS


def _wrap(line: str, width: int, max_lines: int) -> list[str]:
    """A line under the table, wrapped to ``width`` under its own indentation (continuations 2 deeper);
    lines that fit are left exactly as they are."""
    import textwrap  # at exit only, and only when a line is too long

    out: list[str] = []
    for piece in line.split("\n"):
        if len(piece) <= width:
            out.append(piece)
            continue
        indent = piece[:len(piece) - len(piece.lstrip())]
        out.extend(textwrap.wrap(piece.strip(), width, initial_indent=indent, subsequent_indent=indent + "  ",
                                 max_lines=max_lines, placeholder=" " + ELLIPSIS))
    return out


def _n(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def _ranks(ranks: Sequence[int]) -> str:
    """``0,1`` ; ``0-7`` ; ``0-3,5,7-9``: runs of three or more as a range, so 8 or 64 ranks stay short."""
    from loongkit_core.hardware import format_cpulist  # at exit only; the same compaction as CPU lists

    return format_cpulist(ranks, min_run=3)


def activity_text(record: FeatureRecord) -> str:
    """How much the feature ran and where: ``2 workers, 1,240 calls``; ``main + 2 workers, 1,252
    calls``; in local rank 0's node view ``ranks 0,1 of 2, 4 workers, 2,480 calls`` (``ranks 0-7 of 8``).
    "" when it did not run."""
    if record.node:
        active = {rank: t for rank, t in record.node.items() if t["calls"] or t["worker_calls"]}
        if not active:
            return ""
        calls = sum(t["calls"] + t["worker_calls"] for t in active.values())
        workers = sum(t["workers"] for t in active.values())
        ranks = _ranks(sorted(active))
        parts = [f"rank{'s' if len(active) > 1 else ''} {ranks} of {len(record.node) or len(active)}"]
        if workers:
            parts.append(_n(workers, "worker"))
        return ", ".join([*parts, _n(calls, "call")])
    if not record.active:
        return ""
    total = record.calls + record.worker_calls
    if record.worker_calls and record.calls:
        return f"main + {_n(record.workers, 'worker')}, {_n(total, 'call')}"
    if record.worker_calls:
        return f"{_n(record.workers, 'worker')}, {_n(total, 'call')}"
    return _n(total, "call")


def status(record: FeatureRecord) -> str:
    """Why a row is not starred ("" for an active feature)."""
    if record.active:
        return ""
    if record.state == State.APPLIED:
        return record.reason or "applied, its code did not run"
    if record.state == State.ARMED:
        return record.reason or "target not imported: " + ", ".join(record.feature.targets)
    label = record.state.value
    return f"{label}: {record.reason}" if record.reason else label


def row(record: FeatureRecord, line_width: int | None = LINE_WIDTH) -> str:
    """One feature's line: name, ``*`` when its code ran, configuration, ``(counts)``, ``[why not *]``.

    Within ``line_width`` the counts stay whole (they are short); the configuration and the reason
    share the rest: each keeps what it needs when the other is short, half each when both are long."""
    prefix = f"{record.feature.name:<{NAME_WIDTH}}{'*' if record.active else ' '} "
    how_much = activity_text(record)
    counts = f"  ({how_much})" if how_much else ""
    why = status(record)
    if line_width is not None:
        why = " ".join(why.split())  # a multi-line exception message would break the table
    config = display_config(record.config)
    if line_width is None or len(prefix) + len(config) + len(counts) + (len(why) + 4 if why else 0) <= line_width:
        return prefix + config + counts + (f"  [{why}]" if why else "")
    room = max(line_width - len(prefix) - len(counts), 24)  # an overlong name or counts: still say something
    why_need = len(why) + 4 if why else 0  # "  [" + reason + "]"
    config = display_config(record.config, min(len(config), max(room - why_need, room // 2)))
    if not why:
        return prefix + config + counts
    return prefix + config + counts + f"  [{shorten_text(why, max(room - len(config) - 4, 12))}]"


def render(records: Sequence[FeatureRecord], faults: Sequence[Fault] = (), extra: Sequence[str] = (),
           log_path: str | None = None, line_width: int | None = LINE_WIDTH) -> str:
    """The Summary as text, in the product's layout (first two columns), counts and reasons appended.

    ``line_width`` (stdout's) bounds every line: long configurations and reasons are shortened, faults
    and plugins' lines wrapped; ``None`` renders everything in full (a log file; the JSON has it all too).
    The ``Log:`` path is never cut: a shortened path could not be opened."""
    lines = [TITLE.center(WIDTH, "="), f"{'Enabled Features':<{NAME_WIDTH + 2}}Configurations", "-" * WIDTH]
    lines.extend(row(record, line_width) for record in records if record.enabled)
    if not any(r.enabled for r in records):
        lines.append("(no feature enabled)")
    if faults:
        lines.append("-" * WIDTH)
        lines.append("Plugin faults:")
        for fault in faults:
            where = fault.where + (f", feature {fault.feature}" if fault.feature else "")
            if line_width is None:
                lines.append(f"  {fault.plugin} ({where}): {fault.error}")
            else:  # a multi-line message on one line, then wrapped: a fault stays one short item
                lines.extend(_wrap(f"  {fault.plugin} ({where}): {' '.join(fault.error.split())}", line_width,
                                   FAULT_LINES))
    if extra:
        lines.append("-" * WIDTH)
        for line in extra:
            lines.extend([line] if line_width is None else _wrap(line, line_width, EXTRA_LINES))
    if log_path:
        lines.append(f"Log: {log_path}")
    lines.append("=" * WIDTH)
    return "\n".join(lines) + "\n"


def to_json(records: Sequence[FeatureRecord], faults: Sequence[Fault], process: ProcessInfo,
            log_path: str | None, extra: Sequence[str] = ()) -> dict[str, object]:
    return {
        "version": 1,
        "process": process.to_json(),
        "features": [r.to_json() for r in records if r.enabled],
        "faults": [f.to_json() for f in faults],
        "extra": list(extra),
        "log": log_path,
    }


def json_path(template: str, process: ProcessInfo) -> str:
    """``LOONGKIT_SUMMARY_JSON`` may hold ``{rank}``/``{pid}``; without them, ranks other than 0 of a
    multi-rank job get a ``.rank<N>`` suffix so they do not overwrite each other."""
    path = template.replace("{pid}", str(process.pid)).replace("{rank}", str(process.rank or 0))
    if path == template and (process.rank or 0) > 0:
        root, ext = os.path.splitext(template)
        path = f"{root}.rank{process.rank}{ext}"
    return path


def write_json(path: str, payload: dict[str, object]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w") as fh:
        json.dump(payload, fh, indent=2, sort_keys=True)
    os.replace(tmp, path)
