"""Step time of torch.optim.AdamW / Adam: torch's default vs fused (what LOONGKIT_FUSED_ADAMW/ADAM do).

Same process, same parameters and gradients, timed alternately so both see the same machine state.
Prints ``BENCH <name> baseline=<s> ours=<s> ratio=<baseline/ours>`` per case (seconds per step).

    python benchmarks/optimizer.py            # ~25M parameters
    python benchmarks/optimizer.py --quick    # ~2M parameters, < 1 minute
"""

from __future__ import annotations

import argparse

import torch
from _timing import bench_line, median_time


def params(total: int, width: int = 1024) -> list[torch.nn.Parameter]:
    """Layer-like tensors (weight + bias) adding up to ``total`` elements, with random gradients."""
    out: list[torch.nn.Parameter] = []
    g = torch.Generator().manual_seed(0)
    while sum(p.numel() for p in out) < total:
        for shape in ((width, width), (width,)):
            p = torch.nn.Parameter(torch.randn(*shape, generator=g) * 0.02)
            p.grad = torch.randn(*shape, generator=g) * 1e-3
            out.append(p)
    return out


def step_time(opt: torch.optim.Optimizer, steps: int) -> float:
    return median_time(opt.step, steps, warmup=1)  # state allocation happens on the first step: not timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="~2M parameters, fewer steps")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    total, steps, rounds = (2_000_000, 20, 3) if args.quick else (25_000_000, 20, 3)
    cases = []
    for name in ("AdamW", "Adam"):
        cls = getattr(torch.optim, name)
        base_p, fused_p = params(total), params(total)
        # torch's default on CPU is the for-loop implementation (foreach defaults on only for CUDA).
        base = cls(base_p, lr=1e-3, weight_decay=0.01)
        fused = cls(fused_p, lr=1e-3, weight_decay=0.01, fused=True)
        assert not base.param_groups[0]["fused"], "run without LOONGKIT_FUSED_* to time torch's default"
        cases.append((name, base, fused, sum(p.numel() for p in base_p) / 1e6))
    for _, base, fused, _ in cases:  # warm-up pass over every case: the first timed loop ran ~5x slow
        step_time(base, 3)
        step_time(fused, 3)
    for name, base, fused, n in cases:
        b, f = [], []
        for _ in range(rounds):
            b.append(step_time(base, steps))
            f.append(step_time(fused, steps))
        baseline, ours = min(b), min(f)
        bench_line(f"{name.lower()}_step_{n:.0f}M_params", baseline, ours)

if __name__ == "__main__":
    main()
