"""Build the GPU kit's mmcv baselines from the carried sources, and load them for run_all.py.

The baselines are what users run on GPUs, from registry packages only: mmcv 2.1.0's CUDA ops
(MultiScaleDeformableAttention forward and backward; hard voxelization, deterministic, and dynamic
voxelization), built from the files ``carry.py`` takes out of mmcv's PyPI sdist into
``benchmarks/gpu/carry/`` (ignored). Kernels without a registry counterpart (deformable aggregation among
them) are compared with loongkit-ops' own reference path in run_all.py; nothing is built for them. This
script compiles the carried files on the GPU machine for its own architecture only (``sm_<major><minor>``
from ``torch.cuda.get_device_capability()``, one SASS, no PTX) into ``benchmarks/gpu/carry/build/``: one
nvcc per .cu and one c++ for the binding (``benchmarks/gpu/bindings/mmcv_baseline.cpp``, our code), all
in parallel (up to ``os.cpu_count()`` jobs), then one shared library, linked against torch's libraries.
Include and library folders, the C++ standard, the C++ ABI flag and nvcc's half/bfloat16 flags are
torch.utils.cpp_extension's (``include_paths()``, ``library_paths()``, ``COMMON_NVCC_FLAGS``, torch's
``_GLIBCXX_USE_CXX11_ABI``); nvcc and c++ are called directly, so neither ninja nor setuptools is needed.

The build is time-boxed: it is skipped, with the reason printed, when the compile times measured for
these units (``ESTIMATE_S``) say it would not fit in ``--time-limit``, and any compiler still running at
the limit is stopped. A library already built from the same sources, flags and torch is reused. Every
outcome goes to ``build/status.json``; :func:`load` reads it, so a baseline that did not build, or does
not load, falls back in run_all.py to the torch reference with that reason printed; nothing here
raises into the kit.

    python benchmarks/gpu/build_baselines.py [--jobs N] [--time-limit S]
    python benchmarks/gpu/build_baselines.py --compile-only --arch 90 --jobs 1 [--cuda-include DIR]
        (object files only: a machine without a GPU or without torch's CUDA libraries)
    python benchmarks/gpu/build_baselines.py --plan --arch 90   (print the commands, run nothing)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import carry  # noqa: E402  (benchmarks/gpu/carry.py: the carried files' layout)

CARRY = carry.DEFAULT_OUT
BINDINGS = HERE / "bindings"
STATUS = "status.json"
# THC/THCAtomics.cuh left torch (it only included this header); mmcv 2.1.0 still includes it.
THC_SHIM = "#pragma once\n// Written by build_baselines.py: torch's own THCAtomics.cuh said just this.\n" \
           "#include <ATen/cuda/Atomic.cuh>\n"
# Seconds to compile each unit for sm_90, measured -j1 on a machine without GPU (2 shared AMD EPYC vCPUs,
# load ~2; torch 2.14.1+cu130 headers, nvcc 13.0; docs/benchmarks.md), rounded up: the time box's
# estimate, scaled by --estimate-scale.
ESTIMATE_S = {
    "ms_deform_attn_cuda.cu": 46.0,
    "voxelization_cuda.cu": 62.0,
    "mmcv_baseline.cpp": 19.0,
}
LINK_ESTIMATE_S = 3.0


@dataclass(frozen=True)
class Baseline:
    name: str  # the carried source's folder (carry.Source.name)
    library: str  # the TORCH_LIBRARY namespace of its binding: torch.ops.<library>
    sources: tuple[str, ...]  # carried .cu files, relative to carry/<name>/
    binding: str  # our binding, in benchmarks/gpu/bindings/
    what: str


_CUDA = "mmcv/ops/csrc/pytorch/cuda"
BASELINES = (
    Baseline("mmcv", "lk_mmcv_baseline", (f"{_CUDA}/ms_deform_attn_cuda.cu", f"{_CUDA}/voxelization_cuda.cu"),
             "mmcv_baseline.cpp", "mmcv 2.1.0 CUDA: ms_deform_attn forward/backward, hard (deterministic) and "
                                  "dynamic voxelize"),
)
SOURCE_OF = {src.name: src for src in carry.SOURCES}


@dataclass
class Toolchain:
    nvcc: str
    cxx: str
    include_dirs: list[str]  # torch's, then CUDA's
    library_dirs: list[str]  # torch's lib, then CUDA's
    cxx_std: str  # what torch's cpp_extension compiles extensions with
    abi: int  # torch's _GLIBCXX_USE_CXX11_ABI
    nvcc_flags: list[str]  # cpp_extension.COMMON_NVCC_FLAGS
    cudart: str  # the linker argument that brings libcudart
    thc_shim: bool  # torch's headers lack THC/THCAtomics.cuh


@dataclass(frozen=True)
class Step:
    baseline: str
    kind: str  # 'compile' | 'link'
    unit: str  # the source's (or the library's) file name
    argv: tuple[str, ...]
    output: str
    estimate_s: float


@dataclass
class Outcome:
    ok: bool
    reason: str = ""
    library: str = ""
    seconds: float = 0.0
    reused: bool = False
    units: dict[str, float] = field(default_factory=dict)  # unit -> compile seconds


def cuda_home() -> str | None:
    """CUDA's root as cpp_extension finds it (a CPU build of torch knows none: the same guesses again), kept
    only where include/cuda_runtime.h is (an nvcc on PATH may be a wrapper script outside the toolkit)."""
    from torch.utils import cpp_extension

    nvcc = shutil.which("nvcc")
    guesses = [cpp_extension.CUDA_HOME, os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
               str(Path(nvcc).resolve().parent.parent) if nvcc else None, "/usr/local/cuda"]
    return next((g for g in guesses if g and (Path(g) / "include" / "cuda_runtime.h").is_file()), None)


def torch_cxx_std() -> str:
    """The newest -std=c++NN that torch.utils.cpp_extension passes (c++17 up to some torch, c++20 after)."""
    from torch.utils import cpp_extension

    found = re.findall(r"-std=c\+\+(\d\d)", Path(cpp_extension.__file__).read_text())
    return f"c++{max(found, key=int)}" if found else "c++17"


def find_toolchain(extra_includes: Sequence[str] = ()) -> tuple[Toolchain | None, str]:
    """nvcc, c++ and torch's flags, or (None, why)."""
    import torch
    from torch.utils import cpp_extension

    home = cuda_home()
    in_home = Path(home or "") / "bin" / "nvcc"
    nvcc = str(in_home) if home and in_home.is_file() else shutil.which("nvcc")
    if not nvcc or not home:
        return None, "nvcc not found (no CUDA_HOME, no nvcc on PATH, no /usr/local/cuda)"
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx or not shutil.which(cxx):
        return None, f"no C++ compiler (CXX={os.environ.get('CXX')!r}, no c++/g++ on PATH)"
    includes = [*cpp_extension.include_paths(), str(Path(home) / "include")]
    # A toolkit without the math libraries' headers (ATen's CUDAContext includes cusparse.h, cublas_v2.h):
    # torch's pip wheels bring them in site-packages/nvidia/*/include.
    if not (Path(home) / "include" / "cusparse.h").is_file():
        nvidia = Path(torch.__file__).resolve().parent.parent / "nvidia"
        includes += sorted(str(p) for p in nvidia.glob("*/include") if p.is_dir())
    includes += list(extra_includes)
    lib_dirs = [*cpp_extension.library_paths(), *(str(Path(home) / d) for d in ("lib64", "lib")
                                                  if (Path(home) / d).is_dir())]
    cudart = "-lcudart"
    if not any((Path(d) / "libcudart.so").exists() for d in lib_dirs):
        # torch's cu1x wheels ship only the versioned runtime: name that file.
        nvidia = Path(torch.__file__).resolve().parent.parent / "nvidia"
        found = sorted(nvidia.glob("*/lib/libcudart.so.*"))
        cudart = str(found[-1]) if found else "-lcudart"
    thc = any((Path(d) / "THC" / "THCAtomics.cuh").is_file() for d in includes)
    return Toolchain(nvcc, cxx, includes, lib_dirs, torch_cxx_std(), int(torch._C._GLIBCXX_USE_CXX11_ABI),
                     list(getattr(cpp_extension, "COMMON_NVCC_FLAGS", [])), cudart, not thc), ""


