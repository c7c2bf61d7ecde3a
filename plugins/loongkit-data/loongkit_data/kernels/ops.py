"""Python entry points of the kernels: argument checks, output allocation, calibration against cv2.

Each function returns None when the kernel does not handle the input (the caller then runs the
upstream code); the reason is the second element of the returned pair. Both kernels reproduce an
OpenCV operation whose arithmetic differs between releases and CPUs; a :class:`Calibration` per
kernel finds, at first use, the mode that reproduces the installed cv2 bit for bit, or none.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable
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


class Calibration:
    """Which arithmetic mode of the installed OpenCV a kernel reproduces on this CPU, found once per process.

    ``search(module)`` runs every candidate mode on the calibration images and compares it bit for bit
    with cv2; exactly one must match, otherwise the kernel is not used and the reason is kept (the
    caller then runs upstream's code, bit-exact by construction).
    """

    def __init__(self, what: str, search: Callable[[Any], tuple[Any, str | None]]) -> None:
        self.what = what
        self._search = search
        self._lock = threading.Lock()
        self._mode: Any = None
        self._failure: str | None = None
        self._done = False

    def get(self) -> tuple[Any, str | None]:
        """(mode, None), or (None, why the kernel is not used)."""
        if self._done:
            return self._mode, self._failure
        with self._lock:
            if not self._done:
                module = kernels.load()
                if module is None:
                    self._mode, self._failure = None, "kernel unavailable"
                else:
                    try:
                        self._mode, self._failure = self._search(module)
                    except Exception as exc:  # cv2 missing or broken: stay on upstream
                        self._mode, self._failure = None, f"calibration failed: {type(exc).__name__}: {exc}"
                    if self._failure:
                        kernels.log.warning(f"{self.what} kernel not used", reason=self._failure,
                                            opencv=_cv2_version())
                    else:
                        kernels.log.debug(f"OpenCV {self.what} arithmetic calibrated", mode=self._mode,
                                          opencv=_cv2_version())
                self._done = True
        return self._mode, self._failure

    def reset(self) -> None:
        with self._lock:
            self._mode, self._failure, self._done = None, None, False


def _cv2_version() -> str:
    cv2 = sys.modules.get("cv2")
    return str(getattr(cv2, "__version__", "?"))


def _matching(modes: Any, cases: list[tuple[Any, np.ndarray]], run: Callable[[Any, Any], np.ndarray]) -> list[Any]:
    """The modes whose ``run(mode, case)`` gives the case's reference bits on every case."""
    return [mode for mode in modes
            if all(np.array_equal(run(mode, case).view(np.uint32), ref.view(np.uint32)) for case, ref in cases)]


def _unique(matches: list[Any], what: str) -> tuple[Any, str | None]:
    if len(matches) == 1:
        return matches[0], None
    if not matches:
        return None, f"no kernel mode reproduces OpenCV {_cv2_version()}'s {what} arithmetic"
    return None, f"calibration ambiguous between {matches}"


# ------------------------------------------------------------------------------------------------
# imnormalize

# How cv2.multiply scales a float32 image by mmcv's float64 1/std: 0 widens the product to double and
# rounds once (OpenCV <= 5.0), 1 rounds the scalar to float32 and multiplies in float32 (5.1).
NORM_PRODUCTS = (0, 1)
_NORM_PARAMS = (  # mmcv's ImageNet defaults, identity-like, and values with no short binary form
    (np.array([123.675, 116.28, 103.53]), np.array([58.395, 57.12, 57.375])),
    (np.array([0.0, 0.0, 0.0]), np.array([255.0, 255.0, 255.0])),
    (np.array([101.3, 7.77, 250.1]), np.array([3.3, 71.9, 0.7])),
)


# OpenCV 5.1 broadcasts mmcv's (1, 3) mean and 1/std against an image of these widths (each value over a
# column, or a new (H, 3, 3) result that the in-place call drops) instead of taking them as a per-channel
# scalar; the kernel leaves such images to upstream.
BROADCAST_WIDTHS = (1, 3)


def _norm_cases() -> list[tuple[np.ndarray, np.ndarray, np.ndarray, bool]]:
    """Widths 2..40 (every split of a row into 8- and 16-pixel blocks and a tail), uint8 and float32."""
    rng = np.random.default_rng(20261205)
    cases = []
    for width in (w for w in range(1, 41) if w not in BROADCAST_WIDTHS):
        mean, std = _NORM_PARAMS[width % len(_NORM_PARAMS)]
        u8 = rng.integers(0, 256, (2, width, 3), dtype=np.uint8)
        f32 = (rng.random((2, width, 3)) * 255).astype(np.float32)
        cases += [(u8, mean, std, bool(width % 2)), (f32, mean, std, not width % 2)]
    return cases


def _norm_reference(img: np.ndarray, mean: np.ndarray, std: np.ndarray, to_rgb: bool) -> np.ndarray:
    """mmcv's imnormalize (1.x and 2.x alike), spelled out on the installed cv2."""
    import cv2

    out = img.copy().astype(np.float32)
    m = np.float64(mean.reshape(1, -1))
    stdinv = 1 / np.float64(std.reshape(1, -1))
    if to_rgb:
        cv2.cvtColor(out, cv2.COLOR_BGR2RGB, out)
    cv2.subtract(out, m, out)
    cv2.multiply(out, stdinv, out)
    return out


def _search_norm(module: Any) -> tuple[int | None, str | None]:
    cases = [(case, _norm_reference(*case)) for case in _norm_cases()]

    def run(product: int, case: tuple[np.ndarray, np.ndarray, np.ndarray, bool]) -> np.ndarray:
        img, mean, std, to_rgb = case
        params = _norm_params(mean, std)
        assert not isinstance(params, str)
        out = np.empty(img.shape, np.float32)
        module.imnormalize(img, out, params[0], params[1], to_rgb, product, 1)
        return out

    return _unique(_matching(NORM_PRODUCTS, cases, run), "float32 subtract/multiply")


NORM = Calibration("imnormalize", _search_norm)


def norm_mode() -> tuple[int | None, str | None]:
    """The calibrated product mode for this process (computed once; a few milliseconds)."""
    return NORM.get()


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


def _norm_args(img: Any, mean: Any, std: Any, inplace: bool) -> tuple[Any, Any, int] | str:
    """(mean, 1/std, product mode) for the kernel, or why it does not take this call."""
    why = hwc3_reason(img)
    if why is None and img.shape[1] in BROADCAST_WIDTHS:
        why = f"width {img.shape[1]}: OpenCV 5.1 broadcasts the mean over the columns"
    if why is None and inplace and img.dtype != np.float32:
        why = f"in-place on {img.dtype}"
    if why is None and inplace and not (img.flags.c_contiguous and img.flags.writeable):
        why = "in-place on a non-contiguous or read-only image"
    params = _norm_params(mean, std) if why is None else why
    if isinstance(params, str):
        return params
    product, failure = NORM.get()
    if product is None:
        return failure or "kernel unavailable"
    return params[0], params[1], product


def imnormalize(img: Any, mean: Any, std: Any, to_rgb: Any) -> tuple[np.ndarray | None, str]:
    module = kernels.load()
    if module is None:
        return None, "kernel unavailable"
    args = _norm_args(img, mean, std, inplace=False)
    if isinstance(args, str):
        return None, args
    out = np.empty(img.shape, np.float32)
    module.imnormalize(img, out, args[0], args[1], bool(to_rgb), args[2], 1)
    return out, ""


def imnormalize_(img: Any, mean: Any, std: Any, to_rgb: Any) -> tuple[np.ndarray | None, str]:
    module = kernels.load()
    if module is None:
        return None, "kernel unavailable"
    args = _norm_args(img, mean, std, inplace=True)
    if isinstance(args, str):
        return None, args
    module.imnormalize(img, img, args[0], args[1], bool(to_rgb), args[2], 1)
    return img, ""


# ------------------------------------------------------------------------------------------------
# PhotoMetricDistortion

# (lanes, simd_fma, simd_contract, tail_contract, overlap): see HsvMode in cpu/distortion.h. The order
# only matters if calibration were ambiguous (then nothing is chosen).
_LANES = (8, 16, 4)
_MODES = [(lanes, *flags) for lanes in _LANES for flags in itertools.product((True, False), repeat=4)]


def _calibration_cases(module: Any) -> list[tuple[np.ndarray, dict[str, Any]]]:
    """Small images covering every SIMD/tail split of a row (widths 1..40), grey pixels, all steps.

    Random pixels rarely tell the modes apart (the SIMD and scalar formulas agree on ~99 % of them), so
    the last rows of each image hold pixels on which, for that image's parameters, the formulas do
    differ (found with the kernel itself: lanes 1 runs a whole row through the SIMD formulas, lanes 0
    through the scalar ones). Then every split of a row decides between candidate modes.
    """
    rng = np.random.default_rng(20240601)
    cases = []
    for width in range(1, 41):
        img = rng.integers(0, 256, (4, width, 3), dtype=np.uint8)
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
        telling = _telling_pixels(module, rng, params)
        if len(telling):
            img[2:] = telling[np.arange(2 * width) % len(telling)].reshape(2, width, 3)
        cases.append((img, params))
    return cases


def _telling_pixels(module: Any, rng: np.random.Generator, p: dict[str, Any], n: int = 512) -> np.ndarray:
    """Pixels (uint8 BGR) on which the SIMD and scalar formulas, or their fused/unfused forms, disagree."""
    pool = rng.integers(0, 256, (1, n, 3), dtype=np.uint8)
    outs = []
    for flags in itertools.product((True, False), repeat=3):
        for lanes in (1, 0):  # all SIMD body, all scalar
            out = np.empty(pool.shape, np.float32)
            module.distort(pool, out, p["delta"], p["alpha_pre"], p["sat"], p["clip_sat"], p["hue"],
                           p["alpha_post"], p["perm"], (lanes, *flags, False), 1)
            outs.append(out.view(np.uint32))
    differ = np.zeros(n, bool)
    for out in outs[1:]:
        differ |= (out != outs[0]).any(axis=-1)[0]
    return pool[0, differ]


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


def _search_hsv(module: Any) -> tuple[tuple[int, bool, bool, bool, bool] | None, str | None]:
    cases = [((img, p), _reference(img, p)) for img, p in _calibration_cases(module)]

    def run(mode: tuple[int, bool, bool, bool, bool], case: tuple[np.ndarray, dict[str, Any]]) -> np.ndarray:
        img, p = case
        out = np.empty(img.shape, np.float32)
        module.distort(img, out, p["delta"], p["alpha_pre"], p["sat"], p["clip_sat"], p["hue"],
                       p["alpha_post"], p["perm"], mode, 1)
        return out

    return _unique(_matching(_MODES, cases, run), "float HSV")


HSV = Calibration("distortion", _search_hsv)


def hsv_mode() -> tuple[tuple[int, bool, bool, bool, bool] | None, str | None]:
    """The calibrated HSV mode for this process (computed once; a few milliseconds)."""
    return HSV.get()


def reset_calibration() -> None:
    HSV.reset()
    NORM.reset()


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
