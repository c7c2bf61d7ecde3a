"""Every instruction-set build of the loongkit-data kernels (what a CPU without AVX-512, or without
AVX2, runs) computes the same bits as the best one here: imnormalize in both product modes (also against
the formula of each in numpy) and the fused PhotoMetricDistortion in every HSV mode. No OpenCV needed."""

from __future__ import annotations

import itertools
import platform
import shutil
from typing import Any

import numpy as np
import pytest
from loongkit_data import kernels
from loongkit_data.kernels import ops

from loongkit_core import kernelbuild

SEED = int(np.random.SeedSequence().entropy % 2**32)
WIDTHS = (1, 7, 8, 15, 16, 17, 33, 64, 101)  # SIMD blocks of 8/16 and their tails
MEAN, STD = np.array([123.675, 116.28, 103.53]), np.array([58.395, 57.12, 57.375])


@pytest.fixture(scope="module")
def builds() -> dict[str, Any]:
    """isa -> the library's functions for it (best first)."""
    if kernels.load() is None:
        pytest.fail(f"the kernels do not load: {kernels.failure()}")
    return {isa: kernels.LIBRARY.load(isa) for isa in kernels.LIBRARY.isas()}


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


def images(rng: np.random.Generator) -> list[np.ndarray]:
    out = []
    for w in WIDTHS:
        u8 = rng.integers(0, 256, (5, w, 3), dtype=np.uint8)
        u8[:, ::4] = u8[:, ::4, :1]  # grey pixels: zero saturation, max/min ties
        f32 = (rng.standard_normal((5, w, 3)) * 90 + 110).astype(np.float32)
        for img in (u8, f32):
            out += [img, img[::-1], img[:, ::-1]]
    return out


def mmcv_imnormalize(img: np.ndarray, to_rgb: bool, product: int) -> np.ndarray:
    """mmcv.imnormalize's arithmetic in numpy: float32 subtract, then the product in float64 rounded once
    (OpenCV <= 5.0, product mode 0) or in float32 with 1/std rounded to float32 (OpenCV 5.1, mode 1)."""
    x = img[..., ::-1] if to_rgb else img
    d = x.astype(np.float32) - MEAN.astype(np.float32)
    if product == 1:
        return d * (1 / STD).astype(np.float32)
    return (d.astype(np.float64) * (1 / STD)).astype(np.float32)


def test_imnormalize_same_bits_in_every_build(builds: dict[str, Any]) -> None:
    rng = np.random.default_rng(SEED)
    mean = tuple(MEAN.astype(np.float32).astype(float).tolist())
    stdinv = tuple((1 / STD).tolist())
    for img, to_rgb, product in itertools.product(images(rng), (True, False), ops.NORM_PRODUCTS):
        expected = mmcv_imnormalize(img, to_rgb, product)
        for isa, lib in builds.items():
            out = np.full(img.shape, np.nan, np.float32)
            lib.imnormalize(img, out, mean, stdinv, to_rgb, product, 1)
            assert np.array_equal(bits(out), bits(expected)), (isa, product, img.shape, img.dtype, img.strides, SEED)
            if img.dtype == np.float32 and img.flags.c_contiguous:
                inplace = img.copy()
                lib.imnormalize(inplace, inplace, mean, stdinv, to_rgb, product, 1)
                assert np.array_equal(bits(inplace), bits(expected)), (isa, product, "in place", img.shape, SEED)


def test_product_modes_differ_on_these_images() -> None:
    """The two product modes are told apart by calibration only if they give other bits somewhere."""
    img = images(np.random.default_rng(SEED))[0]
    assert not np.array_equal(mmcv_imnormalize(img, False, 0), mmcv_imnormalize(img, False, 1))


def test_split_route_only_in_simd_builds(builds: dict[str, Any]) -> None:
    mean = tuple(MEAN.astype(np.float32).astype(float).tolist())
    stdinv = tuple((1 / STD).tolist())
    for isa, lib in builds.items():
        if isa == "baseline":
            assert lib.imnormalize_split(mean, stdinv) is False
        else:
            assert isinstance(lib.imnormalize_split(mean, stdinv), bool)


def test_distortion_same_bits_in_every_build_and_mode(builds: dict[str, Any]) -> None:
    if len(builds) == 1:
        pytest.skip("this CPU runs the baseline build only")
    rng = np.random.default_rng(SEED)
    best = next(iter(builds))
    for img in images(rng):
        if img.strides[1] != 3 * img.itemsize:
            continue  # distort takes pixel-contiguous rows only (ops.distort sends the rest upstream)
        delta, a0, a1, sat, hue = (float(np.float32(v)) for v in
                                   (rng.uniform(-32, 32), rng.uniform(0.5, 1.5), rng.uniform(0.5, 1.5),
                                    rng.uniform(0.5, 1.5), rng.uniform(-18, 18)))
        perm = tuple(int(i) for i in rng.permutation(3))
        for mode in ops._MODES:  # every mode calibration may pick
            outs = {}
            for isa, lib in builds.items():
                out = np.full(img.shape, np.nan, np.float32)
                ok = lib.distort(img, out, delta, a0, sat, sat > 1, hue, a1, perm, mode, 1)
                outs[isa] = (ok, out)
            for isa, (ok, out) in outs.items():
                assert ok == outs[best][0] and np.array_equal(bits(out), bits(outs[best][1])), (
                    isa, mode, img.shape, img.dtype, SEED)


@pytest.mark.skipif(shutil.which("objdump") is None or platform.machine() != "x86_64",
                    reason="needs binutils on x86-64")
def test_no_wide_instruction_outside_its_build(builds: dict[str, Any]) -> None:
    assert kernelbuild.isa_violations(kernels.load().__file__) == []