def plan(tc: Toolchain, arch: str, carry_dir: Path, build_dir: Path,
         baselines: Sequence[Baseline] = BASELINES, link: bool = True) -> list[Step]:
    """The compile steps of every baseline (any order, in parallel), then one link step per baseline.

    arch: '90' for sm_90. One gencode, SASS only: the GPU at hand is the only target.
    """
    shim = [f"-I{build_dir / 'shim'}"] if tc.thc_shim else []
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={tc.abi}"
    steps: list[Step] = []
    links: list[Step] = []
    for b in baselines:
        root = carry_dir / b.name
        incs = [f"-I{root / d}" for d in SOURCE_OF[b.name].include_dirs] + shim + [f"-I{d}" for d in tc.include_dirs]
        objs = []
        for rel in b.sources:
            src = root / rel
            obj = build_dir / b.name / (src.stem + ".o")
            argv = (tc.nvcc, "-c", str(src), "-o", str(obj), *incs, *tc.nvcc_flags,
                    "-gencode", f"arch=compute_{arch},code=sm_{arch}", f"-std={tc.cxx_std}", "-O3",
                    "-Xcompiler", "-fPIC", abi)
            steps.append(Step(b.name, "compile", src.name, argv, str(obj), ESTIMATE_S.get(src.name, 60.0)))
            objs.append(str(obj))
        bind = BINDINGS / b.binding
        obj = build_dir / b.name / (bind.stem + ".o")
        argv = (tc.cxx, "-c", str(bind), "-o", str(obj), *incs, f"-std={tc.cxx_std}", "-O2", "-fPIC", abi)
        steps.append(Step(b.name, "compile", bind.name, argv, str(obj), ESTIMATE_S.get(bind.name, 30.0)))
        objs.append(str(obj))
        lib = build_dir / f"{b.library}.so"
        torch_lib = tc.library_dirs[0] if tc.library_dirs else ""
        argv = (tc.cxx, "-shared", "-o", str(lib), *objs, *[f"-L{d}" for d in tc.library_dirs],
                f"-Wl,-rpath,{torch_lib}", "-lc10", "-lc10_cuda", "-ltorch_cpu", "-ltorch_cuda", "-ltorch", tc.cudart)
        links.append(Step(b.name, "link", lib.name, argv, str(lib), LINK_ESTIMATE_S))
    return steps + (links if link else [])


