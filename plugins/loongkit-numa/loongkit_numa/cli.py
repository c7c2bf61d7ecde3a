"""``loongkit numa plan``: a dry run of the NUMA affinity feature.

Prints, for each local rank, its GPU, node, training CPUs, data CPUs, memory node and the rule that
decided it - computed by :func:`loongkit_numa.affinity.plan_for_node`, the function the feature
applies, with the same options (LOONGKIT_NUMA_AFFINITY_* and the CPU-vendor policy).
Also runnable alone: ``python -m loongkit_numa.cli plan --sysfs-root DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from loongkit_core.hardware import Hardware, detect, format_cpulist
from loongkit_core.settings import load_settings
from loongkit_numa.options import NumaAffinityOptions
from loongkit_numa.plan import NodePlan, RankPlan

COLUMNS = ("rank", "GPU", "node", "training CPUs", "data CPUs", "memory", "data memory", "rule")


def add_cli(subparsers: Any) -> None:
    """Register ``numa plan`` under the ``loongkit`` command (the plugin's cli hook)."""
    numa = subparsers.add_parser("numa", help="NUMA affinity tools (loongkit-numa)")
    numa.set_defaults(func=lambda _args: _usage(numa))
    sub = numa.add_subparsers(dest="numa_command", metavar="COMMAND")
    plan = sub.add_parser("plan", help="show the CPUs and memory node each local rank would be bound to",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("--sysfs-root", metavar="DIR",
                      help="read the topology under DIR instead of / (default: LOONGKIT_SYSFS_ROOT)")
    plan.add_argument("--nproc-per-node", type=int, metavar="N",
                      help="local ranks (default: LOCAL_WORLD_SIZE, else the number of GPUs)")
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(func=run_plan)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _options(hw: Hardware) -> tuple[NumaAffinityOptions, list[str], str]:
    """The options the feature would see here: environment, then the CPU-vendor policy's defaults."""
    from loongkit_numa.plugin import plugin
    from loongkit_numa.policy import FEATURE, vendor_policy

    decision = vendor_policy(hw, plugin.loongkit_declare_features()).get(FEATURE)
    options, warnings = load_settings(NumaAffinityOptions, defaults=decision.option_defaults if decision else None,
                                      environ=os.environ)
    return options, [*warnings, *options.consistency_warnings()], decision.reason if decision else ""


def run_plan(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from loongkit_numa.affinity import plan_for_node

    out = out or sys.stdout
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        print("loongkit numa plan: --nproc-per-node must be at least 1", file=sys.stderr)
        return 2
    hw = detect(args.sysfs_root)
    options, warnings, policy = _options(hw)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    nproc = args.nproc_per_node or _int(os.environ.get("LOCAL_WORLD_SIZE")) or len(hw.accelerators) or 1
    # torch's PCI addresses describe this machine, not a fake tree: only ask on the real root.
    use_torch = None if os.path.realpath(hw.root) == "/" else False
    plan = plan_for_node(hw, options, os.environ, local_world_size=nproc, use_torch=use_torch)
    if args.json:
        doc = {"hardware": hw.to_json(), "policy": policy, **plan.to_json()}
        json.dump(doc, out, indent=2)
        out.write("\n")
    else:
        out.write(render_text(hw, plan, policy))
    return 0


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


def _row(r: RankPlan) -> tuple[str, ...]:
    def cpus(value: frozenset[int] | None) -> str:
        return "unchanged" if value is None else format_cpulist(value) or "-"

    def opt(value: int | None) -> str:
        return "-" if value is None else str(value)

    return (str(r.local_rank), r.gpu or "-", opt(r.node), cpus(r.training_cpus), cpus(r.data_cpus),
            opt(r.memory_node), opt(r.data_memory_node), r.rule)


def render_text(hw: Hardware, plan: NodePlan, policy: str = "") -> str:
    vendors = ",".join(sorted(hw.gpu_vendors)) or "none"
    lines = [
        f"NUMA plan for {len(plan.ranks)} local rank(s) from {hw.root}: {hw.cpu_vendor} CPU, "
        f"{len(hw.accelerators)} GPU(s) ({vendors}), {plan.topology}",
        f"allowed CPUs: {format_cpulist(plan.allowed_cpus) or '-'}",
        "options: " + " ".join(f"{k}={int(v)}" for k, v in plan.to_json()["options"].items()),  # type: ignore[union-attr]
    ]
    if policy:
        lines.append(f"policy: {policy}")
    if plan.gpu_source:
        lines.append(f"GPUs by {plan.gpu_source}")
    rows = [COLUMNS, *(_row(r) for r in plan.ranks)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines.append("")
    lines.extend("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)
    lines.append("")
    whys = {r.why for r in plan.ranks}
    if len(whys) == 1 and len(plan.ranks) > 1:
        lines.append(f"all ranks: {next(iter(whys))}")
    else:
        lines.extend(f"rank {r.local_rank}: {r.why}" for r in plan.ranks)
    notes = [*plan.notes, *hw.notes]
    if notes:
        lines.append("notes:")
        lines.extend(f"  {n}" for n in notes)
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loongkit")
    add_cli(parser.add_subparsers(dest="command", metavar="COMMAND"))
    args = parser.parse_args(["numa", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
