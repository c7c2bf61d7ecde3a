"""loongkit_core.kernels / kernelbuild: the one kernel loader (prebuilt, cached, built on first use),
its calling convention, the ISA dispatch and the OpenMP rule, on a small library built here."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from loongkit_core import kernelbuild, kernels
from loongkit_core.kernels import ISA_ENV, KernelLibrary, cache_root, openmp_runtimes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or kernelbuild.compiler() is None,
                                reason="needs Linux and a C++ compiler")

KERNELS = """
namespace tl::LK_ISA {
using lk::View;

void scale(const View& x, const View& out, double a) {
    LK_CHECK(x.numel() == out.numel() && x.is_contiguous() && out.is_contiguous(), "scale: shapes differ");
    LK_DISPATCH_FLOATING_TYPES(x.scalar_type(), "scale", [&] {
        const scalar_t* p = x.data_ptr<scalar_t>();
        scalar_t* o = out.data_ptr<scalar_t>();
        lk::parallel_for(0, x.numel(), 64, [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) o[i] = static_cast<scalar_t>(p[i] * a);
        });
    });
}
// (ndim, sum of sizes, sum of byte strides, writable) packed into one integer.
int64_t layout(const View& x) {
    int64_t sizes = 0, strides = 0;
    for (int64_t i = 0; i < x.dim(); ++i) {
        sizes += x.size(i);
        strides += x.byte_stride(i);
    }
    return ((x.dim() * 1000 + sizes) * 100000 + strides) * 10 + (x.writable() ? 1 : 0);
}
int64_t checksum(const std::vector<int64_t>& ints, const std::vector<double>& dbls, bool flag, int small) {
    double s = 0;
    for (double d : dbls) s += d;
    int64_t t = 0;
    for (int64_t i : ints) t = 31 * t + i;
    return t + static_cast<int64_t>(s * 1000) + (flag ? 7 : 0) + small;
}
bool positive(double x) { return x > 0; }
int64_t isa_level() { return LK_ISA_LEVEL; }
int64_t threads() { return lk::num_threads(); }
// How many OpenMP threads a parallel_for over n iterations used.
int64_t team(int64_t n) {
    std::atomic<int64_t> seen{0};
    lk::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen.fetch_add(1); });
    return seen.load();
}
}  // namespace tl::LK_ISA
"""

FUNCTIONS = """
LK_TABLE_BEGIN
LK_FUNCTION(tl::LK_ISA::scale)
LK_FUNCTION(tl::LK_ISA::layout)
LK_FUNCTION(tl::LK_ISA::checksum)
LK_FUNCTION(tl::LK_ISA::positive)
LK_FUNCTION(tl::LK_ISA::isa_level)
LK_FUNCTION(tl::LK_ISA::threads)
LK_FUNCTION(tl::LK_ISA::team)
LK_TABLE_END
"""


def write_library(directory: Path, kernels_source: str = KERNELS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "kernels.cpp").write_text(kernels_source)
    (directory / "functions.h").write_text(FUNCTIONS)
    for isa in kernels.ISAS:
        main = "#include <loongkit/kernel_main.h>\n" if isa == "baseline" else ""
        (directory / f"isa_{isa}.cpp").write_text(
            f'#define LK_ISA {isa}\n#include <loongkit/kernel_isa_begin.h>\n#include "kernels.cpp"\n'
            f'#include <loongkit/kernel_isa_end.h>\n#include "functions.h"\n{main}')
    spec = {"name": "lk_test_lib", "sources": [f"isa_{isa}.cpp" for isa in kernels.ISAS],
            "headers": ["kernels.cpp", "functions.h"],
            "cflags": ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-fopenmp"],
            "cflags_x86_64": ["-march=x86-64", "-mtune=generic"], "ldflags": []}
    (directory / "build.json").write_text(json.dumps(spec))
    return directory


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(source directory, cache) of the test library, built once for the module."""
    root = tmp_path_factory.mktemp("kernels")
    src = write_library(root / "src")
    cache = root / "cache"
    mp = pytest.MonkeyPatch()
    mp.setenv(kernels.CACHE_ENV, str(cache))
    lib = KernelLibrary(src)
    assert lib.load() is not None, lib.failure()
    assert lib.origin == "built" and lib.build_seconds is not None
    mp.undo()
    return src, cache