def makespan(steps: Sequence[Step], jobs: int) -> float:
    """Estimated seconds of the compile steps on ``jobs`` workers (longest first), plus the links."""
    workers = [0.0] * max(1, jobs)
    for s in sorted((s for s in steps if s.kind == "compile"), key=lambda s: -s.estimate_s):
        workers[workers.index(min(workers))] += s.estimate_s
    return max(workers) + max((s.estimate_s for s in steps if s.kind == "link"), default=0.0)


def inputs_digest(carry_dir: Path, baseline: Baseline) -> str:
    """What a built library depends on that load() can check without a compiler: the carry's manifest
    (the carried files' sha256) and our binding's source."""
    h = hashlib.sha256()
    manifest = carry_dir / carry.MANIFEST
    h.update(manifest.read_bytes() if manifest.is_file() else b"")
    h.update((BINDINGS / baseline.binding).read_bytes())
    return h.hexdigest()


def stamp(steps: Sequence[Step], digest: str, tool_versions: str) -> str:
    import torch

    h = hashlib.sha256(digest.encode())
    for s in steps:
        h.update("\0".join(s.argv).encode())
    h.update(f"{torch.__version__}\0{tool_versions}".encode())
    return h.hexdigest()


def verify_carry(carry_dir: Path) -> str:
    """'' when the manifest lists this kit's sources only and every file it lists is there with its sha256,
    else what is wrong."""
    manifest_path = carry_dir / carry.MANIFEST
    if not manifest_path.is_file():
        return f"no carried upstream sources ({manifest_path} absent: run benchmarks/gpu/carry.py where the package " \
               "index is reachable, and copy benchmarks/gpu/carry to the GPU machine with the working tree)"
    try:
        manifest = json.loads(manifest_path.read_text())
        unknown = sorted(set(manifest["sources"]) - set(SOURCE_OF))
        if unknown:
            return f"the carry holds sources this kit does not build ({', '.join(unknown)}): rerun carry.py"
        for name, entry in manifest["sources"].items():
            for rel, meta in entry["files"].items():
                path = carry_dir / name / rel
                if not path.is_file():
                    return f"carried file missing: {path}"
                if carry.sha256(path.read_bytes()) != meta["sha256"]:
                    return f"carried file changed since carry.py wrote it: {path}"
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest {manifest_path}: {type(exc).__name__}: {exc}"
    return ""


