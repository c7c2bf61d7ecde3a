"""LOONGKIT_DONATED_BUFFER_FIX and LOONGKIT_DYNAMIC_SHAPE_FIX on torch 2.13: "not applicable" as
installed, and the applicable branch against torch's real config objects with the gate faked."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from loongkit_ops import fixes
from loongkit_ops.plugin import plugin

from loongkit_core import requirements
from loongkit_core.feature import State
from loongkit_core.runtime import Runtime
from loongkit_core.testing import outside_declaration


@pytest.fixture
def runtime(loongkit_runtime: Callable[..., Runtime]) -> Callable[..., Runtime]:
    return loongkit_runtime


def fake_torch(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    real = requirements.installed

    def fake(module: str) -> Any:
        return requirements.Installed("torch", "torch", version) if module == "torch" else real(module)

    monkeypatch.setattr(requirements, "installed", fake)


def needs_flag(module: Any, flag: str) -> None:
    """Skip where the installed torch's config has no ``flag`` for the fix to switch: a torch older
    than the fix's declaration (torch>=2.6.0 / ==2.9.*), where the feature is not applicable."""
    if not hasattr(module, flag):
        pytest.skip(f"torch {requirements.installed('torch').version} has no {module.__name__}.{flag}")


# -- DONATED_BUFFER_FIX ----------------------------------------------------------------------------
DDP = {"LOONGKIT_DONATED_BUFFER_FIX": "1"}


def test_donated_not_applicable_on_installed_torch(runtime: Callable[..., Runtime]) -> None:
    if outside_declaration(plugin.feature("donated_buffer_fix"), "torch") is None:  # torch 2.6-2.8
        pytest.skip(f"torch {requirements.installed('torch').version} is the fix's own torch: the applicable branch "
                    "is tested below and by the compat-torch2.8 row")
    record = runtime(DDP).records["donated_buffer_fix"]
    assert record.state == State.NOT_APPLICABLE
    assert record.reason == f"torch {requirements.installed('torch').version} outside <2.9,>=2.6.0"


