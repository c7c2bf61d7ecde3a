"""LOONGKIT_IMNORMALIZE: mmcv's imnormalize / imnormalize_ on a compiled, bit-exact CPU kernel.

Patch layer only; the arithmetic lives in ``loongkit_data/kernels``. On import of
``mmcv.image.photometric`` both functions are replaced wherever a loaded module binds the
originals by name; ``mmcv.image`` and ``mmcv`` re-export them while their package ``__init__`` is
still running, so they bind the replacements. Every caller looks them up through one of those
names (mmcv 2.x ``transforms.Normalize`` calls ``mmcv.imnormalize``, mmdet 2.x ``Normalize``
likewise, mmdet's ``imrenormalize`` too). Inputs the kernel does not take (other dtypes, shapes,
list means, or no kernel at all) run the original function and are counted by reason. At first use
the kernel is calibrated against the installed cv2 (``ops.norm_mode``): where no product mode
reproduces its arithmetic, every call runs upstream and the Summary row says
``[applied, kernel not used: ...]``.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

from loongkit_core.context import ActivationContext, Environment, NotApplicable
from loongkit_core.kit import FeatureImpl

NAMES = ("imnormalize", "imnormalize_")
_PARAMS = ["img", "mean", "std", "to_rgb"]


def rebind(originals: dict[str, Any], replacements: dict[str, Any], patch: Callable[[Any, str, Any], object]) -> int:
    """Call ``patch(module, name, replacement)`` for every loaded module binding an original."""
    n = 0
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, original in originals.items():
            if namespace.get(name) is original:
                patch(module, name, replacements[name])
                n += 1
    return n


class ImNormalize(FeatureImpl):
    """Every binding goes through ``ctx.patcher`` and a deferred re-bind covers the re-exports the
    patcher never saw, so the default ``deactivate`` restores the originals everywhere."""

    def detect(self, env: Environment) -> str | None:
        if not sys.platform.startswith("linux"):
            return "the kernels are built for Linux only"
        if env.version("mmcv") is None:
            return "mmcv is not installed"
        return None

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        module = sys.modules.get(target or "")
        if module is None:
            raise NotApplicable(f"{target} is not imported")
        originals: dict[str, Any] = {}
        for name in NAMES:
            fn = getattr(module, name, None)
            if not callable(fn):
                raise NotApplicable(f"{target}.{name} is missing")
            params = list(inspect.signature(fn).parameters)
            if params != _PARAMS:
                raise NotApplicable(f"{target}.{name}{tuple(params)} is not (img, mean, std, to_rgb)")
            originals[name] = fn
        from loongkit_data.kernels import ops

        fallbacks: dict[str, int] = {}  # reason -> calls sent to upstream (the Summary's configuration)
        config: dict[str, Any] = {"kernel": "built on first call", "fallbacks": fallbacks}
        ctx.set_config(config)
        count = ctx.count  # bound once: the wrappers' hot path
        first = [True]

        def note_kernel() -> None:
            from loongkit_data import kernels

            first[0] = False
            # "prebuilt, avx512", "built on first use in 41.2 s, avx2; no prebuilt binary (...)", "unavailable: ..."
            config["kernel"] = kernels.describe()
            product, failure = ops.norm_mode()  # calibrated by the first call unless it fell back earlier
            if failure:  # every call goes to upstream: the row says why
                config["opencv"] = f"not reproduced: {failure}"
                ctx.fallback(f"applied, kernel not used: {failure}")
            else:
                config["opencv"] = f"calibrated: product in {'float32' if product else 'float64'}"

        def make(name: str, fast: Callable[..., tuple[Any, str]]) -> Callable[..., Any]:
            original = originals[name]

            def wrapper(img: Any, mean: Any, std: Any, to_rgb: bool = True) -> Any:
                try:
                    out, why = fast(img, mean, std, to_rgb)
                except Exception as exc:  # never break the pipeline: upstream decides
                    out, why = None, f"kernel error: {type(exc).__name__}"
                if first[0]:
                    note_kernel()
                if out is None:
                    fallbacks[why] = fallbacks.get(why, 0) + 1
                    return original(img, mean, std, to_rgb)
                count()  # the Summary's '*': the kernel ran
                return out

            wrapper.__name__ = original.__name__
            wrapper.__qualname__ = original.__qualname__
            wrapper.__doc__ = original.__doc__
            wrapper.__module__ = original.__module__
            wrapper.__wrapped__ = original  # type: ignore[attr-defined]
            wrapper.__loongkit_original__ = original  # type: ignore[attr-defined]
            return wrapper

        wrappers = {"imnormalize": make("imnormalize", ops.imnormalize),
                    "imnormalize_": make("imnormalize_", ops.imnormalize_)}
        # Re-exports bound while the package was still importing (mmcv.image, mmcv copy the wrappers
        # from this module after this hook ran) are not in the patcher's record: deferred first, this
        # runs last at undo and puts the originals back wherever a wrapper is still bound.
        ctx.patcher.defer(lambda: rebind(wrappers, originals, setattr))
        n = rebind(originals, wrappers, ctx.patcher.patch)
        ctx.detail("bindings_patched", n)
        ctx.log.info("mmcv imnormalize routed to the loongkit kernel", target=target, bindings=n)
