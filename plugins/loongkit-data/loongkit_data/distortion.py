"""LOONGKIT_DISTORTION: mmdet's PhotoMetricDistortion pixels on a compiled, bit-exact CPU kernel.

Patch layer only; the arithmetic lives in ``loongkit_data/kernels``. Random numbers are still drawn
in Python, in upstream's order, from upstream's generator:

* mmdet 3.x (``mmdet.datasets.transforms.transforms``): ``transform`` calls the class's own
  ``_random_flags()`` (all draws up front, ``cache_randomness`` semantics kept), then runs the kernel.
* mmdet 2.x (``mmdet.datasets.pipelines.transforms``): ``__call__`` draws lazily behind coin flips;
  the same draws are made in the same order from the module's ``random`` before the pixels.

Whenever the kernel cannot take the image or the draws (other dtypes, non-contiguous pixels, float
images with inf/NaN/-0, draws that are not plain Python numbers, no kernel, OpenCV arithmetic not
reproduced on this machine), the original method runs with the draws already made replayed to it,
so the random stream and the result are upstream's. Subclasses that inherit ``transform`` /
``__call__`` get the kernel too; subclasses that override them keep their own code.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from loongkit_core.context import ActivationContext, Environment, NotApplicable
from loongkit_core.kit import FeatureImpl

V3 = "mmdet.datasets.transforms.transforms"
V2 = "mmdet.datasets.pipelines.transforms"


def _f32(value: Any) -> float | None:
    import numpy as np  # here, not at module level: this module is imported at boot to resolve the feature

    """float32 rounding of a Python number, as numpy applies it to ``float32_array op= value``."""
    if type(value) in (float, int):
        return float(np.float32(value))
    return None


def _perm(value: Any) -> tuple[int, int, int] | None:
    import numpy as np

    if type(value) is not np.ndarray or value.shape != (3,) or value.dtype.kind not in "iu":
        return None
    perm = tuple(int(v) for v in value)
    return perm if sorted(perm) == [0, 1, 2] else None  # type: ignore[return-value]


def kernel_params(mode: Any, brightness: Any, contrast: Any, saturation: Any, hue: Any, swap: Any,
                  delta: Any, alpha: Any, sat: Any, hue_value: Any, perm: Any,
                  clip: bool) -> dict[str, Any] | None:
    """The kernel's arguments for one set of draws; None if numpy would not round them as assumed."""
    p: dict[str, Any] = {"delta": 0.0, "alpha_pre": 1.0, "sat": 1.0, "clip_sat": False, "hue": 0.0,
                         "alpha_post": 1.0, "perm": (0, 1, 2)}
    if brightness:
        p["delta"] = _f32(delta)
    if contrast and mode in (0, 1):
        p["alpha_pre" if mode == 1 else "alpha_post"] = _f32(alpha)
    if saturation:
        p["sat"] = _f32(sat)
        p["clip_sat"] = bool(clip and sat > 1)
    if hue:
        p["hue"] = _f32(hue_value)
    if swap:
        p["perm"] = _perm(perm)
    if any(v is None for v in p.values()):
        return None
    return p


class _Replay:
    """Stands in for ``numpy.random`` in mmdet 2.x's module: hands back recorded draws in order."""

    def __init__(self, draws: list[Any]) -> None:
        self._draws = list(draws)

    def _next(self, *args: Any, **kwargs: Any) -> Any:
        return self._draws.pop(0)

    randint = uniform = permutation = _next


def draw_v2(random: Any, t: Any) -> tuple[list[Any], dict[str, Any]]:
    """mmdet 2.x's draws, in its order (each value only behind its coin flip)."""
    draws: list[Any] = []

    def rec(value: Any) -> Any:
        draws.append(value)
        return value

    out: dict[str, Any] = {"brightness": 0, "contrast": 0, "saturation": 0, "hue": 0, "swap": 0,
                           "delta": None, "alpha": None, "sat": None, "hue_value": None, "perm": None}
    if rec(random.randint(2)):
        out["brightness"], out["delta"] = 1, rec(random.uniform(-t.brightness_delta, t.brightness_delta))
    out["mode"] = mode = rec(random.randint(2))
    if mode == 1 and rec(random.randint(2)):
        out["contrast"], out["alpha"] = 1, rec(random.uniform(t.contrast_lower, t.contrast_upper))
    if rec(random.randint(2)):
        out["saturation"], out["sat"] = 1, rec(random.uniform(t.saturation_lower, t.saturation_upper))
    if rec(random.randint(2)):
        out["hue"], out["hue_value"] = 1, rec(random.uniform(-t.hue_delta, t.hue_delta))
    if mode == 0 and rec(random.randint(2)):
        out["contrast"], out["alpha"] = 1, rec(random.uniform(t.contrast_lower, t.contrast_upper))
    if rec(random.randint(2)):
        out["swap"], out["perm"] = 1, rec(random.permutation(3))
    return draws, out


