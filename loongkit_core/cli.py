"""The ``loongkit`` command: features, doctor, prelude-path, and plugin subcommands."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence

from loongkit_core import log, requirements
from loongkit_core.feature import State
from loongkit_core.runtime import Runtime


def _runtime(environ: dict[str, str] | None = None) -> Runtime:
    """A runtime that resolves but arms nothing. Its log records (a plugin's fault with its traceback, the
    warnings) go where every process's go, by LOONGKIT_LOGDIR and LOONGKIT_LOGLEVEL; a ``stdout``
    destination becomes stderr, as stdout holds the command's own output (``--json``)."""
    env = dict(os.environ if environ is None else environ)
    rt = Runtime(env, arm=False)
    to_stdout = (rt.settings.logdir or "").strip().lower() == "stdout"
    rt.boot(logdir="stderr" if to_stdout else None)
    return rt


def _fault_lines(rt: Runtime, prefix: str) -> list[str]:
    """One line per plugin fault for the command's own report; the traceback is in the log, once."""
    where = log.log_path() or (rt.destination.kind if rt.destination else "stderr")
    return [f"{prefix}plugin {f.plugin} ({f.where}{', feature ' + f.feature if f.feature else ''}): {f.error}"
            f" (traceback in {where})" for f in rt.manager.faults]


def _would_apply(rt: Runtime) -> dict[str, str]:
    """For every feature: "yes" or the reason it would not apply here. Features the boot resolved already
    keep that verdict (probing them again would repeat their detect hook, and any fault of it)."""
    verdicts = {}
    for name, record in rt.records.items():
        if record.enabled and record.state != State.DISABLED:
            verdicts[name] = ("yes" if record.state == State.ARMED
                              else f"{record.state.value}: {record.reason}")
            continue
        probe = type(record)(record.feature, enabled=True)
        rt.records[name] = probe
        rt._resolve_applicable(probe)
        rt.records[name] = record
        verdicts[name] = "yes" if probe.state == State.ARMED else f"{probe.state.value}: {probe.reason}"
    return verdicts


def cmd_features(args: argparse.Namespace) -> int:
    rt = args.runtime or _runtime()
    verdicts = _would_apply(rt)
    rows = []
    for name, record in sorted(rt.records.items(), key=lambda kv: (kv[1].feature.category.value, kv[0])):
        f = record.feature
        rows.append({
            "name": name, "env": f.env, "level": f.level, "category": f.category.value,
            "plugin": f"{f.plugin} {f.plugin_version}".strip(), "requires": list(f.requires),
            "targets": list(f.targets), "options": list(f.options), "implemented": f.implemented,
            "enabled_now": record.enabled, "applies_here": verdicts[name], "description": f.description,
        })
    if args.json:
        print(json.dumps({"features": rows, "faults": [x.to_json() for x in rt.manager.faults]}, indent=2))
        return 0
    if args.markdown:
        print("| variable | level | category | versions | plugin | status |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            status = "implemented" if r["implemented"] else "declared, not implemented yet"
            print(f"| `{r['env']}` | {r['level']} | {r['category']} | {', '.join(r['requires']) or 'any'} "
                  f"| {r['plugin']} | {status} |")
        return 0
    for category in dict.fromkeys(r["category"] for r in rows):
        print(f"== {category}")
        for r in (r for r in rows if r["category"] == category):
            print(f"  {r['env']:<36} level {r['level']}  plugin {r['plugin']}")
            print(f"      {r['description']}")
            print(f"      requires: {', '.join(r['requires']) or 'nothing'};  applies here: {r['applies_here']}"
                  + ("  [enabled now]" if r["enabled_now"] else ""))
            if r["options"]:
                print(f"      options: {', '.join(r['options'])}")
    for line in _fault_lines(rt, "!! "):
        print(line)
    return 0


def doctor_report(rt: Runtime) -> dict[str, object]:
    hw = rt.env.hardware
    versions = {m: (found.version if (found := requirements.installed(m)) else None)
                for m in ("torch", "mmcv", "mmengine", "mmdet", "mmseg", "mmdet3d", "transformers",
                          "accelerate", "triton")}
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": versions,
        "cpu_vendor": hw.cpu_vendor,
        "numa_nodes": {n.id: _cpulist(n.cpus) for n in hw.nodes},
        "l3_caches": len(hw.l3_caches),
        "gpus": [{"pci": g.pci, "vendor": g.vendor, "numa_node": g.numa_node} for g in hw.gpus],
        "cgroup_version": hw.cgroup_version,
        "allowed_cpus": _cpulist(hw.allowed_cpus),
        "hardware_notes": list(hw.notes),
        "settings": rt.settings.model_dump(),
        "process": rt.process.to_json(),
        "enabled": {name: (r.state.value, r.reason) for name, r in rt.records.items() if r.enabled},
        "plugins": {p.name: f"{p.distribution} {p.version}" for p in rt.manager.plugins.values()},
        "faults": [f.to_json() for f in rt.manager.faults],
    }


