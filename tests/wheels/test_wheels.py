"""The wheels as a user gets them: loongkit-core with loongkit-ops and/or loongkit-data installed from wheels
built here into a fresh venv (``nox -s wheels``: all three; CI's ``nox -s plugin-ops`` / ``plugin-data``: the
core and that plugin), with no compiler reachable (``nox -s wheels`` sets this up: PATH without
c++/g++/ninja, CXX naming a missing file, an empty kernel cache). Every compiled library loads its
prebuilt binary in well under a second, builds nothing, runs each instruction-set build, and a feature
is active on it. Skipped elsewhere (an editable or source install has no prebuilt binary)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from loongkit_core import kernelbuild

SITE = Path(sysconfig.get_paths()["purelib"]).resolve()
LIBRARIES = {"loongkit_ops": "loongkit_ops.kernels", "loongkit_data": "loongkit_data.kernels"}


def _from_wheel(package: str) -> bool:
    import importlib.util

    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().is_relative_to(SITE)


# The kernel plugins installed here from wheels: both under `nox -s wheels`, one in that plugin's own
# session (`nox -s plugin-ops`, `plugin-data`: the core and that plugin alone).
WHEELS = sorted(p for p in LIBRARIES if _from_wheel(p))

pytestmark = pytest.mark.skipif(not (_from_wheel("loongkit_core") and WHEELS),
                                reason="needs the core and a kernel plugin installed from wheels (nox -s wheels)")


def needs(package: str) -> None:
    if package not in WHEELS:
        pytest.skip(f"{package} is not installed from a wheel here")


LOAD = """
import json, os, sys, time
import torch
import importlib
module = importlib.import_module(sys.argv[1])
start = time.perf_counter()
lib = module.load()
seconds = time.perf_counter() - start
from loongkit_core.kernels import openmp_runtimes
print(json.dumps({"seconds": seconds, "file": lib and lib.__file__, "origin": module.LIBRARY.origin,
                  "fallback": module.LIBRARY.fallback, "failure": module.failure(), "isas": module.LIBRARY.isas(),
                  "describe": module.describe(), "openmp": openmp_runtimes()}))
"""


def test_no_compiler_is_reachable() -> None:
    # The session's promise; without it the rest proves nothing.
    for tool in ("c++", "g++", "gcc", "cc", "clang++", "ninja"):
        assert shutil.which(tool) is None, tool
    assert not Path(os.environ["CXX"]).exists()
    assert kernelbuild.compiler() is None


@pytest.mark.parametrize("package", sorted(LIBRARIES))
def test_prebuilt_library_loads_fast_and_builds_nothing(package: str, tmp_path: Path) -> None:
    needs(package)
    cache = tmp_path / "cache"
    env = {**os.environ, "LOONGKIT_KERNEL_CACHE": str(cache)}
    proc = subprocess.run([sys.executable, "-c", LOAD, LIBRARIES[package]], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["failure"] is None and info["origin"] == "prebuilt" and info["fallback"] is None, info
    assert Path(info["file"]).resolve().is_relative_to(SITE / package), info
    assert info["seconds"] < 1.0, info  # after `import torch`, which the user pays anyway
    assert info["describe"] == f"prebuilt, {info['isas'][0]}", info
    assert not cache.exists()  # nothing was built or cached
    assert len(info["openmp"]) == 1 and "torch" in info["openmp"][0], info  # torch's libgomp, no second one


def test_wheel_binaries_need_no_torch_python_or_openmp_library() -> None:
    import importlib

    for package in WHEELS:
        library = importlib.import_module(LIBRARIES[package]).LIBRARY
        binary = library.spec.binary
        assert binary.exists(), binary
        if shutil.which("readelf") is None:
            continue
        needed = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True, check=True).stdout
        assert not any(n in needed for n in ("libtorch", "libc10", "libpython", "libgomp", "libomp", "libiomp")), needed


def test_every_isa_of_the_wheel_computes_the_same_voxels() -> None:
    needs("loongkit_ops")
    import torch
    from loongkit_ops import kernels as ops

    gen = torch.Generator().manual_seed(7)
    pts = torch.rand(20_000, 4, generator=gen) * 20 - 10
    results = [ops.LIBRARY.load(isa).hard_voxelize(pts, [0.2, 0.2, 0.4], [-8, -8, -8, 8, 8, 8], 4, 5000)
               for isa in ops.LIBRARY.isas()]
    assert all(torch.equal(a, b) for r in results for a, b in zip(r, results[0], strict=True))


def test_every_isa_of_the_wheel_computes_the_same_pixels() -> None:
    needs("loongkit_data")
    import numpy as np
    from loongkit_data import kernels as data

    img = np.random.default_rng(7).integers(0, 256, (9, 37, 3), dtype=np.uint8)
    outs = []
    for isa in data.LIBRARY.isas():
        out = np.empty(img.shape, np.float32)
        data.LIBRARY.load(isa).imnormalize(img, out, (123.675, 116.28, 103.53), (0.017, 0.0175, 0.0174), True, 0, 1)
        outs.append(out.view(np.uint32))
    assert all(np.array_equal(o, outs[0]) for o in outs)


FAKE_VOXELIZE = '''
import torch

class _Voxelization(torch.autograd.Function):
    @staticmethod
    def forward(ctx, points, voxel_size, coors_range, max_points=35, max_voxels=20000, deterministic=True):
        raise RuntimeError("the stand-in has no kernel of its own")

voxelization = _Voxelization.apply

class Voxelization(torch.nn.Module):
    def __init__(self, voxel_size, point_cloud_range, max_num_points, max_voxels=20000):
        super().__init__()
        self.args = (voxel_size, point_cloud_range, max_num_points, max_voxels)

    def forward(self, points):
        return voxelization(points, *self.args)
'''

USE_VOXELIZE = """
import torch
from mmcv.ops.voxelize import Voxelization
points = torch.rand(5000, 4) * 20 - 10
voxels, coors, num = Voxelization([0.2, 0.2, 0.4], [-8, -8, -8, 8, 8, 8], 4, 3000)(points)
assert voxels.shape[1:] == (4, 4) and coors.shape[1] == 3
"""


def test_feature_active_on_the_prebuilt_kernels(run_loongkit: Any, fake_distribution: Any, tmp_path: Path) -> None:
    needs("loongkit_ops")
    fake_distribution("mmcv", "2.1.0", modules={"mmcv/__init__.py": "", "mmcv/ops/__init__.py": "",
                                                 "mmcv/ops/voxelize.py": FAKE_VOXELIZE})
    cache = tmp_path / "cache"
    result = run_loongkit(USE_VOXELIZE, {"LOONGKIT_VOXELIZATION": "1", "LOONGKIT_KERNEL_CACHE": str(cache),
                                         "PYTHONPATH": os.environ["PYTHONPATH"]})
    assert result.returncode == 0, result.stderr
    row = result.feature("voxelization")
    assert row["active"] and row["calls"] == 1, row
    assert row["details"]["cpu_kernels"].startswith("prebuilt, "), row
    assert not cache.exists()