def test_donated_detects_the_upstream_fix_not_the_version(runtime: Callable[..., Runtime],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if not fixes.has_ddp_fix(fixes.torch_source("_dynamo/backends/distributed.py")):
        pytest.skip(f"torch {requirements.installed('torch').version}'s source has no upstream DDP fix to detect")
    fake_torch(monkeypatch, "2.8.0")  # the version says affected; the code says fixed
    record = runtime(DDP).records["donated_buffer_fix"]
    assert record.state == State.NOT_APPLICABLE
    assert record.reason == "torch 2.8.0 has the upstream fix (DDPOptimizerContext, pytorch#160745)"


@pytest.fixture
def single_rank_gloo(tmp_path: Path) -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_donated_applicable_branch_with_real_ddp_optimizer(request: pytest.FixtureRequest,
                                                          runtime: Callable[..., Runtime],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          single_rank_gloo: None) -> None:
    """A real DDP model compiled by dynamo goes through DDPOptimizer.compile_fn; AOTAutograd must
    see donated_buffer off for every split graph, and a compile without DDP must not change it."""
    import torch._functorch.config as fconfig
    from torch._dynamo.backends.common import aot_autograd
    from torch.nn.parallel import DistributedDataParallel

    needs_flag(fconfig, "donated_buffer")
    fake_torch(monkeypatch, "2.8.0")
    monkeypatch.setattr(fixes, "DDP_FIX_MARKERS", ("NoSuchMarker",))  # this torch has the fix: hide it
    stack = contextlib.ExitStack()
    stack.enter_context(fconfig.patch(donated_buffer=True))  # pytest's monkeypatch cannot undo config modules
    request.addfinalizer(stack.close)
    rt = runtime(DDP)
    record = rt.records["donated_buffer_fix"]
    assert record.state == State.ARMED
    rt.activate(record, fixes.DDP_MODULE)
    assert record.state == State.APPLIED, record.reason

    seen: list[bool] = []

    def fw_compiler(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        seen.append(fconfig.donated_buffer)
        return gm.forward

    backend = aot_autograd(fw_compiler=fw_compiler)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    torch.compile(plain, backend=backend)(torch.randn(4, 8)).sum().backward()
    assert seen and all(seen) and record.calls == 0  # no DDP: donated buffers untouched

    torch._dynamo.reset()
    seen.clear()
    # DDP around the compiled module: DDP.forward runs eagerly and marks itself the active DDP module,
    # so dynamo hands the inner frame to DDPOptimizer (torch 2.13 traces compile(DDP(m)) differently).
    ddp = DistributedDataParallel(torch.compile(plain, backend=backend))
    x = torch.randn(4, 8)
    out = ddp(x)
    out.sum().backward()
    assert record.calls >= 1
    assert seen and not any(seen)
    assert record.config == {"donated_buffer_before": True, "switched_off": True}
    torch.testing.assert_close(out, plain(x))
    rt.deactivate("donated_buffer_fix")
    assert fconfig.donated_buffer is True


def test_donated_broken_target(runtime: Callable[..., Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo.backends.distributed as dist_backend

    fake_torch(monkeypatch, "2.7.1")
    monkeypatch.setattr(fixes, "DDP_FIX_MARKERS", ("NoSuchMarker",))
    monkeypatch.delattr(dist_backend, "DDPOptimizer")
    rt = runtime(DDP)
    record = rt.records["donated_buffer_fix"]
    rt.activate(record, fixes.DDP_MODULE)
    assert record.state == State.NOT_APPLICABLE
    assert record.reason == "torch._dynamo.backends.distributed has no DDPOptimizer.compile_fn"


# -- DYNAMIC_SHAPE_FIX ------------------------------------------------------------------------------
DYN = {"LOONGKIT_DYNAMIC_SHAPE_FIX": "1"}


def test_dynamic_not_applicable_on_installed_torch(runtime: Callable[..., Runtime]) -> None:
    if outside_declaration(plugin.feature("dynamic_shape_fix"), "torch") is None:  # torch 2.9.*
        pytest.skip(f"torch {requirements.installed('torch').version} is the fix's own torch (==2.9.*): applicable "
                    "there")
    record = runtime(DYN).records["dynamic_shape_fix"]
    assert record.state == State.NOT_APPLICABLE
    assert record.reason == f"torch {requirements.installed('torch').version} outside ==2.9.*"


def patch_config(request: pytest.FixtureRequest, module: Any, **values: Any) -> None:
    """torch's own config.patch, closed after the test's other fixtures (pytest's monkeypatch cannot
    restore attributes of torch config modules)."""
    stack = contextlib.ExitStack()
    stack.enter_context(module.patch(**values))
    request.addfinalizer(stack.close)


def _activate_both(rt: Runtime) -> Any:
    record = rt.records["dynamic_shape_fix"]
    assert record.state == State.ARMED
    for target in ("torch._dynamo.config", "torch._inductor.config"):
        rt.activate(record, target)
    return record


def test_dynamic_applicable_branch(request: pytest.FixtureRequest, runtime: Callable[..., Runtime],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo.config as dconfig
    import torch._inductor.config as iconfig

    needs_flag(dconfig, "enable_cpp_symbolic_shape_guards")
    fake_torch(monkeypatch, "2.9.0")
    monkeypatch.delenv("TORCHINDUCTOR_COALESCE_TILING_ANALYSIS", raising=False)
    patch_config(request, dconfig, enable_cpp_symbolic_shape_guards=True)  # 2.9.0's default
    patch_config(request, iconfig, **{"triton.coalesce_tiling_analysis": True})
    torch._dynamo.reset()  # (reset drops dynamo's compile callbacks, the fix's '*' counter among them)
    rt = runtime(DYN)
    record = _activate_both(rt)
    assert record.state == State.APPLIED, record.reason
    assert dconfig.enable_cpp_symbolic_shape_guards is False
    assert iconfig.triton.coalesce_tiling_analysis is False
    assert record.config == {"cpp_symbolic_shape_guards": "off", "coalesce_tiling_analysis": "off"}

    fn = torch.compile(lambda x: (x * 2).sum(0), backend="eager", dynamic=True)
    for n in (3, 5):
        torch.testing.assert_close(fn(torch.ones(n, 2)), torch.full((2,), 2.0 * n))
    assert record.calls >= 1  # a compile ran with the fix in place

    rt.deactivate("dynamic_shape_fix")
    assert dconfig.enable_cpp_symbolic_shape_guards is True
    assert iconfig.triton.coalesce_tiling_analysis is True


def test_dynamic_counts_compiles_after_reset(request: pytest.FixtureRequest, runtime: Callable[..., Runtime],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The '*' survives torch._dynamo.reset() between compiles (torch 2.9's dynamic-shape probe resets
    before each case; a registered start callback was cleared by it and the row read calls=0)."""
    import torch._dynamo.callback as dcallback
    import torch._dynamo.config as dconfig
    import torch._inductor.config as iconfig

    needs_flag(dconfig, "enable_cpp_symbolic_shape_guards")
    fake_torch(monkeypatch, "2.9.0")
    monkeypatch.delenv("TORCHINDUCTOR_COALESCE_TILING_ANALYSIS", raising=False)
    patch_config(request, dconfig, enable_cpp_symbolic_shape_guards=True)
    patch_config(request, iconfig, **{"triton.coalesce_tiling_analysis": True})
    rt = runtime(DYN)
    record = _activate_both(rt)
    assert record.state == State.APPLIED, record.reason
    for n in (3, 5):
        torch._dynamo.reset()  # clears dynamo's registered compile callbacks
        fn = torch.compile(lambda x: (x * 2).sum(0), backend="eager", dynamic=True)
        torch.testing.assert_close(fn(torch.ones(n, 2)), torch.full((2,), 2.0 * n))
        assert record.calls == (1 if n == 3 else 2)  # one compile each, counted once (the outermost)
    rt.deactivate("dynamic_shape_fix")
    assert "run_start_callbacks" not in vars(dcallback.callback_handler)  # the class's method again
    torch._dynamo.reset()
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    assert record.calls == 2  # no counting once undone


def test_dynamic_keeps_already_off_and_user_choice(request: pytest.FixtureRequest, runtime: Callable[..., Runtime],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo.config as dconfig
    import torch._inductor.config as iconfig

    needs_flag(dconfig, "enable_cpp_symbolic_shape_guards")
    fake_torch(monkeypatch, "2.9.1")
    monkeypatch.setenv("TORCHINDUCTOR_COALESCE_TILING_ANALYSIS", "1")
    patch_config(request, dconfig, enable_cpp_symbolic_shape_guards=False)  # 2.9.1 reverted the default
    patch_config(request, iconfig, **{"triton.coalesce_tiling_analysis": True})
    record = _activate_both(runtime(DYN))
    assert record.config == {"cpp_symbolic_shape_guards": "already off",
                             "coalesce_tiling_analysis": "kept (TORCHINDUCTOR_COALESCE_TILING_ANALYSIS set by user)"}
    assert iconfig.triton.coalesce_tiling_analysis is True
    assert os.environ["TORCHINDUCTOR_COALESCE_TILING_ANALYSIS"] == "1"


def test_dynamic_flag_missing_is_not_applicable(request: pytest.FixtureRequest, runtime: Callable[..., Runtime],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo.config as dconfig

    needs_flag(dconfig, "enable_cpp_symbolic_shape_guards")
    fake_torch(monkeypatch, "2.9.0")
    patch_config(request, dconfig, enable_cpp_symbolic_shape_guards=True)
    flags = dict(fixes.DynamicShapeFix.FLAGS)
    flags["torch._inductor.config"] = ("triton.renamed_coalesce_flag", "coalesce_tiling_analysis")
    monkeypatch.setattr(fixes.DynamicShapeFix, "FLAGS", flags)
    record = _activate_both(runtime(DYN))
    assert record.state == State.NOT_APPLICABLE
    assert record.reason == ("torch._inductor.config has no triton.renamed_coalesce_flag: "
                             "not the torch 2.9 layout this fix targets")
    assert dconfig.enable_cpp_symbolic_shape_guards is True  # the half applied first was undone
