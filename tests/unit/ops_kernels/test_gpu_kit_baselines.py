"""The GPU kit's baselines without a GPU: carry.py's carry folder, build_baselines.py's plan, build
outcomes and fallback reasons, the autograd glue around the carried ops, and the rule that baselines come
from registry packages (mmcv's sdist) or from loongkit's own reference paths, never from a repository.

The real build (nvcc on the carried mmcv sources) takes minutes and needs torch's CUDA libraries to
link: docs/benchmarks.md says what was compiled and linked on a machine with nvcc but no GPU.
Here, fake compilers (shell scripts) stand in for nvcc and c++, and fake op namespaces in torch for
the built libraries.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
GPU = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))

import build_baselines as bb  # noqa: E402
import carry  # noqa: E402
import run_all  # noqa: E402

KERNEL = b'#include "pytorch_cuda_helper.hpp"\n#include "common_cuda_helper.hpp"\n__global__ void k() {}\n'


def fake_mmcv_files() -> dict[str, bytes]:
    """Every file carry.MMCV lists, the .cu ones including the helpers as the real ones do."""
    files = {rel: b"// " + rel.encode() + b"\n" for rel in carry.MMCV.files}
    for rel in files:
        if rel.endswith(".cu"):
            files[rel] = KERNEL
    files[f"{carry._CSRC}/common/cuda/voxelization_cuda_kernel.cuh"] = (
        b'#ifdef MMCV_USE_PARROTS\n#include "parrots_cuda_helper.hpp"\n'
        b'#else\n#include "pytorch_cuda_helper.hpp"\n#endif\n')
    return files


def fake_gathered() -> dict[str, dict[str, bytes]]:
    return {"mmcv": fake_mmcv_files()}


def test_baselines_come_from_registry_packages_only() -> None:
    """Every carried source is read from a PyPI sdist with a pinned sha256; one baseline and one binding of
    ours per source, no other binding; deformable aggregation has no built baseline (its reference path)."""
    assert [src.name for src in carry.SOURCES] == ["mmcv"]
    for src in carry.SOURCES:
        assert src.origin.startswith("PyPI sdist ") and carry.MMCV_SDIST_SHA256 in src.origin, src.origin
    assert {b.name for b in bb.BASELINES} == {src.name for src in carry.SOURCES}
    assert sorted(p.name for p in bb.BINDINGS.iterdir()) == sorted(b.binding for b in bb.BASELINES)


def test_unresolved_includes_finds_a_header_not_carried() -> None:
    files = fake_mmcv_files()
    assert carry.unresolved_includes(files, carry.MMCV.include_dirs, carry.MMCV.unneeded_includes) == []
    del files[f"{carry._CSRC}/common/cuda/common_cuda_helper.hpp"]
    missing = carry.unresolved_includes(files, carry.MMCV.include_dirs, carry.MMCV.unneeded_includes)
    assert missing and all('"common_cuda_helper.hpp"' in m for m in missing)
    # The Parrots helper is only allowed because it is listed as unneeded.
    full = fake_mmcv_files()
    assert carry.unresolved_includes(full, carry.MMCV.include_dirs, {}) == [
        f'{carry._CSRC}/common/cuda/voxelization_cuda_kernel.cuh: "parrots_cuda_helper.hpp"']


def test_write_carry_manifest_provenance_and_size(tmp_path: Path) -> None:
    out = tmp_path / "carry"
    (out / "build").mkdir(parents=True)
    (out / "build" / "stale.o").write_bytes(b"x")  # a previous carry's build goes with it
    gathered = fake_gathered()
    manifest = carry.write_carry(out, gathered)
    assert not (out / "build").exists()
    on_disk = json.loads((out / carry.MANIFEST).read_text())
    assert on_disk == json.loads(json.dumps(manifest))
    for name, files in gathered.items():
        entry = on_disk["sources"][name]
        assert set(entry["files"]) == set(files)
        for rel, data in files.items():
            assert (out / name / rel).read_bytes() == data
            assert entry["files"][rel] == {"sha256": carry.sha256(data), "bytes": len(data)}
        text = (out / name / "PROVENANCE.txt").read_text()
        assert entry["repo"] in text and entry["version"] in text and "License:" in text
    assert set(on_disk["sources"]) == {"mmcv"} and on_disk["sources"]["mmcv"]["version"] == carry.MMCV_VERSION
    assert carry.MMCV_SDIST_SHA256 in on_disk["sources"]["mmcv"]["origin"]
    # total_bytes counts the files and the provenance notes: what travels to the GPU machine, bar the manifest.
    assert on_disk["total_bytes"] == carry.carry_bytes(out) - (out / carry.MANIFEST).stat().st_size
    assert bb.verify_carry(out) == ""
    # A carry holding a source this kit does not build is refused as a whole.
    manifest["sources"]["elsewhere"] = {"files": {}}  # type: ignore[index]
    (out / carry.MANIFEST).write_text(json.dumps(manifest))
    assert bb.verify_carry(out) == "the carry holds sources this kit does not build (elsewhere): rerun carry.py"


def test_write_carry_refuses_a_missing_include_and_an_oversized_carry(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    gathered = fake_gathered()
    del gathered["mmcv"][f"{carry._CSRC}/common/pytorch_cuda_helper.hpp"]
    with pytest.raises(SystemExit, match="includes not carried"):
        carry.write_carry(tmp_path / "a", gathered)
    monkeypatch.setattr(carry, "MAX_CARRY_BYTES", 100)
    with pytest.raises(SystemExit, match="over its bound"):
        carry.write_carry(tmp_path / "b", fake_gathered())


@pytest.mark.skipif(not (carry.DEFAULT_OUT / carry.MANIFEST).is_file(), reason="no carry folder here (carry.py)")
def test_the_real_carry_is_complete_and_small() -> None:
    """When carry.py has run here: the files match the manifest, every include resolves, under 1 MiB."""
    assert bb.verify_carry(carry.DEFAULT_OUT) == ""
    manifest = json.loads((carry.DEFAULT_OUT / carry.MANIFEST).read_text())
    for src in carry.SOURCES:
        files = {rel: (carry.DEFAULT_OUT / src.name / rel).read_bytes() for rel in src.files}
        assert carry.unresolved_includes(files, src.include_dirs, src.unneeded_includes) == []
        assert set(manifest["sources"][src.name]["files"]) == set(src.files)
    assert carry.carry_bytes(carry.DEFAULT_OUT) < carry.MAX_CARRY_BYTES


def toolchain(nvcc: str = "/usr/bin/nvcc", cxx: str = "/usr/bin/c++", shim: bool = True) -> bb.Toolchain:
    return bb.Toolchain(nvcc=nvcc, cxx=cxx, include_dirs=["/t/include", "/cuda/include"],
                        library_dirs=["/t/lib", "/cuda/lib64"], cxx_std="c++17", abi=1,
                        nvcc_flags=["-D__CUDA_NO_HALF_OPERATORS__", "--expt-relaxed-constexpr"], cudart="-lcudart",
                        thc_shim=shim)


def test_plan_compiles_each_unit_for_the_one_arch_and_links_one_library_per_baseline(tmp_path: Path) -> None:
    tc = toolchain()
    carry_dir, build_dir = tmp_path / "carry", tmp_path / "carry" / "build"
    steps = bb.plan(tc, "90", carry_dir, build_dir)
    compiles = [s for s in steps if s.kind == "compile"]
    links = [s for s in steps if s.kind == "link"]
    cu = [s for s in compiles if s.unit.endswith(".cu")]
    assert sorted(s.unit for s in cu) == sorted(Path(rel).name for b in bb.BASELINES for rel in b.sources)
    assert steps[-len(links):] == links  # every compile before any link
    for s in cu:
        argv = list(s.argv)
        assert argv[0] == tc.nvcc and "-c" in argv and argv[argv.index("-o") + 1] == s.output
        # One architecture, SASS only: exactly one gencode, no PTX (code=compute_...).
        assert argv.count("-gencode") == 1 and "arch=compute_90,code=sm_90" in argv
        assert not any("code=compute_" in a for a in argv)
        assert "-D_GLIBCXX_USE_CXX11_ABI=1" in argv and "-std=c++17" in argv and "--expt-relaxed-constexpr" in argv
        assert f"-I{build_dir / 'shim'}" in argv and "-I/t/include" in argv
    mmcv_cu = next(s for s in cu if s.unit == "ms_deform_attn_cuda.cu")
    assert f"-I{carry_dir / 'mmcv' / carry._CSRC / 'common' / 'cuda'}" in mmcv_cu.argv
    bindings = [s for s in compiles if s.unit.endswith(".cpp")]
    assert {s.unit for s in bindings} == {b.binding for b in bb.BASELINES}
    assert all(s.argv[0] == tc.cxx and "-fPIC" in s.argv and str(bb.BINDINGS / s.unit) in s.argv for s in bindings)
    for b in bb.BASELINES:
        link = next(s for s in links if s.baseline == b.name)
        objs = [s.output for s in compiles if s.baseline == b.name]
        assert link.output == str(build_dir / f"{b.library}.so") and "-shared" in link.argv
        assert all(o in link.argv for o in objs) and len(objs) == len(b.sources) + 1
        assert {"-lc10", "-lc10_cuda", "-ltorch_cpu", "-ltorch_cuda", "-ltorch", "-lcudart"} <= set(link.argv)
    # Without the THC shim (a torch that still has THC/THCAtomics.cuh) no shim folder is searched.
    assert not any("shim" in a for s in bb.plan(toolchain(shim=False), "90", carry_dir, build_dir)
                   for a in s.argv)
    # The time box's estimate: one job runs everything in turn, enough jobs only the longest unit.
    assert bb.makespan(steps, 1) == pytest.approx(sum(s.estimate_s for s in compiles) + bb.LINK_ESTIMATE_S)
    assert bb.makespan(steps, 16) == pytest.approx(max(s.estimate_s for s in compiles) + bb.LINK_ESTIMATE_S)


def fake_compiler(tmp_path: Path, name: str, code: int) -> str:
    """A script that creates its -o output and exits with ``code`` (writing an error first when non-zero)."""
    path = tmp_path / name
    path.write_text("#!/bin/sh\nwhile [ $# -gt 0 ]; do if [ \"$1\" = -o ]; then out=\"$2\"; fi; shift; done\n"
                    f"if [ {code} -ne 0 ]; then echo 'error: bad kernel' >&2; exit {code}; fi\n"
                    "touch \"$out\"\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture
def carried(tmp_path: Path) -> Path:
    out = tmp_path / "carry"
    carry.write_carry(out, fake_gathered())
    return out


def quiet(lines: list[str]) -> Any:
    return lines.append


def test_build_reasons_without_carry_arch_toolchain_or_time(tmp_path: Path, carried: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    out = bb.build(tmp_path / "absent", time_limit=100, arch="90", log=quiet(lines))
    assert all(not o.ok and "no carried upstream sources" in o.reason for o in out.values())
    assert any(line.startswith("BASELINE mmcv not available: no carried upstream sources") for line in lines)

    monkeypatch.setattr(bb, "detect_arch", lambda: (None, "no CUDA device (torch 2.x)"))
    assert {o.reason for o in bb.build(carried, time_limit=100, log=quiet(lines)).values()} == {
        "no CUDA device (torch 2.x)"}

    monkeypatch.setattr(bb, "find_toolchain", lambda extra=(): (None, "nvcc not found (no CUDA_HOME)"))
    assert {o.reason for o in bb.build(carried, time_limit=100, arch="90", log=quiet(lines)).values()} == {
        "nvcc not found (no CUDA_HOME)"}

    monkeypatch.setattr(bb, "find_toolchain", lambda extra=(): (toolchain(), ""))
    out = bb.build(carried, jobs=16, time_limit=5, arch="90", log=quiet(lines))
    assert all(not o.ok and o.reason.startswith("skipped: the build needs ~") and "5 s allowed" in o.reason
               for o in out.values())
    # A build that raises is reported, not raised.
    monkeypatch.setattr(bb, "_build", lambda *a: 1 / 0)
    assert all("the build raised ZeroDivisionError" in o.reason for o in bb.build(carried, log=quiet(lines)).values())

    # A carried file changed after carry.py: refused before any compiler runs.
    monkeypatch.undo()
    (carried / "mmcv" / "LICENSE").write_text("changed")
    assert all("changed since carry.py wrote it" in o.reason for o in bb.build(carried, arch="90", log=quiet(lines))
               .values())


def test_build_compiler_failure_then_success_reuse_and_load_fallbacks(tmp_path: Path, carried: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    bad = toolchain(nvcc=fake_compiler(tmp_path, "nvcc_bad", 1), cxx=fake_compiler(tmp_path, "cxx", 0))
    monkeypatch.setattr(bb, "find_toolchain", lambda extra=(): (bad, ""))
    out = bb.build(carried, jobs=2, time_limit=100, arch="90", log=quiet(lines))
    assert not out["mmcv"].ok and "exit 1" in out["mmcv"].reason and "error: bad kernel" in out["mmcv"].reason
    assert bb.load("mmcv", carried) == (None, f"its build failed: {out['mmcv'].reason}")

    good = toolchain(nvcc=fake_compiler(tmp_path, "nvcc", 0), cxx=bad.cxx)
    monkeypatch.setattr(bb, "find_toolchain", lambda extra=(): (good, ""))
    out = bb.build(carried, jobs=2, time_limit=100, arch="90", log=quiet(lines))
    assert all(o.ok and not o.reused and Path(o.library).is_file() for o in out.values()), out
    assert (carried / "build" / "shim" / "THC" / "THCAtomics.cuh").read_text() == bb.THC_SHIM
    again = bb.build(carried, jobs=2, time_limit=100, arch="90", log=quiet(lines))
    assert all(o.ok and o.reused for o in again.values())
    # The fake library is an empty file: the kit is told it does not load, and falls back.
    ops, why = bb.load("mmcv", carried)
    assert ops is None and why.startswith("its library ") and "does not load" in why

    status = json.loads((carried / "build" / bb.STATUS).read_text())
    status["torch"] = "0.0.1"
    (carried / "build" / bb.STATUS).write_text(json.dumps(status))
    assert bb.load("mmcv", carried) == (None, f"built for torch 0.0.1, this is {torch.__version__}: rebuild")
    status["torch"] = torch.__version__
    status["baselines"]["mmcv"]["inputs"] = "0" * 64
    (carried / "build" / bb.STATUS).write_text(json.dumps(status))
    assert bb.load("mmcv", carried)[1].startswith("built from other sources")
    (carried / "build" / bb.STATUS).unlink()
    assert bb.load("mmcv", carried)[1].startswith("the carried sources were not built")
    assert bb.load("mmcv", tmp_path / "none")[1].startswith("no carried upstream sources")


def test_run_all_falls_back_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    args = Namespace(no_build_baselines=False, build_time=150.0)
    monkeypatch.setattr(bb, "CARRY", tmp_path / "absent")
    got = run_all.prepare_baselines(args, deadline=1e12)
    assert all(not b["ok"] and "no carried upstream sources" in b["reason"] for b in got.values())
    assert "the cases use installed mmcv ops if any, else the torch references" in capsys.readouterr().out
    carry.write_carry(tmp_path / "carry", fake_gathered())
    monkeypatch.setattr(bb, "CARRY", tmp_path / "carry")
    import time

    got = run_all.prepare_baselines(args, deadline=time.perf_counter() + 100)  # less than the cases' reserve
    assert all("not built:" in b["reason"] and "the cases keep 120 s" in b["reason"] for b in got.values())
    monkeypatch.setattr(bb, "build", lambda **k: 1 / 0)
    got = run_all.prepare_baselines(args, deadline=1e12)
    assert all("the build raised ZeroDivisionError" in b["reason"] for b in got.values())
    assert run_all.prepare_baselines(Namespace(no_build_baselines=True, build_time=150.0), 1e12)["mmcv"]["reason"] == (
        "not built (--no-build-baselines)")
    # The cases say why they fall back on a machine without CUDA (configure() would also force the ops'
    # backends for the whole session: only the device is set).
    monkeypatch.setattr(run_all, "DEV", torch.device("cpu"))
    assert run_all.mmcv_msda() == (None, "not on a CUDA device")
    assert run_all.mmcv_voxelize(torch.zeros(4, 4))[2] == "not on a CUDA device"


def test_carried_msda_and_voxelize_glue(monkeypatch: pytest.MonkeyPatch) -> None:
    from loongkit_ops.kernels.ops import msda, voxelize

    class FakeMmcv:
        def ms_deform_attn_forward(self, v: Any, s: Any, st: Any, lc: Any, a: Any, step: int) -> Any:
            assert step == 64 and lc.dtype == v.dtype and a.dtype == v.dtype  # mmcv casts to value's dtype
            return msda.reference(v, s, st, lc, a)

        def ms_deform_attn_backward(self, v: Any, s: Any, st: Any, lc: Any, a: Any, grad: Any, step: int) -> Any:
            _, vjp = torch.func.vjp(lambda vv, ll, aa: msda.reference(vv, s, st, ll, aa), v, lc, a)
            return vjp(grad)

        def hard_voxelize(self, p: Any, size: list[float], rng: list[float], mp: int, mv: int) -> Any:
            assert all(isinstance(x, float) for x in size + rng)
            return list(voxelize.hard_reference(p, size, rng, mp, mv))

        def dynamic_voxelize(self, p: Any, size: list[float], rng: list[float]) -> Any:
            return voxelize.dynamic_reference(p, size, rng)

    monkeypatch.setattr(bb, "load", lambda name, carry_dir=None: (FakeMmcv(), "") if name == "mmcv" else (None, "x"))
    fn, _ = bb.mmcv_msda()
    assert fn is not None
    g = torch.Generator().manual_seed(1)
    shapes, starts = torch.tensor([[3, 4]]), torch.tensor([0])
    value = torch.randn(2, 12, 2, 4, generator=g, requires_grad=True)
    loc = torch.rand(2, 5, 2, 1, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    attn = torch.rand(2, 5, 2, 1, 3, generator=g, requires_grad=True)
    grad = torch.randn(2, 5, 8, generator=g)
    fn(value, shapes, starts, loc, attn).backward(grad)
    ref = [t.detach().float().requires_grad_() for t in (value, loc, attn)]
    msda.reference(ref[0], shapes, starts, ref[1], ref[2]).backward(grad)
    for a, b in zip((value.grad, loc.grad, attn.grad), ref, strict=True):
        assert a is not None and b.grad is not None and torch.allclose(a.float(), b.grad, atol=1e-5)
    assert loc.grad is not None and loc.grad.dtype == torch.float64  # autograd casts back to the input's dtype

    pair, _ = bb.mmcv_voxelize()
    assert pair is not None
    points = torch.randn(200, 4, generator=g) * 1.5
    size, rng = [0.5, 0.5, 0.5], [-2, -2, -1, 2, 2, 1]  # ints: the glue hands the op floats (float[] schema)
    frng = [float(x) for x in rng]
    hard = pair[0](points, size, rng, 3, 20)
    assert isinstance(hard, tuple) and all(torch.equal(a, b) for a, b in
                                           zip(hard, voxelize.hard_reference(points, size, frng, 3, 20), strict=True))
    assert torch.equal(pair[1](points, size, rng), voxelize.dynamic_reference(points, size, frng))


def test_build_baselines_plan_cli_prints_the_commands(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(bb, "find_toolchain", lambda extra=(): (toolchain(), ""))
    assert bb.main(["--plan", "--arch", "90", "--carry", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(bb.plan(toolchain(), "90", tmp_path, tmp_path / "build"))
    assert all("arch=compute_90,code=sm_90" in line for line in out if "compile" in line and ".cu " in line)
    assert os.path.basename(out[-1].split("] ")[1].split()[0]) == "c++"


def test_kit_cases_call_the_upstream_ops_with_their_arguments(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """case_msda / case_voxelize with an mmcv op present: each calls it with the op's own arguments (a wrong
    order would not run or would differ) and names the baseline in the BENCH line; case_daf compares with
    loongkit-ops' reference path, whatever is built.

    On the CPU, without the interpreter: the upstream ops are the glue above on torch fakes, ours the
    reference (forced), the CHECK lines left to the dry run."""
    from loongkit_ops.kernels.ops import daf, msda, voxelize

    for mod in (daf, msda, voxelize):
        monkeypatch.setattr(mod, "backend", lambda t: ("reference", "forced by the test"))
    monkeypatch.setattr(run_all, "DEV", torch.device("cpu"))
    monkeypatch.setattr(run_all, "DRY", True)
    monkeypatch.setattr(run_all, "check", lambda case: True)
    monkeypatch.setattr(run_all, "triton_used", lambda name, backend: True)

    class FakeMmcv:
        def ms_deform_attn_forward(self, v: Any, s: Any, st: Any, lc: Any, a: Any, step: int) -> Any:
            return msda.reference(v, s, st, lc, a)

        def ms_deform_attn_backward(self, v: Any, s: Any, st: Any, lc: Any, a: Any, grad: Any, step: int) -> Any:
            _, vjp = torch.func.vjp(lambda vv, ll, aa: msda.reference(vv, s, st, ll, aa), v, lc, a)
            return vjp(grad)

        def hard_voxelize(self, p: Any, size: list[float], rng: list[float], mp: int, mv: int) -> Any:
            return list(voxelize.hard_reference(p, size, rng, mp, mv))

        def dynamic_voxelize(self, p: Any, size: list[float], rng: list[float]) -> Any:
            return voxelize.dynamic_reference(p, size, rng)

    monkeypatch.setattr(bb, "load", lambda name, carry_dir=None: (FakeMmcv(), "") if name == "mmcv" else (None, "x"))
    monkeypatch.setattr(run_all, "mmcv_msda", lambda: (bb.mmcv_msda()[0], "carried mmcv (fake)"))
    pair = bb.mmcv_voxelize()[0]
    assert pair is not None
    fake_vox = (*pair, "carried mmcv voxelize (fake)", "vs_mmcv_cuda")
    monkeypatch.setattr(run_all, "mmcv_voxelize", lambda points: fake_vox)

    assert run_all.case_msda(True) and run_all.case_daf(True) and run_all.case_voxelize(True)
    out = capsys.readouterr().out
    for name in ("gpu_msda_fwd_bwd_vs_mmcv_cuda", "gpu_daf_fwd_bwd_vs_torch_ref", "gpu_hard_voxelize_vs_mmcv_cuda"):
        assert f"BENCH {name} baseline=" in out, out
    assert "msda baseline = carried mmcv (fake); max |difference| of the forward = 0.00e+00" in out, out
    assert f"daf baseline = {run_all.DAF_BASELINE}; max |difference| of the forward = 0.00e+00" in out, out
    assert "identical output: True; dynamic identical to mmcv's dynamic_voxelize: True" in out, out