def _tool_versions(tc: Toolchain) -> str:
    out = []
    for tool in (tc.nvcc, tc.cxx):
        try:
            out.append(subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=30).stdout)
        except (OSError, subprocess.SubprocessError) as exc:
            out.append(f"{tool}: {exc}")
    return "\n".join(out)


def _run(step: Step, deadline: float) -> tuple[Step, float, str]:
    """Run one step before the deadline: (step, seconds, '' or why it failed)."""
    start = time.perf_counter()
    left = deadline - start
    if left <= 0:
        return step, 0.0, "not started: the build's time limit was reached"
    Path(step.output).parent.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(step.argv, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        return step, time.perf_counter() - start, f"{step.unit}: stopped at the build's time limit"
    except OSError as exc:
        return step, time.perf_counter() - start, f"{step.unit}: {exc}"
    seconds = time.perf_counter() - start
    if proc.returncode:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
        return step, seconds, f"{step.unit}: exit {proc.returncode}: " + " | ".join(tail)[-1500:]
    return step, seconds, ""


def run_steps(steps: Sequence[Step], jobs: int, deadline: float) -> dict[str, Outcome]:
    """Compile everything in parallel, then link each baseline whose units all compiled."""
    outcomes: dict[str, Outcome] = {}
    for s in steps:
        outcomes.setdefault(s.baseline, Outcome(ok=True))
    compiles = [s for s in steps if s.kind == "compile"]
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(compiles) or 1))) as pool:
        for step, seconds, why in pool.map(lambda s: _run(s, deadline), compiles):
            out = outcomes[step.baseline]
            out.units[step.unit] = round(seconds, 2)
            if why and out.ok:
                out.ok, out.reason = False, why
    for step in (s for s in steps if s.kind == "link"):
        out = outcomes[step.baseline]
        if not out.ok:
            continue
        _, seconds, why = _run(step, deadline)
        out.units[step.unit] = round(seconds, 2)
        out.ok, out.reason, out.library = not why, why, step.output if not why else ""
    return outcomes


def build(carry_dir: Path | None = None, jobs: int | None = None, time_limit: float = 180.0, arch: str | None = None,
          extra_includes: Sequence[str] = (), compile_only: bool = False, estimate_scale: float = 1.0,
          log: Callable[[str], None] = print) -> dict[str, Outcome]:
    """Build every baseline (or reuse it); writes build/status.json; never raises. {name: Outcome}."""
    carry_dir = carry_dir or CARRY
    start = time.perf_counter()
    try:
        outcomes = _build(carry_dir, jobs or os.cpu_count() or 1, time_limit, arch, extra_includes, compile_only,
                          estimate_scale, log, start)
    except Exception as exc:  # the kit must go on with its torch references whatever happens here
        outcomes = {b.name: Outcome(False, f"the build raised {type(exc).__name__}: {exc}"[:500]) for b in BASELINES}
    total = time.perf_counter() - start
    for b in BASELINES:
        out = outcomes[b.name]
        if out.ok:
            what = "reused" if out.reused else ("compiled" if compile_only else "built")
            log(f"BASELINE {b.name} {what} in {out.seconds:.1f} s: {b.what}"
                f"{' -> ' + out.library if out.library else ''} (units: {out.units})")
        else:
            log(f"BASELINE {b.name} not available: {out.reason}")
    log(f"baselines build: {total:.1f} s in all")
    if not compile_only:
        _write_status(carry_dir, outcomes, total, arch)
    return outcomes


def _write_status(carry_dir: Path, outcomes: dict[str, Outcome], total: float, arch: str | None) -> None:
    import torch

    try:
        build_dir = carry_dir / "build"
        build_dir.mkdir(parents=True, exist_ok=True)
        status = {"torch": torch.__version__, "arch": arch, "seconds": round(total, 2),
                  "baselines": {b.name: {**asdict(outcomes[b.name]), "inputs": _digest_or_empty(carry_dir, b)}
                                for b in BASELINES}}
        (build_dir / STATUS).write_text(json.dumps(status, indent=1) + "\n")
    except OSError:
        pass  # load() then says the carry was not built