@pytest.fixture
def library(built: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> KernelLibrary:
    monkeypatch.setenv(kernels.CACHE_ENV, str(built[1]))
    monkeypatch.delenv(ISA_ENV, raising=False)
    return KernelLibrary(built[0])


def copy_library(built: tuple[Path, Path], dest: Path) -> Path:
    shutil.copytree(built[0], dest)
    return dest


# ------------------------------------------------------------------------------------------------
# where the binary comes from


def test_second_process_loads_from_cache(library: KernelLibrary) -> None:
    lib = library.load()
    assert lib is not None and library.origin == "cached" and library.build_seconds is None
    assert library.fallback == "no prebuilt binary (a source or editable install)"
    assert library.describe() == f"built earlier on this machine, {lib.isa}; {library.fallback}"
    assert Path(lib.__file__).parent.parent == cache_root()


def test_prebuilt_binary_needs_no_compiler(built: tuple[Path, Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    src = copy_library(built, tmp_path / "src")
    cached = KernelLibrary(built[0])
    monkeypatch.setenv(kernels.CACHE_ENV, str(built[1]))
    shutil.copy(cached.load().__file__, src / "lk_test_lib.so")  # what the wheel holds
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "empty-cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    library = KernelLibrary(src)
    lib = library.load()
    assert lib is not None, library.failure()
    assert library.origin == "prebuilt" and library.fallback is None
    assert library.describe() == f"prebuilt, {lib.isa}"
    assert Path(lib.__file__) == src / "lk_test_lib.so"
    assert not (tmp_path / "empty-cache").exists()  # nothing built, nothing cached


def test_stale_prebuilt_binary_is_rebuilt(built: tuple[Path, Path], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    src = copy_library(built, tmp_path / "src")
    monkeypatch.setenv(kernels.CACHE_ENV, str(built[1]))
    shutil.copy(KernelLibrary(built[0]).load().__file__, src / "lk_test_lib.so")
    (src / "kernels.cpp").write_text(KERNELS.replace("return x > 0;", "return x >= 0;"))  # an edited source
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "cache"))
    library = KernelLibrary(src)
    lib = library.load()
    assert lib is not None, library.failure()
    assert library.origin == "built" and (library.fallback or "").startswith("prebuilt binary is stale")
    assert lib.positive(0.0) is True  # the edited source runs, not the stale binary


def test_broken_prebuilt_binary_falls_back_to_a_build(built: tuple[Path, Path], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    src = copy_library(built, tmp_path / "src")
    (src / "lk_test_lib.so").write_bytes(b"\x7fELF not really")
    monkeypatch.setenv(kernels.CACHE_ENV, str(built[1]))
    library = KernelLibrary(src)
    assert library.load() is not None, library.failure()
    assert library.origin == "cached"
    assert (library.fallback or "").startswith("prebuilt binary did not load: ")
    assert "prebuilt binary did not load" in library.describe()


def test_no_compiler_is_a_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    library = KernelLibrary(write_library(tmp_path / "src"))
    assert library.load() is None
    assert library.failure() == "KernelError: no C++ compiler (/nonexistent/c++ not on PATH) to build the kernels"
    assert library.describe().startswith("unavailable: KernelError: no C++ compiler")


def test_build_error_is_a_reason_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "cache"))
    library = KernelLibrary(write_library(tmp_path / "src", KERNELS + "\nint broken( {\n"))
    calls: list[Any] = []
    real = kernelbuild.build
    monkeypatch.setattr(kernelbuild, "build", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert library.load() is None
    assert (library.failure() or "").startswith("BuildError: compiling isa_baseline.cpp failed: ")
    assert "error" in (library.failure() or "")
    assert library.load() is None and len(calls) == 1  # tried once per process
    assert not list((tmp_path / "cache").glob("*/lk_test_lib.so"))  # no half-built library left


def test_unwritable_cache_is_a_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(kernels.CACHE_ENV, str(blocker / "kernels"))
    library = KernelLibrary(write_library(tmp_path / "src"))
    assert library.load() is None
    assert (library.failure() or "").startswith(("NotADirectoryError", "FileExistsError", "OSError"))


def test_other_abi_is_refused(library: KernelLibrary, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernelbuild, "ABI", 99)
    assert library.load() is None
    assert library.failure() == "KernelError: speaks kernel ABI 1, this loongkit-core 99"


def test_cache_root_honours_xdg() -> None:
    assert cache_root({"XDG_CACHE_HOME": "/x"}) == Path("/x/loongkit/kernels")
    assert cache_root({kernels.CACHE_ENV: "/y", "XDG_CACHE_HOME": "/x"}) == Path("/y")


def test_build_key_tracks_sources_flags_and_compiler(tmp_path: Path) -> None:
    spec = kernelbuild.Spec.read(write_library(tmp_path / "src"))
    key = kernelbuild.build_key(spec, None)
    assert key == kernelbuild.build_key(kernelbuild.Spec.read(spec.directory), None)
    assert key != kernelbuild.build_key(spec, "/bin/sh")
    (spec.directory / "kernels.cpp").write_text(KERNELS + "\n// changed\n")
    assert kernelbuild.build_key(spec, None) != key
    assert "torch" not in json.dumps(spec.cflags)  # nothing of torch goes into the binary


# ------------------------------------------------------------------------------------------------
# the calling convention


def test_arguments_and_results(library: KernelLibrary) -> None:
    lib = library.load()
    assert lib is not None
    assert lib.functions["scale"] == ("TTd", "v") and lib.functions["positive"] == ("d", "b")
    x = torch.arange(10, dtype=torch.float64)
    out = torch.empty_like(x)
    assert lib.scale(x, out, 2.5) is None
    torch.testing.assert_close(out, x * 2.5, rtol=0, atol=0)
    assert lib.checksum([1, 2, np.int64(3)], (0.5, 1.25), True, 4) == (31 * (31 * 1 + 2) + 3) + 1750 + 7 + 4
    assert lib.positive(1.0) is True and lib.positive(-1) is False


def test_arrays_keep_their_strides(library: KernelLibrary) -> None:
    lib = library.load()
    t = torch.zeros(4, 6, dtype=torch.float32)
    assert lib.layout(t) == ((2 * 1000 + 10) * 100000 + 24 + 4) * 10 + 1
    assert lib.layout(t.t()) == ((2 * 1000 + 10) * 100000 + 4 + 24) * 10 + 1
    a = np.zeros((3, 5, 3), np.uint8)[::-1, :, ::2]  # negative and doubled byte strides
    assert lib.layout(a) == ((3 * 1000 + 3 + 5 + 2) * 100000 + (-15 + 3 + 2)) * 10 + 1
    ro = np.zeros((2, 2), np.float64)
    ro.flags.writeable = False
    assert lib.layout(ro) % 10 == 0


def test_errors_are_exceptions_not_crashes(library: KernelLibrary) -> None:
    lib = library.load()
    x = torch.zeros(3)
    with pytest.raises(RuntimeError, match="scale: shapes differ"):
        lib.scale(x, torch.zeros(4), 1.0)
    with pytest.raises(RuntimeError, match="scale: no kernel for int32"):
        lib.scale(x.int(), x.int(), 1.0)
    with pytest.raises(RuntimeError, match="expected a float32 array, got float64"):
        lib.scale(x, x.double(), 1.0)
    with pytest.raises(TypeError, match=r"scale\(\) takes 3 arguments"):
        lib.scale(x, x)
    with pytest.raises(ValueError, match="CPU tensors"):
        lib.scale(torch.zeros(3, device="meta"), x, 1.0)
    with pytest.raises(TypeError, match="complex64"):
        lib.scale(torch.zeros(3, dtype=torch.complex64), x, 1.0)
    with pytest.raises(TypeError, match=r"torch\.Tensor or numpy\.ndarray"):
        lib.scale([1.0], x, 1.0)
    with pytest.raises(RuntimeError, match="integer argument out of range"):
        lib.checksum([], [], False, 2**40)


# ------------------------------------------------------------------------------------------------
# instruction sets and threads


def test_each_isa_runs_its_own_build(library: KernelLibrary, monkeypatch: pytest.MonkeyPatch,
                                     built: tuple[Path, Path]) -> None:
    isas = library.isas()
    assert isas[-1] == "baseline" and library.load().isa == isas[0]
    for isa in isas:
        assert library.load(isa).isa_level() == kernels.ISAS.index(isa)
    with pytest.raises(ValueError, match="not usable here"):
        library.load("avx1024")
    monkeypatch.setenv(ISA_ENV, "baseline")
    forced = KernelLibrary(built[0])
    assert forced.load().isa == "baseline" and forced.load().isa_level() == 0
    monkeypatch.setenv(ISA_ENV, "sse9")
    assert KernelLibrary(built[0]).load().isa == isas[0]  # an unknown value warns and keeps the best


def test_threads_follow_torch(library: KernelLibrary) -> None:
    lib = library.load()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert lib.threads() == 2
        assert lib.team(1000) == 2
        torch.set_num_threads(1)
        assert lib.threads() == 1 and lib.team(1000) == 1
    finally:
        torch.set_num_threads(before)


def test_one_openmp_runtime_torchs(library: KernelLibrary) -> None:
    lib = library.load()
    assert lib.team(1000) >= 1
    runtimes = openmp_runtimes()
    assert len(runtimes) == 1, runtimes
    assert Path(runtimes[0]).resolve().is_relative_to(Path(torch.__file__).resolve().parent.parent)
    if shutil.which("readelf"):
        needed = subprocess.run(["readelf", "-d", lib.__file__], capture_output=True, text=True, check=True).stdout
        assert "NEEDED" in needed and not any(n in needed for n in ("libgomp", "libomp", "libiomp", "libtorch",
                                                                      "libpython", "libc10"))


@pytest.mark.skipif(shutil.which("objdump") is None or platform.machine() != "x86_64",
                    reason="needs binutils on x86-64")
def test_dispatch_is_safe_on_every_x86_64(library: KernelLibrary, tmp_path: Path) -> None:
    assert kernelbuild.isa_violations(library.load().__file__) == []
    # The check itself: an AVX2 static initialiser would run at load time on any CPU.
    bad = tmp_path / "bad.cpp"
    bad.write_text(textwrap.dedent("""
        #include <vector>
        #pragma GCC target("avx2")
        static std::vector<float> table = [] {
            std::vector<float> v(64);
            for (int i = 0; i < 64; ++i) v[i] = i * 0.5f;
            return v;
        }();
        float first() { return table[3]; }
    """))
    so = tmp_path / "bad.so"
    subprocess.run([kernelbuild.compiler(), "-O3", "-fPIC", "-shared", str(bad), "-o", str(so)], check=True)
    assert any("_GLOBAL__sub_I" in v or "table" in v for v in kernelbuild.isa_violations(so))
