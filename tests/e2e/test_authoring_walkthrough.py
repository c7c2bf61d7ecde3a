"""docs/plugin-authoring.md, section 0, followed in a temporary plugin: the files each list names are the files
a new patch feature and a new C++ + Triton op feature take, no more, no fewer, and the lists' counts say so.

The temporary plugin ``walkplug`` (entry-point name ``walk``) is an existing kernel-shipping plugin laid
out as loongkit-ops is: ``plugin.py``, ``patches/``, ``kernels/{cpu,ops,triton}/`` with one kernel
already there. The walk-through writes the listed files (a feature switching an upstream function to a
fused op; the op with its C++ kernel, Triton twin, reference and tests), compares what changed with the
page, and runs the tests it wrote: the C++ kernel is built by ``loongkit_core.kernelbuild`` from the
directory alone, the Triton kernel runs under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loongkit_core import kernelbuild

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "plugin-authoring.md"
NAMES = {"<pkg>": "walkplug", "<plugin>": "walk", "<op>": "scaled_sum"}

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or kernelbuild.compiler() is None,
                                reason="needs Linux and a C++ compiler")

# -- the existing plugin ----------------------------------------------------------------------------
SKELETON = {
    "walk_target.py": '''
        """The upstream library the feature accelerates."""
        def scaled_sum(x, w):
            return (x * w).sum(-1)
        ''',
    "walkplug/__init__.py": "",
    "walkplug/plugin.py": '''
        from loongkit_core.feature import Category
        from loongkit_core.kit import PluginSpec

        plugin = PluginSpec("walk", distribution="walkplug", category=Category.OPS)
        ''',
    "walkplug/patches/__init__.py": "",
    "walkplug/kernels/__init__.py": '''
        from pathlib import Path

        from loongkit_core.kernels import KernelLibrary

        LIBRARY = KernelLibrary(Path(__file__).with_name("cpu"), logger="walk.kernels")
        ''',
    "walkplug/kernels/ops/__init__.py": "",
    "walkplug/kernels/triton/__init__.py": "",
    "walkplug/kernels/cpu/build.json": '{"name": "walkplug_cpu", "cflags": ["-std=c++17", "-O2", "-fPIC"]}',
    "walkplug/kernels/cpu/kernels.h": '''
        #pragma once
        #include <loongkit/kernel.h>

        namespace walkplug::LK_ISA {

        using lk::View;

        // The library's interface version.
        int64_t version();

        }  // namespace walkplug::LK_ISA
        ''',
    "walkplug/kernels/cpu/version.cpp": '''
        #include "kernels.h"
        namespace walkplug::LK_ISA {
        int64_t version() { return 1; }
        }  // namespace walkplug::LK_ISA
        ''',
}

# -- a plain patch feature ---------------------------------------------------------------------------
DECLARE_FLAG = '''
    plugin.feature("walk_flag", level=1, description="Counts the upstream calls.", targets=("walk_target",),
                   impl="walkplug.walk_flag:WalkFlag")
    '''

PATCH_FEATURE = {
    "<pkg>/<feature>.py": '''
        from loongkit_core.context import ActivationContext, NotApplicable
        from loongkit_core.kit import FeatureImpl


        class WalkFlag(FeatureImpl):
            def activate(self, ctx: ActivationContext, target: str | None) -> None:
                import walk_target

                if not callable(getattr(walk_target, "scaled_sum", None)):
                    raise NotApplicable("walk_target.scaled_sum missing")
                ctx.patcher.patch(walk_target, "scaled_sum", ctx.counted(walk_target.scaled_sum))
        ''',
    "tests/unit/<plugin>/test_<feature>.py": '''
        import torch
        import walk_target
        from loongkit_core.context import ActivationContext
        from walkplug.plugin import plugin
        from walkplug.walk_flag import WalkFlag


        def test_applies_and_undoes():
            feature = plugin.feature("walk_flag")
            ctx = ActivationContext.standalone(feature)
            impl = WalkFlag(feature)
            original = walk_target.scaled_sum
            impl.activate(ctx, "walk_target")
            walk_target.scaled_sum(torch.ones(2, 3), torch.ones(3))
            assert ctx.record.calls == 1
            impl.deactivate(ctx)
            assert walk_target.scaled_sum is original
        ''',
}

# -- a feature with a new C++ + Triton op --------------------------------------------------------------
DECLARE_FUSED = '''
    plugin.feature("walk_fused", level=1, description="Fused scaled row sums.", requires=("torch>=2.4.0",),
                   targets=("walk_target",), impl="walkplug.patches.walk_fused:WalkFused")
    '''

OP_FEATURE = {
    "<pkg>/patches/<feature>.py": '''
        from loongkit_core.context import ActivationContext
        from loongkit_core.kit import FeatureImpl


        class WalkFused(FeatureImpl):
            def activate(self, ctx: ActivationContext, target: str | None) -> None:
                import torch
                import walk_target

                from walkplug.kernels.ops import scaled_sum

                upstream = walk_target.scaled_sum

                def fused(x, w):
                    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float64):
                        ctx.fallback("input the op does not take")
                        return upstream(x, w)
                    ctx.count()
                    return scaled_sum.op(x, w)

                ctx.patcher.patch(walk_target, "scaled_sum", fused)
        ''',
    "<pkg>/kernels/ops/<op>.py": '''
        """walk::scaled_sum(x [N, K], w [K]) -> [N]: sum over k of x * w, with its fake impl and autograd."""
        import torch

        from walkplug.kernels import LIBRARY


        def reference(x, w):
            return (x * w).sum(-1)


        def backend(x):
            if x.is_cuda:
                return "triton", ""
            return ("cpu", "") if LIBRARY.load() is not None else ("reference", LIBRARY.failure() or "")


        @torch.library.custom_op("walk::scaled_sum", mutates_args=())
        def op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            x, w = x.contiguous(), w.contiguous()
            out = x.new_empty(x.shape[0])
            chosen = backend(x)[0]
            if chosen == "cpu":
                LIBRARY.load().scaled_sum_forward(x, w, out)
            elif chosen == "triton":
                from walkplug.kernels.triton.scaled_sum import scaled_sum

                scaled_sum(x, w, out)
            else:
                out.copy_(reference(x, w))
            return out


        @op.register_fake
        def _(x, w):
            return x.new_empty(x.shape[0])


        def _setup(ctx, inputs, output):
            ctx.save_for_backward(*inputs)


        def _backward(ctx, grad):
            x, w = ctx.saved_tensors
            return grad[:, None] * w, (grad[:, None] * x).sum(0)


        op.register_autograd(_backward, setup_context=_setup)
        ''',
    "<pkg>/kernels/cpu/<op>.cpp": '''
        #include "kernels.h"
        namespace walkplug::LK_ISA {
        void scaled_sum_forward(const View& x, const View& w, const View& out) {
            LK_CHECK(x.dim() == 2 && w.numel() == x.size(1) && out.numel() == x.size(0), "scaled_sum: shapes");
            LK_DISPATCH_FLOATING_TYPES(x.scalar_type(), "scaled_sum", [&] {
                const scalar_t* px = x.data_ptr<scalar_t>();
                const scalar_t* pw = w.data_ptr<scalar_t>();
                scalar_t* po = out.data_ptr<scalar_t>();
                const int64_t K = x.size(1);
                lk::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
                    for (int64_t n = b; n < e; ++n) {
                        scalar_t acc = 0;
                        for (int64_t k = 0; k < K; ++k) acc += px[n * K + k] * pw[k];
                        po[n] = acc;
                    }
                });
            });
        }
        }  // namespace walkplug::LK_ISA
        ''',
    "<pkg>/kernels/triton/<op>.py": '''
        import triton
        import triton.language as tl


        @triton.jit
        def _row(x, w, out, K, BLOCK: tl.constexpr):
            n = tl.program_id(0)
            k = tl.arange(0, BLOCK)
            m = k < K
            acc = tl.sum(tl.load(x + n * K + k, mask=m, other=0.0) * tl.load(w + k, mask=m, other=0.0), axis=0)
            tl.store(out + n, acc)


        def scaled_sum(x, w, out):
            _row[(x.shape[0],)](x, w, out, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]))
        ''',
    "tests/unit/<plugin>_kernels/test_<op>.py": '''
        import os

        import pytest
        import torch

        from walkplug.kernels import LIBRARY
        from walkplug.kernels.ops import scaled_sum


        @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
        def test_cpp_kernel_equals_reference(dtype):
            x, w = torch.randn(33, 7, dtype=dtype), torch.randn(7, dtype=dtype)
            assert scaled_sum.backend(x)[0] == "cpu", LIBRARY.failure()
            torch.testing.assert_close(scaled_sum.op(x, w), scaled_sum.reference(x.double(), w.double()).to(dtype))


        def test_gradients():
            x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
            w = torch.randn(4, dtype=torch.float64, requires_grad=True)
            assert torch.autograd.gradcheck(scaled_sum.op, (x, w))


        def test_triton_kernel_equals_reference():
            pytest.importorskip("triton")
            assert os.environ.get("TRITON_INTERPRET") == "1"
            from walkplug.kernels.triton.scaled_sum import scaled_sum as triton_scaled_sum

            x, w = torch.randn(9, 5), torch.randn(5)
            out = torch.empty(9)
            triton_scaled_sum(x, w, out)
            torch.testing.assert_close(out, scaled_sum.reference(x, w))
        ''',
    "tests/unit/<plugin>/test_<feature>.py": '''
        import torch
        import walk_target
        from loongkit_core.context import ActivationContext
        from walkplug.patches.walk_fused import WalkFused
        from walkplug.plugin import plugin


        def test_applies_falls_back_and_undoes():
            feature = plugin.feature("walk_fused")
            ctx = ActivationContext.standalone(feature)
            impl = WalkFused(feature)
            original = walk_target.scaled_sum
            impl.activate(ctx, "walk_target")
            x, w = torch.randn(4, 3), torch.randn(3)
            torch.testing.assert_close(walk_target.scaled_sum(x, w), original(x, w))
            assert ctx.record.calls == 1
            walk_target.scaled_sum(x.half(), w.half())  # an input the op does not take: upstream
            assert ctx.record.calls == 1
            impl.deactivate(ctx)
            assert walk_target.scaled_sum is original
        ''',
}


def listed(section: str) -> tuple[int, list[str]]:
    """(the count in the list's heading, the files it lists) for the heading starting with ``section``."""
    text = PAGE.read_text()
    found = re.search(re.escape(section) + r"[^*]*?: (\d+) files\b[^\n]*\n(.*?)(?:\n\n\*\*|\n## )", text, re.S)
    assert found, f"docs/plugin-authoring.md has no list headed {section!r} with a count"
    files = re.findall(r"^\d+\. `([^`]+)`", found.group(2), re.M)
    return int(found.group(1)), files


def substitute(path: str, feature: str = "") -> str:
    for key, value in {**NAMES, "<feature>": feature}.items():
        path = path.replace(key, value)
    return path


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {p for p in after if before.get(p) != after[p]} | (before.keys() - after.keys())


def write(root: Path, files: dict[str, str], feature: str = "") -> None:
    for path, text in files.items():
        target = root / substitute(path, feature)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(textwrap.dedent(text).lstrip())


def declare(root: Path, declaration: str) -> None:
    plugin = root / "walkplug" / "plugin.py"
    plugin.write_text(plugin.read_text() + textwrap.dedent(declaration))


def test_the_page_lists_what_a_new_feature_and_a_new_op_take(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    write(root, SKELETON)

    count, files = listed("**A plain patch feature")
    assert count == len(files)
    before = snapshot(root)
    declare(root, DECLARE_FLAG)
    write(root, PATCH_FEATURE, "walk_flag")
    assert changed(before, snapshot(root)) == {substitute(f, "walk_flag") for f in files}

    count, files = listed("**A feature with a new C++ and Triton op")
    assert count == len(files)
    before = snapshot(root)
    declare(root, DECLARE_FUSED)
    header = root / "walkplug" / "kernels" / "cpu" / "kernels.h"
    header.write_text(header.read_text().replace(
        "\n}  // namespace", "\n// out [N] = sum over k of x[n, k] * w[k].\n"
        "void scaled_sum_forward(const View& x, const View& w, const View& out);\n\n}  // namespace"))
    write(root, OP_FEATURE, "walk_fused")
    assert changed(before, snapshot(root)) == {substitute(f, "walk_fused") for f in files}

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "TRITON_INTERPRET": "1", "LOONGKIT_KERNEL_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(root),
                          str(root / "tests")], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert re.search(r"\b6 passed\b", run.stdout), run.stdout[-2000:]  # 1 + 4 + 1 tests, none skipped