def _digest_or_empty(carry_dir: Path, b: Baseline) -> str:
    try:
        return inputs_digest(carry_dir, b)
    except OSError:
        return ""


def detect_arch() -> tuple[str | None, str]:
    import torch

    if not torch.cuda.is_available():
        return None, f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda})"
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}", ""


def _build(carry_dir: Path, jobs: int, time_limit: float, arch: str | None, extra_includes: Sequence[str],
           compile_only: bool, estimate_scale: float, log: Callable[[str], None], start: float) -> dict[str, Outcome]:
    def every(reason: str) -> dict[str, Outcome]:
        return {b.name: Outcome(False, reason) for b in BASELINES}

    why = verify_carry(carry_dir)
    if why:
        return every(why)
    if arch is None:
        arch, why = detect_arch()
        if arch is None:
            return every(why)
    tc, why = find_toolchain(extra_includes)
    if tc is None:
        return every(why)
    build_dir = carry_dir / "build"
    steps = plan(tc, arch, carry_dir, build_dir, link=not compile_only)
    versions = _tool_versions(tc)
    outcomes: dict[str, Outcome] = {}
    todo: list[Step] = []
    for b in BASELINES:
        mine = [s for s in steps if s.baseline == b.name]
        key = stamp(mine, inputs_digest(carry_dir, b), versions)
        lib = build_dir / f"{b.library}.so"
        stamp_file = build_dir / f"{b.library}.stamp"
        if not compile_only and lib.is_file() and stamp_file.is_file() and stamp_file.read_text() == key:
            outcomes[b.name] = Outcome(True, library=str(lib), reused=True)
        else:
            todo += mine
    if todo:
        need = makespan(todo, jobs) * estimate_scale
        if need > time_limit:
            reason = (f"skipped: the build needs ~{need:.0f} s with -j{jobs} (compile times measured for these units "
                      f"x {estimate_scale:g}), {time_limit:.0f} s allowed")
            return {**{b.name: Outcome(False, reason) for b in BASELINES}, **outcomes}
        if tc.thc_shim:
            shim = build_dir / "shim" / "THC" / "THCAtomics.cuh"
            shim.parent.mkdir(parents=True, exist_ok=True)
            shim.write_text(THC_SHIM)
        log(f"building the baselines for sm_{arch}: {len([s for s in todo if s.kind == 'compile'])} units with "
            f"-j{jobs} (estimate ~{need:.0f} s, limit {time_limit:.0f} s; {tc.nvcc}, {tc.cxx}, -std={tc.cxx_std})")
        built_start = time.perf_counter()
        built = run_steps(todo, jobs, start + time_limit)
        for name, out in built.items():
            out.seconds = round(time.perf_counter() - built_start, 2)
            outcomes[name] = out
            b = next(b for b in BASELINES if b.name == name)
            if out.ok and not compile_only:
                mine = [s for s in steps if s.baseline == name]
                (build_dir / f"{b.library}.stamp").write_text(stamp(mine, inputs_digest(carry_dir, b), versions))
    return outcomes


# --- loading (the kit's case processes) -----------------------------------------------------------------

_LOADED: dict[str, Any] = {}


def load(name: str, carry_dir: Path | None = None) -> tuple[Any | None, str]:
    """torch.ops.<library> of the baseline ``name`` once built here and loadable, else (None, why)."""
    import torch

    carry_dir = carry_dir or CARRY
    b = next((b for b in BASELINES if b.name == name), None)
    if b is None:
        return None, f"unknown baseline {name}"
    if name in _LOADED:
        return _LOADED[name], ""
    why = verify_carry(carry_dir)
    if why:
        return None, why
    status_path = carry_dir / "build" / STATUS
    try:
        status = json.loads(status_path.read_text())
        entry = status["baselines"][name]
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"the carried sources were not built ({status_path} absent: run_all.py builds them unless " \
                     "--no-build-baselines; or python benchmarks/gpu/build_baselines.py)"
    if not entry.get("ok"):
        return None, f"its build failed: {entry.get('reason', '?')}"
    if status.get("torch") != torch.__version__:
        return None, f"built for torch {status.get('torch')}, this is {torch.__version__}: rebuild"
    if entry.get("inputs") != inputs_digest(carry_dir, b):
        return None, "built from other sources (the carry or the binding changed since): rebuild"
    try:
        torch.ops.load_library(entry["library"])
        ops = getattr(torch.ops, b.library)
    except Exception as exc:
        return None, f"its library {entry.get('library')} does not load: {type(exc).__name__}: {exc}"[:400]
    _LOADED[name] = ops
    return ops, ""


