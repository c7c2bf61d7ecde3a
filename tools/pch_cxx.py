"""A C++ compiler wrapper that precompiles one header, with the build's own flags, for every translation unit.

tools/mmcv_wheel.py puts it in front of ``c++`` (as ``CXX``) when it builds mmcv's ops: 63 of mmcv 2.1.0's 77
sources start with ``#include "pytorch_cpp_helper.hpp"`` (torch/extension.h), and parsing that header is most
of each file's compile (nms.cpp: 13.8 s without, 2.8 s with the precompiled header, identical object code).

How: the first compile of the build precompiles the header (``LK_PCH_HEADER``) with that compile's flags
into ``LK_PCH_DIR`` under a lock (the other jobs wait), and every compile gets ``-I LK_PCH_DIR`` first in
its include path, where GCC looks for ``<header>.gch`` before the header itself. GCC checks that a
precompiled header was made with compatible options and otherwise ignores it and parses the header
(``-Winvalid-pch`` says so in the log), so the wrapper can make a build faster but never different.
Every other invocation (links, ``-v``, version probes) passes through untouched.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

SOURCE_SUFFIXES = (".cpp", ".cc", ".cxx", ".c")


def compile_parts(args: list[str]) -> tuple[list[str], str] | None:
    """The flags of a single-source compile (no source, output or dependency options) and its source."""
    if "-c" not in args:
        return None
    flags: list[str] = []
    source = None
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
        elif arg in ("-c", "-MMD", "-MD"):
            pass
        elif arg.endswith(SOURCE_SUFFIXES) and not arg.startswith("-") and args[i - 1] not in ("-include",):
            source = arg
        else:
            flags.append(arg)
    return (flags, source) if source else None


def ensure_pch(compiler: str, flags: list[str], header: Path, pch_dir: Path) -> bool:
    """Precompile ``header`` once (under a lock); False when that failed (the build goes on without)."""
    pch_dir.mkdir(parents=True, exist_ok=True)
    target = pch_dir / (header.name + ".gch")
    failed = pch_dir / "failed"
    with open(pch_dir / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists() and not failed.exists():
            partial = pch_dir / (header.name + ".gch.partial")
            result = subprocess.run([compiler, *flags, "-x", "c++-header", str(header), "-o", str(partial)],
                                    capture_output=True, text=True)
            if result.returncode == 0:
                os.replace(partial, target)
            else:
                failed.write_text(result.stderr)
                sys.stderr.write(f"pch_cxx: precompiling {header} failed, compiling without it\n")
    return target.exists()


def main(argv: list[str]) -> int:
    compiler = os.environ.get("LK_PCH_CXX", "c++")
    header = os.environ.get("LK_PCH_HEADER")
    pch_dir = os.environ.get("LK_PCH_DIR")
    parts = compile_parts(argv)
    if parts and header and pch_dir and ensure_pch(compiler, parts[0], Path(header), Path(pch_dir)):
        argv = ["-Winvalid-pch", "-I", pch_dir, *argv]
    return subprocess.call([compiler, *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
