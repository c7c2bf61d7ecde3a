"""How a loongkit kernel library is compiled: one implementation for the wheels and for build on first use.

Standard library only. A plugin's ``setup.py`` loads this file by path (``setup_kwargs``) so that
``pip wheel plugins/<plugin>`` needs nothing but setuptools and a compiler, and
:mod:`loongkit_core.kernels` calls :func:`build` when no usable binary is installed: the same
commands, the same flags, hence the same binary for the same compiler.

A library is a directory of C++ files and a ``build.json`` naming the binary and its flags::

    {"name": "loongkit_ops_cpu",                        # the binary: <directory>/<name>.so
     "cflags": ["-O3", ...], "cflags_x86_64": ["-march=x86-64", "-mtune=generic"],
     "ldflags": []}

    kernels.h      the entry points, declared in ``namespace <ns>::LK_ISA { ... }``
    <op>.cpp       kernels (every ``*.cpp``), each compiled once per instruction set
    <name>.h       shared code (every ``*.h``/``*.hpp``)

Nothing else is listed anywhere: the translation units (``isa_<isa>.cpp``: the ISA region including
every ``*.cpp``, then the function table of every entry point ``kernels.h`` declares, and for the
baseline unit the C entry points) are generated at build time (:func:`isa_unit`), so a new kernel is
its ``.cpp`` and its declarations. A ``build.json`` that lists ``"sources"`` (and ``"headers"``)
instead names hand-written translation units, which are used as they are.

Every translation unit is compiled with ``$CXX`` (else ``c++``), the spec's flags, this package's
``include/`` (``loongkit/kernel.h``) and ``-DLK_SOURCE_KEY`` (:meth:`Spec.source_key`, which the
loader compares to tell a stale binary from a current one), then linked into a plain shared object
that exports only the ``lk_*`` entry points (``include/loongkit/kernel.map``) and needs no libtorch,
no libpython and no OpenMP runtime of its own (the process's, torch's libgomp, is used).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INCLUDE_DIR = Path(__file__).resolve().with_name("include")
CORE_FILES = ("kernel.h", "kernel_isa_begin.h", "kernel_isa_end.h", "kernel_main.h", "kernel.map")
SPEC_FILE = "build.json"
ABI = 1  # LK_KERNEL_ABI in include/loongkit/kernel.h: the calling convention of lk_call


class BuildError(RuntimeError):
    """A compile or link step failed: the message is the first error line, ``output`` the whole log."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


ISAS = ("baseline", "avx2", "avx512")  # kernels.ISAS: the instruction-set builds, in level order
INTERFACE = "kernels.h"  # the header whose declarations are the library's entry points
GENERATOR = 1  # the layout of generated translation units: part of every source key
_NAMESPACE = re.compile(r"^namespace\s+([\w:]+?)::LK_ISA\s*\{", re.M)
_SKIP = ("using", "namespace", "struct", "class", "enum", "union", "template", "typedef", "static", "inline",
         "constexpr", "#", "}")
_DECLARED = re.compile(r"^[A-Za-z_][\w:<>, ]*?[\s*&]+(\w+)\s*\(")


