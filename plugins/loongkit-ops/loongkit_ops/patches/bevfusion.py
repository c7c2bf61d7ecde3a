"""LOONGKIT_BEVFUSION: BEVFusion's camera-to-BEV pooling on the fused ``loongkit::bev_pool`` op.

BEVFusion is vendored, not installed; its view transforms (``LSSTransform``, ``DepthLSSTransform``,
...) register in mmcv / mmengine registries and inherit ``bev_pool(self, geom_feats, x)`` from
``BaseTransform``. When a registered class has such a base (found through the registry hook,
:mod:`.registry_hook`), that base's ``bev_pool`` is checked and replaced (class attribute, undone on
deactivation). Upstream's method quantises the frustum points to voxels (``((g - (bx - dx/2)) /
dx).long()``, truncation toward zero kept), appends the batch index, drops points outside the grid,
then calls the extension's ``bev_pool`` (a sort by voxel rank plus an interval sum, CUDA only) and
concatenates the Z slices. The patched method computes the same voxels and calls the fused op,
which drops out-of-grid points itself and sums per voxel without sorting; the gradient is a gather.

Interface check: ``bev_pool``'s parameters, the exact set of names upstream's method uses (a fork
that changes the quantisation or the pooling is left alone), the constructor's bounds arguments;
otherwise "not applicable: interface differs". Inputs the kernel does not take (CUDA, fp16) run the
original method (and its ``force_fp32``).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from loongkit_core.context import ActivationContext
from loongkit_core.feature import State
from loongkit_core.kit import FeatureImpl
from loongkit_ops.patches.registry_hook import stop, watch_registrations

METHOD = "bev_pool"
METHOD_PARAMS = ["self", "geom_feats", "x"]
# Every global and attribute name upstream's BaseTransform.bev_pool uses.
METHOD_NAMES = frozenset({"shape", "reshape", "bx", "dx", "long", "view", "torch", "cat", "full", "device", "range",
                          "nx", "bev_pool", "unbind"})
INIT_PARAMS = ("xbound", "ybound", "zbound", "dbound")


def defining_class(cls: type) -> type | None:
    """The class in ``cls``'s MRO whose own ``bev_pool`` is upstream's BaseTransform method, if any."""
    for base in cls.__mro__:
        if METHOD in base.__dict__ and base.__name__ == "BaseTransform":
            return base
    return None


def interface_problem(base: type) -> str | None:
    fn = inspect.unwrap(base.__dict__[METHOD])  # force_fp32 wraps it upstream
    code = getattr(fn, "__code__", None)
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    if code is None or params != METHOD_PARAMS:
        return f"interface differs: BaseTransform.bev_pool{tuple(params)}"
    names = set(code.co_names)
    if "bev_pool" not in names or not names <= METHOD_NAMES:
        return f"interface differs: BaseTransform.bev_pool uses {sorted(names - METHOD_NAMES) or 'no bev_pool'}"
    try:
        init = list(inspect.signature(base.__init__).parameters)
    except (TypeError, ValueError):
        init = []
    missing = [p for p in INIT_PARAMS if p not in init]
    if missing:
        return f"interface differs: BaseTransform.__init__ lacks {missing}"
    return None


class BevFusionPool(FeatureImpl):
    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        assert target is not None
        from loongkit_ops import kernels
        seen: dict[type, str] = {}
        self._seen = seen
        record = ctx.record

        def on_class(cls: type) -> None:
            base = defining_class(cls)
            if base is None or base in seen:
                return
            where = f"{base.__module__}.{base.__qualname__}"
            problem = interface_problem(base)
            if problem is None and kernels.load() is None:  # built only once a matching class registers
                problem = f"CPU kernel unavailable: {kernels.failure()}"
            if problem:
                seen[base] = problem
                ctx.detail("skipped", {**record.details.get("skipped", {}), where: problem})  # type: ignore[dict-item]
                if "patched" not in seen.values():
                    record.state, record.reason = State.NOT_APPLICABLE, problem
                ctx.log.warning("BEVFusion bev_pool left unpatched", cls=where, reason=problem)
                return
            self._patch(ctx, base)
            seen[base] = "patched"
            if record.state == State.NOT_APPLICABLE:
                record.state, record.reason = State.APPLIED, ""
            ctx.detail("patched", [*record.details.get("patched", []), where])  # type: ignore[misc]
            ctx.log.info("BEVFusion bev_pool uses the fused op", cls=where, via=cls.__qualname__)

        # one subscription per target registry module (mmengine's and mmcv 1.x's)
        self.__dict__.setdefault("_subscriptions", []).append(watch_registrations(ctx, sys.modules[target], on_class))
        ctx.set_config({"BaseTransform.bev_pool": "loongkit::bev_pool"})
        ctx.log.info("watching registrations for BEVFusion view transforms", registry=target)

    def _patch(self, ctx: ActivationContext, base: type) -> None:
        import torch

        from loongkit_ops.kernels import ops

        original = base.__dict__[METHOD]
        record = ctx.record

        def bev_pool(self: Any, geom_feats: Any, x: Any) -> Any:
            if not (isinstance(x, torch.Tensor) and isinstance(geom_feats, torch.Tensor) and x.dim() == 6
                    and ops.bev_pool_backend(x)[0] == "cpu" and all(hasattr(self, a) for a in ("bx", "dx", "nx"))):
                return original(self, geom_feats, x)
            record.calls += 1
            B, N, D, H, W, C = x.shape
            n = B * N * D * H * W
            # The same quantisation as upstream (truncation toward zero, in the geometry's dtype).
            voxels = ((geom_feats - (self.bx - self.dx / 2.0)) / self.dx).long().view(n, 3)
            batch = torch.arange(B, device=x.device).repeat_interleave(n // B)[:, None]
            coords = torch.cat([voxels, batch], 1)
            nx = [int(v) for v in self.nx]
            out = ops.bev_pool_op(x.reshape(n, C), coords, B, nx[2], nx[0], nx[1])
            return torch.cat(out.unbind(dim=2), 1)

        bev_pool.__doc__ = original.__doc__
        bev_pool.__wrapped__ = original  # type: ignore[attr-defined]
        ctx.patcher.patch(base, METHOD, bev_pool)

    def deactivate(self, ctx: ActivationContext) -> None:
        for subscription in self.__dict__.pop("_subscriptions", []):
            stop(subscription)
        self._seen = {}
        super().deactivate(ctx)
