"""Python entry points of the kernels: argument checks, output allocation, HSV calibration.

Each function returns None when the kernel does not handle the input (the caller then runs the
upstream code); the reason is the second element of the returned pair.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np

from loongkit_data import kernels

_KINDS = (np.dtype(np.uint8), np.dtype(np.float32))


def hwc3_reason(img: Any) -> str | None:
    """None when ``img`` is an HxWx3 uint8/float32 numpy image the kernels take, else why not."""
    if type(img) is not np.ndarray:
        return "not a numpy array"
    if img.ndim != 3 or img.shape[2] != 3:
        return "not HxWx3"
    if img.dtype not in _KINDS:
        return f"dtype {img.dtype}"
    if img.size == 0:
        return "empty image"
    return None


# ------------------------------------------------------------------------------------------------
# imnormalize


def _norm_params(mean: Any, std: Any) -> tuple[tuple[float, ...], tuple[float, ...]] | str:
    if type(mean) is not np.ndarray or type(std) is not np.ndarray:
        return "mean/std not numpy arrays"
    if mean.size != 3 or std.size != 3:
        return "mean/std not 3 values"
    # Exactly mmcv's expressions; OpenCV then rounds the float64 mean to float32 for a float32 image.
    m = np.float64(mean.reshape(1, -1))
    with np.errstate(divide="ignore"):
        stdinv = 1 / np.float64(std.reshape(1, -1))
    return tuple(m.astype(np.float32).ravel().tolist()), tuple(stdinv.ravel().tolist())


def imnormalize(img: Any, mean: Any, std: Any, to_rgb: Any) -> tuple[np.ndarray | None, str]:
    module = kernels.load()
    if module is None:
        return None, "kernel unavailable"
    why = hwc3_reason(img)
    params = _norm_params(mean, std)
    if why is None and isinstance(params, str):
        why = params
    if why is not None:
        return None, why
    assert not isinstance(params, str)
    out = np.empty(img.shape, np.float32)
    module.imnormalize(img, out, params[0], params[1], bool(to_rgb), 1)
    return out, ""


def imnormalize_(img: Any, mean: Any, std: Any, to_rgb: Any) -> tuple[np.ndarray | None, str]:
    module = kernels.load()
    if module is None:
        return None, "kernel unavailable"
    why = hwc3_reason(img)
    if why is None and img.dtype != np.float32:
        why = f"in-place on {img.dtype}"
    if why is None and not (img.flags.c_contiguous and img.flags.writeable):
        why = "in-place on a non-contiguous or read-only image"
    params = _norm_params(mean, std)
    if why is None and isinstance(params, str):
        why = params
    if why is not None:
        return None, why
    assert not isinstance(params, str)
    module.imnormalize(img, img, params[0], params[1], bool(to_rgb), 1)
    return img, ""


# ------------------------------------------------------------------------------------------------
# PhotoMetricDistortion

# Preference order only matters if calibration were ambiguous (then nothing is chosen).
_LANES = (8, 16, 4)
_MODES = [(lanes, *flags) for lanes in _LANES for flags in itertools.product((True, False), repeat=3)]
_hsv_lock = threading.Lock()
_hsv_mode: tuple[int, bool, bool, bool] | None = None
_hsv_failure: str | None = None
_hsv_done = False


def _calibration_cases() -> list[tuple[np.ndarray, dict[str, Any]]]:
    """Small images covering every SIMD/tail split of a row (widths 1..40), grey pixels, all steps."""
    rng = np.random.default_rng(20240601)
    cases = []
    for width in range(1, 41):
        img = rng.integers(0, 256, (3, width, 3), dtype=np.uint8)
        img[0, ::3] = img[0, ::3, :1]  # equal channels: zero saturation, ties in max/min
        img[1, ::5, 1] = img[1, ::5, 2]  # green == red ties
        params = {
            "delta": float(np.float32(rng.uniform(-32, 32))),
            "alpha_pre": float(np.float32(rng.uniform(0.5, 1.5))) if width % 2 else 1.0,
            "sat": float(np.float32(rng.uniform(0.5, 1.5))),
            "hue": float(np.float32(rng.uniform(-18, 18))),
            "alpha_post": 1.0 if width % 2 else float(np.float32(rng.uniform(0.5, 1.5))),
            "perm": (0, 1, 2),
        }
        params["clip_sat"] = params["sat"] > 1
        cases.append((img, params))
    return cases


def _reference(img: np.ndarray, p: dict[str, Any]) -> np.ndarray:
    import cv2

    x = img.astype(np.float32)
    x += np.float32(p["delta"])
    x *= np.float32(p["alpha_pre"])
    x = cv2.cvtColor(x, cv2.COLOR_BGR2HSV)
    x[..., 1] *= np.float32(p["sat"])
    if p["clip_sat"]:
        x[..., 1] = x[..., 1].clip(0, 1)
    x[..., 0] += np.float32(p["hue"])
    x[..., 0][x[..., 0] > 360] -= 360
    x[..., 0][x[..., 0] < 0] += 360
    x = cv2.cvtColor(x, cv2.COLOR_HSV2BGR)
    x *= np.float32(p["alpha_post"])
    return x


def calibrate_hsv(module: Any) -> tuple[tuple[int, bool, bool, bool] | None, str | None]:
    """Find how the installed OpenCV computes float HSV on this CPU (SIMD width, fused ops).

    Every candidate is run on the calibration images and compared bit for bit with cv2; exactly
    one must match, otherwise the distortion kernel is not used (reason returned).
    """
    cases = [(img, p, _reference(img, p)) for img, p in _calibration_cases()]
    matches = []
    for mode in _MODES:
        for img, p, ref in cases:
            out = np.empty(img.shape, np.float32)
            module.distort(img, out, p["delta"], p["alpha_pre"], p["sat"], p["clip_sat"], p["hue"],
                           p["alpha_post"], p["perm"], mode, 1)
            if not np.array_equal(out.view(np.uint32), ref.view(np.uint32)):
                break
        else:
            matches.append(mode)
    if len(matches) == 1:
        return matches[0], None
    if not matches:
        return None, "no kernel mode reproduces this OpenCV build's HSV arithmetic"
    return None, f"calibration ambiguous between {matches}"


def hsv_mode() -> tuple[tuple[int, bool, bool, bool] | None, str | None]:
    """The calibrated HSV mode for this process (computed once; a few milliseconds)."""
    global _hsv_mode, _hsv_failure, _hsv_done
    if _hsv_done:
        return _hsv_mode, _hsv_failure
    with _hsv_lock:
        if not _hsv_done:
            module = kernels.load()
            if module is None:
                _hsv_mode, _hsv_failure = None, "kernel unavailable"
            else:
                try:
                    _hsv_mode, _hsv_failure = calibrate_hsv(module)
                except Exception as exc:  # cv2 missing or broken: stay on upstream
                    _hsv_mode, _hsv_failure = None, f"calibration failed: {type(exc).__name__}: {exc}"
                if _hsv_failure:
                    kernels.log.warning("distortion kernel not used", reason=_hsv_failure)
                else:
                    kernels.log.debug("OpenCV HSV arithmetic calibrated", mode=_hsv_mode)
            _hsv_done = True
    return _hsv_mode, _hsv_failure


def reset_calibration() -> None:
    global _hsv_mode, _hsv_failure, _hsv_done
    with _hsv_lock:
        _hsv_mode, _hsv_failure, _hsv_done = None, None, False


def distort(img: Any, delta: float, alpha_pre: float, sat: float, clip_sat: bool, hue: float,
            alpha_post: float, perm: tuple[int, int, int]) -> tuple[np.ndarray | None, str]:
    """Fused PhotoMetricDistortion pixels; scalars are already float32-rounded Python floats."""
    mode, failure = hsv_mode()
    if mode is None:
        return None, failure or "kernel unavailable"
    module = kernels.load()
    why = hwc3_reason(img)
    if why is None and not (img.strides[2] == img.itemsize and img.strides[1] == 3 * img.itemsize):
        why = "pixels not contiguous"
    if why is not None:
        return None, why
    out = np.empty(img.shape, np.float32)
    if not module.distort(img, out, delta, alpha_pre, sat, clip_sat, hue, alpha_post, perm, mode, 1):
        return None, "float image with -0, inf, NaN or |x| >= 1e30"
    return out, ""
