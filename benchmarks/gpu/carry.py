"""Gather the mmcv CUDA sources of the GPU kit's baselines into ``benchmarks/gpu/carry/`` (git-ignored).

The GPU machine need not reach a package index: what its baselines are built from travels with the
working tree (copy ``benchmarks/gpu/carry/`` along with it). This script runs where the package index is
reachable, downloads mmcv 2.1.0's sdist from it with pip, checks its pinned sha256 and copies only the
files the baselines' kernels need, as data (they are mmcv's, never committed here):

- mmcv 2.1.0 (PyPI sdist ``mmcv-2.1.0.tar.gz``, sha256 pinned below): the CUDA launchers and kernels of
  MultiScaleDeformableAttention (forward, backward) and of hard / dynamic voxelization, and the
  headers they include; mmcv's LICENSE (Apache-2.0) and LICENSES.md.

Baselines come from registry packages only, or from loongkit's own reference implementation: deformable
aggregation (``loongkit::deformable_aggregation``) has no CUDA op in any registry package, so run_all.py
compares it with loongkit-ops' reference path (``daf.reference``) and nothing is gathered for it.

mmcv's own binding files (pybind.cpp / cudabind.cpp) are not carried: ``build_baselines.py`` links the
launchers with a binding of our own (``benchmarks/gpu/bindings/``). Next to the files: ``manifest.json``
(each file's origin, sha256 and size; ``build_baselines.py`` checks them before building) and
PROVENANCE.txt.

    .nox/stack2/bin/python benchmarks/gpu/carry.py [--sdist mmcv-2.1.0.tar.gz] [--out benchmarks/gpu/carry]

Without ``--sdist`` the sdist is fetched with ``pip download mmcv==2.1.0 --no-deps --no-binary :all:
--no-build-isolation``: pip prepares an sdist's metadata even to download it, and mmcv 2.1.0's setup.py
imports torch and pkg_resources, so the interpreter given by ``--pip-python`` (default: the one running
this script) needs both: torch and setuptools < 81, as in the venv ``nox -s stack2`` makes
(``.nox/stack2``).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "carry"
MANIFEST = "manifest.json"
# The carry travels with the working tree to the GPU machine: kept small.
MAX_CARRY_BYTES = 1 << 20

MMCV_VERSION = "2.1.0"
MMCV_SDIST = f"mmcv-{MMCV_VERSION}.tar.gz"
# files.pythonhosted.org's mmcv-2.1.0.tar.gz (471,435 bytes).
MMCV_SDIST_SHA256 = "d387bcab66b467479b6660310e23746cfc79c6e57acf04094680adb499a5cd3f"
_CSRC = "mmcv/ops/csrc"
# Paths inside the sdist's top folder; kept as they are under carry/mmcv/ (the include layout).
MMCV_FILES = (
    f"{_CSRC}/pytorch/cuda/ms_deform_attn_cuda.cu",
    f"{_CSRC}/pytorch/cuda/voxelization_cuda.cu",
    f"{_CSRC}/common/cuda/ms_deform_attn_cuda_kernel.cuh",
    f"{_CSRC}/common/cuda/voxelization_cuda_kernel.cuh",
    f"{_CSRC}/common/cuda/common_cuda_helper.hpp",
    f"{_CSRC}/common/pytorch_cuda_helper.hpp",
    "LICENSE",
    "LICENSES.md",
)
# Where mmcv's build looks for quoted includes (its setup.py: csrc/common and csrc/common/cuda).
MMCV_INCLUDE_DIRS = (f"{_CSRC}/common", f"{_CSRC}/common/cuda")
# Quoted includes that are referenced but not needed: only under MMCV_USE_PARROTS (the Parrots framework).
MMCV_UNNEEDED_INCLUDES = {"parrots_cuda_helper.hpp": "only under #ifdef MMCV_USE_PARROTS"}


@dataclass(frozen=True)
class Source:
    """One registry package: where its files come from and where they go under the carry folder."""

    name: str  # the folder under carry/
    repo: str
    version: str  # the release
    origin: str  # the registry's file the files were read from, with its sha256
    license: str
    files: tuple[str, ...]
    include_dirs: tuple[str, ...]
    unneeded_includes: dict[str, str]


MMCV = Source("mmcv", "open-mmlab/mmcv", MMCV_VERSION, f"PyPI sdist {MMCV_SDIST} sha256 {MMCV_SDIST_SHA256}",
              "Apache-2.0 (LICENSE; LICENSES.md names no other licence for these files)", MMCV_FILES,
              MMCV_INCLUDE_DIRS, MMCV_UNNEEDED_INCLUDES)
SOURCES = (MMCV,)

_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def unresolved_includes(files: dict[str, bytes], include_dirs: tuple[str, ...],
                        unneeded: dict[str, str]) -> list[str]:
    """'<file>: "<include>"' for each quoted include of a carried file that no carried file satisfies.

    An include resolves next to the including file first, then in ``include_dirs`` (the compiler's
    order for quoted includes); the ``unneeded`` ones (under a macro the build never sets) are allowed.
    """
    missing = []
    for path, data in files.items():
        for inc in _QUOTED_INCLUDE.findall(data.decode("utf-8", "replace")):
            here = str(Path(path).parent / inc)
            if here in files or any(f"{d}/{inc}" in files for d in include_dirs) or inc in unneeded:
                continue
            missing.append(f'{path}: "{inc}"')
    return missing


def download_sdist(pip_python: str, dest: Path) -> Path:
    """mmcv's sdist via pip (see the module docstring for why --no-build-isolation)."""
    cmd = [pip_python, "-m", "pip", "download", f"mmcv=={MMCV_VERSION}", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    path = dest / MMCV_SDIST
    if proc.returncode or not path.is_file():
        raise SystemExit(f"pip download failed ({' '.join(cmd)}):\n{(proc.stdout + proc.stderr)[-2000:]}\n"
                         "mmcv 2.1.0's setup.py needs torch and pkg_resources (setuptools < 81) in --pip-python's "
                         "environment, or pass --sdist PATH to an already downloaded mmcv-2.1.0.tar.gz")
    return path


def read_mmcv(sdist: Path) -> dict[str, bytes]:
    """MMCV.files out of the sdist (named members only: nothing else is extracted)."""
    data = sdist.read_bytes()
    if sha256(data) != MMCV_SDIST_SHA256:
        raise SystemExit(f"{sdist}: sha256 {sha256(data)} is not mmcv {MMCV_VERSION}'s sdist ({MMCV_SDIST_SHA256})")
    top = f"mmcv-{MMCV_VERSION}"
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for rel in MMCV.files:
            member = tar.extractfile(f"{top}/{rel}")
            if member is None:
                raise SystemExit(f"{sdist}: {top}/{rel} is not a file")
            out[rel] = member.read()
    return out


def provenance_text(src: Source, files: dict[str, bytes]) -> str:
    lines = [f"Upstream: {src.repo} {src.version}", f"Obtained: {src.origin}", f"License: {src.license}",
             "Carried as data for benchmarks/gpu/build_baselines.py (the GPU kit's baselines); not part of loongkit,",
             "never committed. Files (path in the upstream tree, sha256, bytes):"]
    lines += [f"  {rel}  {sha256(data)}  {len(data)}" for rel, data in files.items()]
    return "\n".join(lines) + "\n"


def write_carry(out: Path, gathered: dict[str, dict[str, bytes]]) -> dict[str, object]:
    """Replace ``out`` with the gathered files ({source name: {path: bytes}}), their PROVENANCE.txt and the
    manifest; returns the manifest."""
    by_name = {src.name: src for src in SOURCES}
    for name, files in gathered.items():
        src = by_name[name]
        missing = unresolved_includes(files, src.include_dirs, src.unneeded_includes)
        if missing:
            raise SystemExit(f"{src.name}: includes not carried: {'; '.join(missing)}")
    if out.exists():
        shutil.rmtree(out)  # a previous carry (and its build) is derived from other sources
    manifest: dict[str, object] = {"format": 1, "sources": {}}
    total = 0
    for name, files in gathered.items():
        src = by_name[name]
        entry = {"repo": src.repo, "version": src.version, "origin": src.origin, "license": src.license,
                 "include_dirs": list(src.include_dirs), "files": {}}
        for rel, data in files.items():
            path = out / src.name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            entry["files"][rel] = {"sha256": sha256(data), "bytes": len(data)}  # type: ignore[index]
            total += len(data)
        text = provenance_text(src, files).encode()
        (out / src.name / "PROVENANCE.txt").write_bytes(text)
        total += len(text)
        manifest["sources"][src.name] = entry  # type: ignore[index]
    manifest["total_bytes"] = total
    if total > MAX_CARRY_BYTES:
        raise SystemExit(f"the carry is {total} bytes, over its bound of {MAX_CARRY_BYTES}")
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def carry_bytes(out: Path) -> int:
    """Bytes of every file under the carry folder (what travels to the GPU machine), the build excluded."""
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and "build" not in p.relative_to(out).parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help=f"an already downloaded {MMCV_SDIST}")
    parser.add_argument("--pip-python", default=sys.executable,
                        help="the interpreter whose pip downloads the sdist (needs torch and setuptools < 81)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or download_sdist(args.pip_python, Path(tmp))
        gathered = {MMCV.name: read_mmcv(sdist)}
    write_carry(args.out, gathered)
    size = carry_bytes(args.out)
    for src in SOURCES:
        files = gathered[src.name]
        print(f"carried {src.name}: {src.repo} {src.version}, {len(files)} files, "
              f"{sum(len(d) for d in files.values())} bytes")
    print(f"carry folder {args.out}: {size} bytes ({size / 1024:.1f} KiB) with manifest and provenance; copy it to "
          "the GPU machine with the working tree")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