class Distortion(FeatureImpl):
    def __init__(self, feature: Any) -> None:
        super().__init__(feature)
        self.fallbacks: dict[str, int] = {}  # reason -> images sent to upstream (shown in the Summary)
        self._config: dict[str, Any] = {}
        self._fallback: Callable[[str], None] | None = None  # the activation's ctx.fallback

    def detect(self, env: Environment) -> str | None:
        if not sys.platform.startswith("linux"):
            return "the kernels are built for Linux only"
        if env.version("mmdet") is None:
            return "mmdet is not installed"
        if env.version("opencv-python") is None and env.version("opencv-python-headless") is None \
                and env.version("cv2") is None:
            return "OpenCV is not installed"
        return None

    def _note(self, out: Any, why: str, count: Callable[[], None]) -> bool:
        if not self._config.get("hsv"):
            from loongkit_data.kernels import ops

            mode, failure = ops.hsv_mode()
            self._config["hsv"] = (f"calibrated: {mode[0]} lanes, fma={mode[1]}, contracted={mode[2]}/{mode[3]}, "
                                   f"row end {'overlapped' if mode[4] else 'scalar'}"
                                   if mode else f"not reproduced: {failure}")
            if failure and self._fallback is not None:  # every image goes to upstream: the row says why
                self._fallback(f"applied, kernel not used: {failure}")
        if out is None:
            self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
            return False
        count()
        return True

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        module = sys.modules.get(target or "")
        cls = getattr(module, "PhotoMetricDistortion", None)
        if not isinstance(cls, type):
            raise NotApplicable(f"{target} has no PhotoMetricDistortion class")
        self._config = ctx.config if isinstance(ctx.config, dict) else {}
        self._config.setdefault("fallbacks", self.fallbacks)
        self._fallback = ctx.fallback
        ctx.set_config(self._config)
        if target == V3:
            self._patch_v3(ctx, cls)
        elif target == V2:
            self._patch_v2(ctx, cls, module)
        else:
            raise NotApplicable(f"unknown target {target}")
        ctx.log.info("PhotoMetricDistortion routed to the loongkit kernel", target=target)

    def _patch_v3(self, ctx: ActivationContext, cls: type) -> None:
        original = cls.__dict__.get("transform")
        # Look in the class dicts: attribute access would run cache_randomness's __get__.
        if original is None or not any("_random_flags" in vars(k) for k in cls.__mro__):
            raise NotApplicable("mmdet 3.x PhotoMetricDistortion has no transform/_random_flags")
        from loongkit_data.kernels import ops

        count = ctx.count  # bound once: the wrapper's hot path
        impl = self

        def transform(self: Any, results: dict) -> dict:
            img = results.get("img") if isinstance(results, dict) else None
            if ops.hwc3_reason(img) is not None or "_random_flags" in vars(self):
                impl._note(None, ops.hwc3_reason(img) or "instance overrides _random_flags", count)
                return original(self, results)
            flags = self._random_flags()
            out, why = None, "draws not plain Python numbers"
            try:
                (mode, bf, cf, sf, hf, wf, delta, alpha, sat, hue, perm) = flags
                p = kernel_params(mode, bf, cf, sf, hf, wf, delta, alpha, sat, hue, perm, clip=True)
                if p is not None:
                    out, why = ops.distort(img, **p)
            except Exception as exc:  # never break the pipeline: upstream decides
                out, why = None, f"kernel error: {type(exc).__name__}"
            if impl._note(out, why, count):
                results["img"] = out
                return results
            self._random_flags = lambda: flags  # replay the same draws through upstream's code
            try:
                return original(self, results)
            finally:
                del self._random_flags

        transform.__wrapped__ = original  # type: ignore[attr-defined]
        transform.__loongkit_original__ = original  # type: ignore[attr-defined]
        transform.__doc__ = original.__doc__
        ctx.patcher.patch(cls, "transform", transform)

    def _patch_v2(self, ctx: ActivationContext, cls: type, module: Any) -> None:
        original = cls.__dict__.get("__call__")
        if original is None or not hasattr(module, "random"):
            raise NotApplicable("mmdet 2.x PhotoMetricDistortion has no __call__ or module random")
        from loongkit_data.kernels import ops

        count = ctx.count  # bound once: the wrapper's hot path
        impl = self

        def __call__(self: Any, results: dict) -> dict:
            img = results.get("img") if isinstance(results, dict) else None
            why = ops.hwc3_reason(img)
            if why is None and results.get("img_fields", ["img"]) != ["img"]:
                why = "img_fields other than ['img']"
            if why is not None:
                impl._note(None, why, count)
                return original(self, results)
            random = module.random
            draws, d = draw_v2(random, self)
            out, why = None, "draws not plain Python numbers"
            try:
                p = kernel_params(d["mode"], d["brightness"], d["contrast"], d["saturation"], d["hue"], d["swap"],
                                  d["delta"], d["alpha"], d["sat"], d["hue_value"], d["perm"], clip=False)
                if p is not None:
                    out, why = ops.distort(img, **p)
            except Exception as exc:
                out, why = None, f"kernel error: {type(exc).__name__}"
            if impl._note(out, why, count):
                results["img"] = out
                return results
            module.random = _Replay(draws)  # upstream's code, fed the draws already made
            try:
                return original(self, results)
            finally:
                module.random = random

        __call__.__wrapped__ = original  # type: ignore[attr-defined]
        __call__.__loongkit_original__ = original  # type: ignore[attr-defined]
        __call__.__doc__ = original.__doc__
        ctx.patcher.patch(cls, "__call__", __call__)