def _code(text: str) -> str:
    """``text`` without its comments (a declaration's comment may hold parentheses)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def exported_functions(header: Path) -> tuple[str, list[str]]:
    """(namespace, entry points) of a library's ``kernels.h``: every function declared at the top level of
    its ``namespace <ns>::LK_ISA { ... }`` block, in order. Raises ValueError when there is none."""
    code = _code(header.read_text())
    found = _NAMESPACE.search(code)
    if found is None:
        raise ValueError(f"{header.name}: no 'namespace <ns>::LK_ISA {{' block declaring the entry points")
    names: list[str] = []
    depth = 0
    for line in code[found.end():].splitlines():
        if depth == 0 and not line.startswith((" ", "\t", *_SKIP)):
            match = _DECLARED.match(line)
            if match and match.group(1) not in names:
                names.append(match.group(1))
        depth += line.count("{") - line.count("}")
        if depth < 0:  # the namespace's closing brace
            break
    if not names:
        raise ValueError(f"{header.name}: declares no entry point in {found.group(1)}::LK_ISA")
    return found.group(1), names


def isa_unit(isa: str, kernels: list[str], namespace: str, functions: list[str]) -> str:
    """The generated translation unit ``isa_<isa>.cpp``: every kernel compiled for ``isa`` (see
    ``loongkit/kernel_isa_begin.h``), then the function table (baseline code: read on every CPU), then
    once per library (the baseline unit) the C entry points of ``loongkit/kernel_main.h``."""
    lines = [f"// Generated by loongkit_core.kernelbuild: every kernel compiled for {isa}.",
             f"#define LK_ISA {isa}", "#include <loongkit/kernel_isa_begin.h>",
             *(f'#include "{k}"' for k in kernels), "#include <loongkit/kernel_isa_end.h>", "", "LK_TABLE_BEGIN",
             *(f"LK_FUNCTION({namespace}::LK_ISA::{f})" for f in functions), "LK_TABLE_END"]
    if isa == ISAS[0]:
        lines.append("#include <loongkit/kernel_main.h>")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Spec:
    """A kernel library's ``build.json``, read from its source directory, with its files."""

    directory: Path
    name: str
    sources: tuple[str, ...]  # translation units
    headers: tuple[str, ...]  # every other file they include (kernels included)
    cflags: tuple[str, ...]
    arch_cflags: Mapping[str, tuple[str, ...]]
    ldflags: tuple[str, ...]
    generated: Mapping[str, str] = field(default_factory=dict)  # unit name -> text (not in the directory)

    @classmethod
    def read(cls, directory: str | Path) -> Spec:
        directory = Path(directory)
        raw: dict[str, Any] = json.loads((directory / SPEC_FILE).read_text())
        arch = {k.removeprefix("cflags_"): tuple(v) for k, v in raw.items() if k.startswith("cflags_")}
        common = {"directory": directory, "name": raw["name"], "cflags": tuple(raw.get("cflags", ())),
                  "arch_cflags": arch, "ldflags": tuple(raw.get("ldflags", ()))}
        if "sources" in raw:  # hand-written translation units
            return cls(sources=tuple(raw["sources"]), headers=tuple(raw.get("headers", ())), **common)
        kernels = sorted(p.name for p in directory.glob("*.cpp"))
        headers = sorted(p.name for p in directory.iterdir() if p.suffix in (".h", ".hpp"))
        namespace, functions = exported_functions(directory / INTERFACE)
        generated = {f"isa_{isa}.cpp": isa_unit(isa, kernels, namespace, functions) for isa in ISAS}
        return cls(sources=tuple(generated), headers=(*kernels, *headers), generated=generated, **common)

    @property
    def binary(self) -> Path:
        """Where an installed (wheel or in-place) build of the library lies."""
        return self.directory / f"{self.name}.so"

    def compile_flags(self, machine: str | None = None) -> list[str]:
        return [*self.cflags, *self.arch_cflags.get(machine or platform.machine(), ())]

    def source_key(self) -> str:
        """Hash of the library's own files (spec, sources, headers, generated units): what its binary
        was built from."""
        h = hashlib.sha256()
        for name in (SPEC_FILE, *self.sources, *self.headers):
            h.update(name.encode() + b"\0")
            text = self.generated.get(name)
            h.update(text.encode() if text is not None else (self.directory / name).read_bytes())
        if self.generated:
            h.update(f"generator={GENERATOR}".encode())
        return h.hexdigest()[:20]

    def unit_path(self, name: str, objdir: Path) -> Path:
        """Where translation unit ``name`` is compiled from: generated ones are written to ``objdir``."""
        return objdir / name if name in self.generated else self.directory / name

    def write_generated(self, objdir: Path) -> None:
        for name, text in self.generated.items():
            (objdir / name).write_text(text)