def mmcv_msda() -> tuple[Callable[..., Any] | None, str]:
    """mmcv's MultiScaleDeformableAttnFunction semantics on the carried mmcv CUDA op, else (None, why)."""
    ops, why = load("mmcv")
    if ops is None:
        return None, why
    import torch
    from torch.autograd.function import once_differentiable

    class CarriedMSDA(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, value: Any, shapes: Any, starts: Any, loc: Any, attn: Any, step: int) -> Any:
            loc, attn = loc.type_as(value), attn.type_as(value)  # as mmcv's forward does
            ctx.step = step
            ctx.save_for_backward(value, shapes, starts, loc, attn)
            return ops.ms_deform_attn_forward(value, shapes, starts, loc, attn, step)

        @staticmethod
        @once_differentiable
        def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
            value, shapes, starts, loc, attn = ctx.saved_tensors
            gv, gl, ga = ops.ms_deform_attn_backward(value, shapes, starts, loc, attn, grad.contiguous(), ctx.step)
            return gv, None, None, gl, ga, None

    def run(value: Any, shapes: Any, starts: Any, loc: Any, attn: Any, im2col_step: int = 64) -> Any:
        return CarriedMSDA.apply(value, shapes, starts, loc, attn, im2col_step)

    return run, ""


def mmcv_voxelize() -> tuple[tuple[Callable[..., Any], Callable[..., Any]] | None, str]:
    """(hard, dynamic) with mmcv's voxelization() conventions on the carried mmcv CUDA op, else (None, why).

    hard(points, voxel_size, coors_range, max_points, max_voxels) -> (voxels, coors, num_points) is
    mmcv's deterministic mode; dynamic(points, voxel_size, coors_range) -> coors.
    """
    ops, why = load("mmcv")
    if ops is None:
        return None, why

    def hard(points: Any, voxel_size: Sequence[float], coors_range: Sequence[float], max_points: int,
             max_voxels: int) -> tuple[Any, Any, Any]:
        return tuple(ops.hard_voxelize(points, list(map(float, voxel_size)), list(map(float, coors_range)),
                                       max_points, max_voxels))

    def dynamic(points: Any, voxel_size: Sequence[float], coors_range: Sequence[float]) -> Any:
        return ops.dynamic_voxelize(points, list(map(float, voxel_size)), list(map(float, coors_range)))

    return (hard, dynamic), ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--carry", type=Path, default=CARRY, help="the carry folder (carry.py's --out)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--time-limit", type=float, default=180.0, help="seconds the build may take")
    parser.add_argument("--estimate-scale", type=float, default=1.0,
                        help="multiply the measured compile times by this for the time box's estimate")
    parser.add_argument("--arch", help="e.g. 90 for sm_90 (default: the CUDA device's capability)")
    parser.add_argument("--cuda-include", action="append", default=[], help="one more include folder for CUDA")
    parser.add_argument("--compile-only", action="store_true", help="object files only, no link, no status")
    parser.add_argument("--plan", action="store_true", help="print the commands and exit")
    args = parser.parse_args(argv)
    if args.plan:
        tc, why = find_toolchain(args.cuda_include)
        arch = args.arch or detect_arch()[0]
        if tc is None or arch is None:
            print(f"no plan: {why or 'no --arch and no CUDA device'}")
            return 1
        for step in plan(tc, arch, args.carry, args.carry / "build", link=not args.compile_only):
            print(f"[{step.baseline} {step.kind} {step.unit} ~{step.estimate_s:g} s] {' '.join(step.argv)}")
        return 0
    outcomes = build(args.carry, args.jobs, args.time_limit, args.arch, args.cuda_include, args.compile_only,
                     args.estimate_scale)
    return 0 if all(o.ok for o in outcomes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
