"""Build a wheel of mmcv / mmcv-full with its CPU (optionally CUDA) ops from the registry's sdist.

Used by the noxfile's stack sessions and README command 1 (the baselines loongkit is compared against):

    python tools/mmcv_wheel.py mmcv==2.1.0 --out ~/.cache/loongkit-wheels
    python tools/mmcv_wheel.py mmcv-full==1.7.2 --out ~/.cache/loongkit-wheels --cxx-std c++20

What differs from a plain ``pip wheel mmcv==2.1.0``, and why:

- ``-g0`` after the interpreter's own CFLAGS (``-O3`` and the rest kept: the baseline ops keep their
  optimisation level). Debug information is about half of the build's compile time (one source,
  ``nms_rotated.cpp``, took 249-275 s with ``-g -O3`` and 74-142 s with ``-g0 -O3`` on a 2-core AVX2 machine)
  and nobody debugs mmcv's ops from this wheel. setuptools replaces its CFLAGS wholesale when the variable
  is set, so the interpreter's flags are repeated here and only ``-g0`` is added.
- One compile job per CPU this process may use (``MAX_JOBS``; ninja makes it effective).
- Progress: the build prints a line such as ``mmcv 2.1.0 ops: 23/77 files, 3.1 min so far, ~6.9 min left``
  every 20 s (ninja's ``[N/M]`` counter) instead of pip's silent ``still running...``; the full log is kept
  beside the wheel cache and its tail shown on failure.
- The wheel lands in ``--out`` only once complete (renamed from a temporary name), so an interrupted build
  never looks cached.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

NINJA_STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]\s")
REPORT_EVERY_S = 20.0


def usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def build_env(cuda: bool) -> dict[str, str]:
    cflags = (sysconfig.get_config_var("CFLAGS") or "").split()
    env = dict(os.environ)
    env.update({"MMCV_WITH_OPS": "1", "FORCE_CUDA": "1" if cuda else "0", "MAX_JOBS": str(usable_cpus()),
                "CFLAGS": " ".join([*cflags, "-g0"])})
    return env


def fetch_sdist(requirement: str, into: Path) -> Path:
    """Download the sdist of ``requirement`` from the configured index and unpack it; returns its folder."""
    print(f"downloading the {requirement} sdist", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    "--no-build-isolation", requirement, "-d", str(into)], check=True)
    archive = next(into.glob("*.tar.gz"))
    with tarfile.open(archive) as tar:
        try:
            tar.extractall(into, filter="data")
        except TypeError:  # Pythons before the extraction filters (3.10.11 and older)
            tar.extractall(into)
    return next(p for p in into.iterdir() if p.is_dir())


class Progress:
    """Turns ninja's ``[N/M]`` lines into a periodic progress line with an estimate of the time left."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.start = time.monotonic()
        self.last_report = self.start
        self.done = 0
        self.total = 0

    def feed(self, line: str) -> None:
        match = NINJA_STEP.match(line)
        if match:
            self.done, self.total = int(match.group(1)), int(match.group(2))
        now = time.monotonic()
        if now - self.last_report >= REPORT_EVERY_S:
            self.last_report = now
            print(self.line(now), flush=True)

    def line(self, now: float) -> str:
        elapsed = (now - self.start) / 60
        if not self.total:
            return f"{self.label}: preparing the build, {elapsed:.1f} min so far"
        if self.done < max(5, self.total // 10):  # the first files include the precompiled header's build
            return f"{self.label}: {self.done}/{self.total} files, {elapsed:.1f} min so far"
        left = elapsed / max(self.done, 1) * (self.total - self.done)
        return (f"{self.label}: {self.done}/{self.total} files, {elapsed:.1f} min so far, "
                f"~{left:.1f} min left")


def precompiled_header_env(source: Path, scratch: Path) -> dict[str, str]:
    """``CXX`` set to tools/pch_cxx.py, which precompiles mmcv's common torch header with the build's flags."""
    header = source / "mmcv" / "ops" / "csrc" / "common" / "pytorch_cpp_helper.hpp"
    if not header.exists():
        return {}
    wrapper = scratch / "bin" / "c++"  # named like a compiler: torch checks the name before it runs ``-v``
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).with_name("pch_cxx.py")}" "$@"\n')
    wrapper.chmod(0o755)
    return {"CXX": str(wrapper), "LK_PCH_CXX": os.environ.get("CXX", "c++"), "LK_PCH_HEADER": str(header),
            "LK_PCH_DIR": str(scratch / "pch")}


def build(source: Path, out: Path, label: str, cuda: bool, log_path: Path, scratch: Path) -> Path:
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=out))
    env = build_env(cuda)
    env.update(precompiled_header_env(source, scratch))
    pch = "a precompiled torch header" if "LK_PCH_HEADER" in env else "no precompiled header"
    print(f"{label}: compiling its C++ ops with {env['MAX_JOBS']} jobs, {pch}, CFLAGS {env['CFLAGS']!r} "
          f"(full log: {log_path})", flush=True)
    progress = Progress(label)
    command = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", str(source),
               "-w", str(staging)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            progress.feed(line)
        code = proc.wait()
    if code != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-60:]
        print("\n".join(tail), file=sys.stderr)
        shutil.rmtree(staging, ignore_errors=True)
        raise SystemExit(f"{label}: the build failed (exit {code}); full log: {log_path}")
    unused = log_path.read_text(errors="replace").count("[-Winvalid-pch]")
    if unused:
        print(f"{label}: the precompiled header was not usable {unused} times (-Winvalid-pch in the log)", flush=True)
    wheel = next(staging.glob("*.whl"))
    final = out / wheel.name
    os.replace(wheel, final)
    shutil.rmtree(staging, ignore_errors=True)
    print(f"{label}: built in {(time.monotonic() - progress.start) / 60:.1f} min -> {final}", flush=True)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("requirement", help="e.g. mmcv==2.1.0 or mmcv-full==1.7.2")
    parser.add_argument("--out", required=True, type=Path, help="the wheel cache (created if missing)")
    parser.add_argument("--cuda", action="store_true", help="CUDA ops too (needs nvcc)")
    parser.add_argument("--cxx-std", help="replace setup.py's -std=c++17 (torch >= 2.14 headers need c++20)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    name, _, version = args.requirement.partition("==")
    label = f"{name} {version} ops"
    with tempfile.TemporaryDirectory(prefix="mmcv-src-") as tmp:
        source = fetch_sdist(args.requirement, Path(tmp))
        if args.cxx_std:
            setup = source / "setup.py"
            setup.write_text(setup.read_text().replace("-std=c++17", f"-std={args.cxx_std}"))
        build(source, args.out, label, args.cuda, args.out / f"{name}-{version}.build.log", Path(tmp) / "scratch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
