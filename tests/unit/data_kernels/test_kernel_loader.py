"""The loongkit-data kernels' fallback without a library and the patch layer's pure-Python decisions
(no OpenMMLab)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from loongkit_data import kernels
from loongkit_data.distortion import _Replay, draw_v2, kernel_params
from loongkit_data.kernels import ops


@pytest.fixture(autouse=True)
def fresh_calibration() -> Any:
    ops.reset_calibration()
    yield
    ops.reset_calibration()


def test_no_kernel_falls_back_with_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    # How the library fails (no compiler, build error, broken binary) is the core loader's business
    # (tests/unit/core/test_kernels.py); here: the entry points send every image to upstream.
    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels, "failure", lambda: "KernelError: no C++ compiler (c++ not on PATH)")
    out, why = ops.imnormalize(np.zeros((2, 2, 3), np.uint8), np.zeros(3), np.ones(3), True)
    assert out is None and why == "kernel unavailable"
    assert ops.imnormalize_(np.zeros((2, 2, 3), np.float32), np.zeros(3), np.ones(3), True)[0] is None
    assert ops.distort(np.zeros((2, 2, 3), np.uint8), 0.0, 1.0, 1.0, False, 0.0, 1.0, (0, 1, 2)) == (
        None, "kernel unavailable")


def test_one_loader_for_the_library() -> None:
    from loongkit_core.kernels import KernelLibrary

    assert isinstance(kernels.LIBRARY, KernelLibrary) and kernels.LIBRARY.name == "loongkit_data_cpu"
    assert kernels.CACHE_ENV == "LOONGKIT_KERNEL_CACHE"


@pytest.mark.parametrize(("img", "why"), [
    ([[1, 2, 3]], "not a numpy array"),
    (np.zeros((2, 2), np.uint8), "not HxWx3"),
    (np.zeros((2, 2, 4), np.uint8), "not HxWx3"),
    (np.zeros((2, 2, 3), np.float64), "dtype float64"),
    (np.zeros((0, 2, 3), np.uint8), "empty image"),
    (np.zeros((2, 2, 3), np.float32), None),
])
def test_inputs_the_kernels_take(img: Any, why: str | None) -> None:
    assert ops.hwc3_reason(img) == why


def test_kernel_params_follow_numpy_rounding() -> None:
    perm = np.array([2, 0, 1])
    p = kernel_params(1, 1, 1, 1, 1, 1, 10.3, 1.2, 1.4, -5.5, perm, clip=True)
    assert p == {"delta": float(np.float32(10.3)), "alpha_pre": float(np.float32(1.2)), "alpha_post": 1.0,
                 "sat": float(np.float32(1.4)), "clip_sat": True, "hue": -5.5, "perm": (2, 0, 1)}
    # contrast last, saturation below 1 (never clipped), nothing else
    p = kernel_params(0, 0, 1, 1, 0, 0, 10.3, 0.7, 0.9, 3.0, perm, clip=True)
    assert p is not None and p["alpha_post"] == float(np.float32(0.7)) and p["alpha_pre"] == 1.0
    assert p["clip_sat"] is False and p["delta"] == 0.0 and p["perm"] == (0, 1, 2)
    # mmdet 2.x never clips
    assert kernel_params(0, 0, 0, 1, 0, 0, 0, 0, 1.4, 0, perm, clip=False)["clip_sat"] is False  # type: ignore[index]
    # a float64 scalar would make numpy compute in float64: not the kernel's arithmetic
    assert kernel_params(0, 1, 0, 0, 0, 0, np.float64(3.0), 0, 0, 0, perm, clip=True) is None
    assert kernel_params(0, 0, 0, 0, 0, 1, 0, 0, 0, 0, np.array([0, 0, 1]), clip=True) is None


class Recorder:
    def __init__(self, coins: list[int]) -> None:
        self.coins = list(coins)
        self.calls: list[str] = []

    def randint(self, n: int) -> int:
        self.calls.append("randint")
        return self.coins.pop(0)

    def uniform(self, a: float, b: float) -> float:
        self.calls.append(f"uniform({a},{b})")
        return (a + b) / 2 + 0.25

    def permutation(self, n: int) -> np.ndarray:
        self.calls.append("permutation")
        return np.array([1, 2, 0])


class Params:
    brightness_delta, contrast_lower, contrast_upper = 32, 0.5, 1.5
    saturation_lower, saturation_upper, hue_delta = 0.5, 1.5, 18


def test_mmdet2_draw_order_is_lazy() -> None:
    # brightness on, mode 0, saturation off, hue on, contrast (last) on, swap off
    rec = Recorder([1, 0, 0, 1, 1, 0])
    draws, d = draw_v2(rec, Params())
    assert rec.calls == ["randint", "uniform(-32,32)", "randint", "randint", "randint", "uniform(-18,18)",
                         "randint", "uniform(0.5,1.5)", "randint"]
    assert d["mode"] == 0 and d["brightness"] and d["hue"] and d["contrast"] and not d["saturation"]
    replay = _Replay(draws)
    assert [replay.randint(2), replay.uniform(0, 1), replay.randint(2)] == [1, 0.25, 0]