def _cpulist(cpus: frozenset[int]) -> str:
    from loongkit_core.hardware import format_cpulist

    return format_cpulist(cpus)


def cmd_doctor(args: argparse.Namespace) -> int:
    report = doctor_report(args.runtime or _runtime())
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    for key, value in report.items():
        print(f"{key:>15}: {value}")
    return 0


def print_info(command: Sequence[str], environ: dict[str, str] | None = None, rt: Runtime | None = None) -> int:
    """``loongkit-run --info``: what loongkit would do for this command in this environment."""
    rt = rt or _runtime(environ)
    print(f"command: {' '.join(command) or '(none)'}")
    print(f"settings: {rt.settings.model_dump()}")
    for warning in rt.warnings:  # every warning the boot gave: settings, switches, options, names
        print(f"warning: {warning}")
    enabled = [r for r in rt.records.values() if r.enabled]
    if not enabled:
        print("no feature enabled (set LOONGKIT_ALL=1..3 or LOONGKIT_<FEATURE>=1)")
    for record in enabled:
        how = "explicit" if record.explicit else f"LOONGKIT_ALL>={record.feature.level}"
        state = "will apply" if record.state == State.ARMED else f"{record.state.value}: {record.reason}"
        targets = f" on import of {', '.join(record.feature.targets)}" if record.feature.targets else " at start"
        print(f"  {record.feature.name:<24} ({how}) {state}{targets if record.state == State.ARMED else ''}")
        print(f"  {'':<24} config: {record.config if record.config is not None else 'None'}")
    for line in _fault_lines(rt, "fault: "):
        print(line)
    return 0


def build_parser(rt: Runtime | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loongkit", description="plugin-based PyTorch training acceleration")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("features", help="every feature of every installed plugin, and whether it applies here")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="the README's feature table")
    p.set_defaults(func=cmd_features)
    p = sub.add_parser("doctor", help="environment report: versions, CPU, NUMA, GPUs, cgroups, settings")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser("prelude-path", help="print the directory to put on PYTHONPATH")
    p.set_defaults(func=lambda a: print(os.path.join(os.path.dirname(__file__), "prelude")) or 0)
    p = sub.add_parser("info", help="what loongkit would do in this environment (as loongkit-run --info)")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: print_info(a.cmd, rt=a.runtime))
    from loongkit_core import bench, compare

    compare.add_parser(sub)
    bench.add_parser(sub)
    if rt is not None:
        rt.manager.call_each("loongkit_add_cli", subparsers=sub)
    parser.set_defaults(runtime=rt)  # the commands reuse it: one boot, so each fault is logged once
    return parser


# The core's own commands that need no plugin; every other invocation (``--help`` included) boots once,
# so that plugins' subcommands (``loongkit numa plan``, ``loongkit malloc-env``) exist and are listed.
_NO_PLUGINS = ("prelude-path", "compare", "bench")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rt = None if argv and argv[0] in _NO_PLUGINS else _runtime()
    parser = build_parser(rt)
    args = parser.parse_args(argv)
    result = args.func(args)
    log.shutdown()
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