def compiler(environ: Mapping[str, str] | None = None) -> str | None:
    """The C++ compiler builds use (``$CXX`` or ``c++``), resolved; None when absent."""
    env = os.environ if environ is None else environ
    return shutil.which(env.get("CXX") or "c++")


def build_key(spec: Spec, cxx: str | None) -> str:
    """Hash of everything that makes a different binary (names its cache directory): the library's
    files, the core's headers, the flags, the machine and the compiler's identity. Not torch's or
    Python's version: the binary uses neither."""
    h = hashlib.sha256()
    h.update(f"abi={ABI} machine={platform.machine()} key={spec.source_key()}".encode())
    for name in CORE_FILES:
        h.update((INCLUDE_DIR / "loongkit" / name).read_bytes())
    h.update(repr((spec.compile_flags(), spec.ldflags)).encode())
    if cxx:
        st = os.stat(cxx)
        h.update(f"cxx={os.path.realpath(cxx)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def commands(spec: Spec, cxx: str, objdir: Path, out: Path) -> tuple[list[list[str]], list[str]]:
    """The compile commands (one per translation unit) and the link command."""
    common = [cxx, *spec.compile_flags(), f"-I{INCLUDE_DIR}", f"-I{spec.directory}",
              f'-DLK_SOURCE_KEY="{spec.source_key()}"']
    objs = [objdir / (Path(src).stem + ".o") for src in spec.sources]
    compile_cmds = [[*common, "-c", str(spec.unit_path(src, objdir)), "-o", str(obj)]
                    for src, obj in zip(spec.sources, objs, strict=True)]
    # No -fopenmp here: it would add libgomp to the binary's needs, a second OpenMP runtime beside
    # torch's; the GOMP_* symbols are resolved from the one the process has loaded.
    link = [cxx, "-shared", *map(str, objs), *spec.ldflags,
            f"-Wl,--version-script={INCLUDE_DIR / 'loongkit' / 'kernel.map'}", "-o", str(out)]
    return compile_cmds, link


def _first_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    return next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "")[:300]


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def build(spec: Spec, out: Path, cxx: str | None = None, jobs: int | None = None) -> float:
    """Compile and link ``spec`` into ``out`` (replaced atomically); returns the seconds it took.

    Translation units compile in parallel (``jobs``, default ``$MAX_JOBS`` or the CPU count).
    Raises :class:`BuildError` (no compiler, a compile or link error) or OSError.
    """
    cxx = cxx or compiler()
    if cxx is None:
        raise BuildError(f"no C++ compiler ({os.environ.get('CXX') or 'c++'} not on PATH) to build the kernels")
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{spec.name}-", dir=out.parent) as tmp:
        objdir = Path(tmp)
        tmp_out = objdir / out.name
        spec.write_generated(objdir)
        compile_cmds, link = commands(spec, cxx, objdir, tmp_out)
        workers = max(1, min(len(compile_cmds), jobs or int(os.environ.get("MAX_JOBS") or 0) or os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(_run, compile_cmds))
        for cmd, res in zip(compile_cmds, results, strict=True):
            if res.returncode != 0:
                log = f"$ {' '.join(cmd)}\n{res.stdout}{res.stderr}"
                raise BuildError(f"compiling {Path(cmd[-3]).name} failed: {_first_error(res.stderr)}", log)
        res = _run(link)
        if res.returncode != 0:
            raise BuildError(f"linking {out.name} failed: {_first_error(res.stderr)}",
                             f"$ {' '.join(link)}\n{res.stdout}{res.stderr}")
        os.replace(tmp_out, out)  # a crash never leaves a half-written library behind
    return time.perf_counter() - start


_FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")
# Instructions beyond x86-64's baseline: VEX/EVEX-encoded (v*, AVX-512 mask ops k*), wide or mask
# registers, BMI1/2, LZCNT, POPCNT.
_BEYOND_BASELINE = re.compile(r"^\s*[0-9a-f]+:\s+(v[a-z0-9]+|k[a-z]+[bwdq]|andn|bextr|blsi|blsmsk|blsr|bzhi|mulx|"
                              r"pdep|pext|rorx|sarx|shlx|shrx|tzcnt|lzcnt|popcnt)\b|%[yz]mm\d|%k[0-7]\b")
_AVX512_ONLY = re.compile(r"%zmm\d|%k[0-7]\b|^\s*[0-9a-f]+:\s+k[a-z]+[bwdq]\b")


def isa_violations(binary: str | Path, objdump: str = "objdump") -> list[str]:
    """Functions of a built x86-64 library whose instructions exceed their ISA region, as
    ``"<function>: <instruction>"`` (empty: the dispatch is safe on every x86-64 CPU).

    A function whose name contains ``::avx512::`` may use anything, one with ``::avx2::`` no
    AVX-512 (zmm, mask registers), every other function (entry points, tables, the standard
    library's instantiations, static initialisers) nothing beyond baseline x86-64. Needs binutils'
    objdump; kernels must live in ``<namespace>::LK_ISA`` for their names to say their ISA.
    """
    text = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", str(binary)], capture_output=True,
                          text=True, check=True).stdout
    found: list[str] = []
    function = ""
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            function = m.group(1)
            continue
        if not function or "\t" not in line or "::avx512::" in function:
            continue
        rule = _AVX512_ONLY if "::avx2::" in function else _BEYOND_BASELINE
        if rule.search(line) and (not found or not found[-1].startswith(function + ":")):
            found.append(f"{function}: {line.split(chr(9), 1)[-1].strip()}")
    return found


