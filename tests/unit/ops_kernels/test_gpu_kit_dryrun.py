"""The GPU proof kit (benchmarks/gpu/run_all.py) end to end on the CPU: ``--dry-run`` (Triton's interpreter).

No GPU has run the kit yet, so this is what keeps it from rotting before one does: every kernel case
must print its CHECK line(s) with ``ok`` (forward and backward in fp32, fp16 and bf16 vs the fp64
reference) and its BENCH line, and the run must exit 0; with ``--self-test-break`` (every reference
replaced by a wrong one) the same checks must say FAIL and the run exit 1. Both runs go concurrently,
each in its own interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
if triton.__version__.startswith("3.0."):  # as conftest.interpreter_or_skip says, for a whole module
    pytest.skip(f"triton {triton.__version__}'s interpreter rejects the kernels' tl.arange (arange's arguments "
                "must be of type tl.constexpr); interpreted checks need a newer triton", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[3]
KIT = ROOT / "benchmarks" / "gpu" / "run_all.py"
# Each kernel case: its CHECK names and its BENCH names (the baseline's label is part of the name).
CASES = {
    "msda": (["msda"], ["gpu_msda_fwd_bwd_vs_torch_ref"]),
    "msda_fused": (["msda_fused"], ["gpu_msda_fused_fwd_bwd_vs_torch_ref", "gpu_msda_fused_fwd_bwd_vs_unfused_triton"]),
    "daf": (["daf"], ["gpu_daf_fwd_bwd_vs_torch_ref"]),
    "bev_pool": (["bev_pool"], ["gpu_bev_pool_fwd_bwd_vs_torch_ref"]),
    "voxelize": (["voxelize"], ["gpu_hard_voxelize_vs_torch_ref"]),
    "dice": (["dice_stats", "dice_class_stats"],
             ["gpu_dice_stats_fwd_bwd_vs_torch_ref", "gpu_dice_class_stats_fwd_bwd_vs_torch_ref"]),
}
# The broken run needs only show that a wrong reference is caught, for float and integer kernels.
BROKEN_CASES = ("bev_pool", "voxelize")  # the cheapest float kernel and the integer one


def start(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.Popen([sys.executable, str(KIT), "--dry-run", *args], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=240)
    return proc.returncode, out


def check_lines(out: str) -> dict[str, str]:
    """{kernel: 'ok' | 'FAIL'} from the CHECK lines."""
    return {m[1]: m[2] for m in re.finditer(r"^CHECK (\S+) (ok|FAIL) ", out, re.M)}


def test_kit_dry_run_checks_and_benches_every_kernel() -> None:
    good, broken = start(), start("--self-test-break", "--cases", ",".join(BROKEN_CASES))
    (code, out), (broken_code, broken_out) = finish(good), finish(broken)

    assert code == 0, out[-4000:]
    checks = check_lines(out)
    benches = set(re.findall(r"^BENCH (\S+) baseline=\S+ ours=\S+ ratio=\S+$", out, re.M))
    for case, (names, bench_names) in CASES.items():
        for name in names:
            assert checks.get(name) == "ok", f"{case}: no 'CHECK {name} ok' line\n{out[-4000:]}"
        for bench in bench_names:
            assert bench in benches, f"{case}: no BENCH {bench} line\n{out[-4000:]}"
    # Every checked dtype is on every float kernel's line, forward and backward.
    for line in re.findall(r"^CHECK (?!voxelize).*$", out, re.M):
        for dtype in ("fp32", "fp16", "bf16"):
            assert re.search(rf"{dtype} fwd=\S+ bwd=\S+", line), line
    assert "6/6 kernel cases ok" in out, out[-2000:]

    assert broken_code == 1, broken_out[-4000:]
    broken_checks = check_lines(broken_out)
    assert broken_checks == {case: "FAIL" for case in BROKEN_CASES}, broken_out[-4000:]
    assert "0/2 kernel cases ok (failed: bev_pool, voxelize)" in broken_out, broken_out[-2000:]
