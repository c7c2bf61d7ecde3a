"""The Feature Summary: the product's table, plus reasons, faults and the log path; and its JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from loongkit_core.feature import FeatureRecord, State

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~5 ms in every booting process)
if TYPE_CHECKING:
    from loongkit_core.manager import Fault
    from loongkit_core.process import ProcessInfo

WIDTH = 82
NAME_WIDTH = 31
TITLE = " Loongkit Feature Summary "


def display_config(config: object) -> str:
    """The "Configurations" column: a dict for option models, ``None`` for no options."""
    dump = getattr(config, "model_dump", None)
    if callable(dump):
        config = dump()
    return repr(config) if config is not None else "None"


def _n(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def activity_text(record: FeatureRecord) -> str:
    """How much the feature ran and where: ``2 workers, 1,240 calls``; ``main + 2 workers, 1,252
    calls``; in local rank 0's node view ``ranks 0,1 of 2, 4 workers, 2,480 calls``. "" when it did
    not run."""
    if record.node:
        active = {rank: t for rank, t in record.node.items() if t["calls"] or t["worker_calls"]}
        if not active:
            return ""
        calls = sum(t["calls"] + t["worker_calls"] for t in active.values())
        workers = sum(t["workers"] for t in active.values())
        ranks = ",".join(str(r) for r in sorted(active))
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


def render(records: Sequence[FeatureRecord], faults: Sequence[Fault] = (), extra: Sequence[str] = (),
           log_path: str | None = None) -> str:
    """The Summary as text, in the product's layout (first two columns), reasons appended."""
    lines = [TITLE.center(WIDTH, "="), f"{'Enabled Features':<{NAME_WIDTH + 2}}Configurations", "-" * WIDTH]
    for record in records:
        if not record.enabled:
            continue
        mark = "*" if record.active else " "
        row = f"{record.feature.name:<{NAME_WIDTH}}{mark} {display_config(record.config)}"
        how_much = activity_text(record)
        if how_much:
            row += f"  ({how_much})"
        why = status(record)
        if why:
            row += f"  [{why}]"
        lines.append(row)
    if not any(r.enabled for r in records):
        lines.append("(no feature enabled)")
    if faults:
        lines.append("-" * WIDTH)
        lines.append("Plugin faults:")
        for fault in faults:
            where = fault.where + (f", feature {fault.feature}" if fault.feature else "")
            lines.append(f"  {fault.plugin} ({where}): {fault.error}")
    if extra:
        lines.append("-" * WIDTH)
        lines.extend(extra)
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