def setup_kwargs(root: str | Path, directory: str) -> dict[str, Any]:
    """``setup(**setup_kwargs(HERE, "pkg/kernels/cpu"))`` in a kernel-shipping plugin's ``setup.py``
    (``directory`` relative to the project ``root``; the binary is ``pkg.kernels.cpu.<name>``): the library as a
    setuptools extension (built by :func:`build`, not by setuptools' Python-extension compiler) and a
    ``py3-none-<platform>`` wheel tag, since the binary depends on neither Python's nor torch's ABI.

    Without a C++ compiler the wheel is built without the binary (a warning says so): the library
    then builds on first use where a compiler exists, as from a source checkout.
    """
    from setuptools import Extension
    from setuptools.command.build_ext import build_ext

    try:
        from setuptools.command.bdist_wheel import bdist_wheel
    except ImportError:  # setuptools < 70.1
        from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]

    spec = Spec.read(Path(root) / directory)
    module = f"{directory.strip('/').replace('/', '.')}.{spec.name}"

    class BuildKernels(build_ext):
        def get_ext_filename(self, fullname: str) -> str:
            return fullname.replace(".", os.sep) + ".so"  # not a Python module: no ABI tag

        def build_extension(self, ext: Extension) -> None:
            target = Path(self.get_ext_fullpath(ext.name))
            cxx = compiler()
            if cxx is None:
                self.warn(f"no C++ compiler: {spec.name} is not prebuilt (it builds on first use where one exists)")
                return
            seconds = build(spec, target.resolve(), cxx)
            self.announce(f"built {target} in {seconds:.1f} s", level=2)

    class Wheel(bdist_wheel):
        def get_tag(self) -> tuple[str, str, str]:
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    # relative: setuptools refuses absolute paths; generated units are not files of the tree
    sources = [f"{directory}/{s}" for s in (spec.headers if spec.generated else spec.sources) if s.endswith(".cpp")]
    return {"ext_modules": [Extension(module, sources=sources)], "cmdclass": {"build_ext": BuildKernels,
                                                                               "bdist_wheel": Wheel}}
