"""The compiled CPU kernels as the patches see them: built at the first call that needs them."""

from __future__ import annotations

from loongkit_core.context import ActivationContext
from loongkit_ops import kernels


def ready(ctx: ActivationContext) -> bool:
    """Whether the CPU kernels load (the first call builds them). If not, the call falls back to upstream's
    code, counted and shown with the reason (``ctx.fallback``). Not at import of the target: every
    OpenMMLab program imports those modules, and a failed build must cost nothing."""
    if kernels.load() is not None:  # looked up at call time: tests replace kernels.load
        # Where the binary came from for the Summary: "prebuilt, avx512", or "built on first use in
        # 80.1 s, avx2; no prebuilt binary (...)" (a dict store: describe() is computed once).
        ctx.detail("cpu_kernels", kernels.describe())
        return True
    ctx.fallback(f"CPU kernel unavailable: {kernels.failure()}; upstream code kept")
    return False
