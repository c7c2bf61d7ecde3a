"""loongkit_core.kernelbuild's generated layout: the entry points read from ``kernels.h``, every ``*.cpp``
compiled once per instruction set, nothing listed in ``build.json`` but the name and the flags."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from loongkit_core import kernelbuild
from loongkit_core.kernels import ISAS, KernelLibrary

HEADER = """// Entry points (a comment with a call(x) in it is not a declaration).
#pragma once
#include <loongkit/kernel.h>

namespace demo::LK_ISA {

using lk::View;

// twice(x, out): out = 2 x.
void twice(const View& x,
           const View& out);
inline int64_t helper(int64_t a) { return a; }  // defined here: not an entry point
int64_t add(int64_t a, int64_t b);
/* commented(): out */
struct Unused {
    int64_t method(int64_t a);
};
bool positive(double x);

}  // namespace demo::LK_ISA
"""

TWICE = """#include "kernels.h"
namespace demo::LK_ISA {
void twice(const View& x, const View& out) {
    LK_DISPATCH_FLOATING_TYPES(x.scalar_type(), "twice", [&] {
        const scalar_t* p = x.data_ptr<scalar_t>();
        scalar_t* o = out.data_ptr<scalar_t>();
        for (int64_t i = 0; i < x.numel(); ++i) o[i] = p[i] * 2;
    });
}
}  // namespace demo::LK_ISA
"""

ARITH = """#include "kernels.h"
namespace demo::LK_ISA {
int64_t add(int64_t a, int64_t b) { return helper(a) + b + 0 * LK_ISA_LEVEL; }
bool positive(double x) { return x > 0; }
}  // namespace demo::LK_ISA
"""


def library(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "kernels.h").write_text(HEADER)
    (directory / "twice.cpp").write_text(TWICE)
    (directory / "arith.cpp").write_text(ARITH)
    (directory / "build.json").write_text(json.dumps({"name": "demo_cpu", "cflags": ["-std=c++17", "-O2", "-fPIC"]}))
    return directory


def test_entry_points_are_the_top_level_declarations(tmp_path: Path) -> None:
    header = library(tmp_path / "lib") / "kernels.h"
    assert kernelbuild.exported_functions(header) == ("demo", ["twice", "add", "positive"])


def test_header_without_entry_points_is_refused(tmp_path: Path) -> None:
    (tmp_path / "kernels.h").write_text("#pragma once\nnamespace demo {\nvoid f();\n}\n")
    with pytest.raises(ValueError, match="no 'namespace <ns>::LK_ISA"):
        kernelbuild.exported_functions(tmp_path / "kernels.h")
    (tmp_path / "kernels.h").write_text("namespace demo::LK_ISA {\nusing lk::View;\n}\n")
    with pytest.raises(ValueError, match="declares no entry point"):
        kernelbuild.exported_functions(tmp_path / "kernels.h")


def test_spec_generates_one_unit_per_isa(tmp_path: Path) -> None:
    spec = kernelbuild.Spec.read(library(tmp_path / "lib"))
    assert spec.sources == tuple(f"isa_{isa}.cpp" for isa in ISAS) == tuple(spec.generated)
    assert spec.headers == ("arith.cpp", "twice.cpp", "kernels.h")
    for isa in ISAS:
        unit = spec.generated[f"isa_{isa}.cpp"]
        assert f"#define LK_ISA {isa}" in unit and '#include "arith.cpp"\n#include "twice.cpp"' in unit
        assert "LK_FUNCTION(demo::LK_ISA::twice)\nLK_FUNCTION(demo::LK_ISA::add)" in unit
        assert ("kernel_main.h" in unit) == (isa == "baseline")
    key = spec.source_key()
    (tmp_path / "lib" / "extra.cpp").write_text("// a new kernel\n")  # found without listing it anywhere
    assert '#include "extra.cpp"' in kernelbuild.Spec.read(tmp_path / "lib").generated["isa_avx2.cpp"]
    assert kernelbuild.Spec.read(tmp_path / "lib").source_key() != key


@pytest.mark.skipif(not sys.platform.startswith("linux") or kernelbuild.compiler() is None,
                    reason="needs Linux and a C++ compiler")
def test_generated_library_builds_and_runs_on_every_isa(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv("LOONGKIT_KERNEL_CACHE", str(tmp_path / "cache"))
    lib = KernelLibrary(library(tmp_path / "lib"))
    for isa in lib.isas():
        kernels = lib.load(isa)
        assert kernels is not None, lib.failure()
        x = torch.arange(5, dtype=torch.float64)
        out = torch.empty_like(x)
        kernels.twice(x, out)
        assert torch.equal(out, 2 * x) and kernels.add(2, 3) == 5 and kernels.positive(1.5) is True
    assert not list((tmp_path / "lib").glob("isa_*"))  # generated in the build's temporary directory
