"""LOONGKIT_BEVFUSION: BEVFusion's camera-to-BEV on the fused ``loongkit::bev_pool`` op, geometry vectorised.

BEVFusion is vendored, not installed; its view transforms (``LSSTransform``, ``DepthLSSTransform``,
...) register in mmcv / mmengine registries and inherit ``get_geometry`` and ``bev_pool`` from
``BaseTransform``. When a registered class has such a base (found through the registry hook,
:mod:`.registry_hook`), each of the base's two methods is checked and, if it is upstream's, replaced
(class attribute, undone on deactivation); a method whose interface differs is left alone with its
reason, without preventing the other.

``bev_pool``: upstream's method quantises the frustum points to voxels (``((g - (bx - dx/2)) /
dx).long()``, truncation toward zero kept), appends the batch index, drops points outside the grid,
then calls the extension's ``bev_pool`` (a sort by voxel rank plus an interval sum, CUDA only) and
concatenates the Z slices. The patched method computes the same voxels and calls the fused op,
which drops out-of-grid points itself and sums per voxel without sorting; the gradient is a gather.
Inputs the kernel does not take (CUDA, fp16) run the original method (and its ``force_fp32``).

``get_geometry``: upstream maps every frustum point (u, v, d) of every camera through a chain of
broadcast 3x3 matmuls on ``[B, N, D, H, W, 3, 1]`` tensors (millions of tiny matmuls, each matrix
expanded per point): undo the image augmentation (``inverse(post_rots) @ (p - post_trans)``), scale
(u, v) by the depth, ``camera2lidar_rots @ inverse(intrins)`` plus ``camera2lidar_trans``, then the
optional lidar augmentation (``extra_rots``, ``extra_trans``). The part before the depth product and
the part after it are each affine per camera, so the patched method folds the second chain into one
3x3 matrix and translation per camera (computed in the geometry's dtype) and applies the two stages
as one batched matmul each over the frustum, ``[B*N, D*H*W, 3]``, keeping upstream's order around the
depth product (subtract ``post_trans``, rotate, multiply u and v by d). Results equal upstream's up
to rounding (the fold reassociates the products); inputs in mixed or half dtypes run the original.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from loongkit_core.context import ActivationContext
from loongkit_core.feature import State
from loongkit_core.kit import FeatureImpl
from loongkit_ops.patches.registry import stop, watch_registrations

POOL = "bev_pool"
POOL_PARAMS = ["self", "geom_feats", "x"]
# Every global and attribute name upstream's BaseTransform.bev_pool uses.
POOL_NAMES = frozenset({"shape", "reshape", "bx", "dx", "long", "view", "torch", "cat", "full", "device", "range",
                        "nx", "bev_pool", "unbind"})
GEOMETRY = "get_geometry"
GEOMETRY_PARAMS = ["self", "camera2lidar_rots", "camera2lidar_trans", "intrins", "post_rots", "post_trans", "kwargs"]
# Every global and attribute name upstream's BaseTransform.get_geometry uses, the ones it must use,
# and the keyword arguments it reads.
GEOMETRY_NAMES = frozenset({"shape", "frustum", "view", "torch", "inverse", "matmul", "unsqueeze", "cat", "squeeze",
                            "repeat"})
GEOMETRY_REQUIRED = frozenset({"frustum", "inverse", "matmul", "cat"})
GEOMETRY_KWARGS = ("extra_rots", "extra_trans")
INIT_PARAMS = ("xbound", "ybound", "zbound", "dbound")


def defining_class(cls: type) -> type | None:
    """The class in ``cls``'s MRO whose own ``bev_pool`` is upstream's BaseTransform method, if any."""
    for base in cls.__mro__:
        if POOL in base.__dict__ and base.__name__ == "BaseTransform":
            return base
    return None


def _code(base: type, method: str) -> tuple[Any, list[str]]:
    fn = inspect.unwrap(base.__dict__[method])  # force_fp32 wraps it upstream
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params]
    if params and params[-1].kind is inspect.Parameter.VAR_KEYWORD:
        names[-1] = "kwargs"  # **kwargs under any name
    elif params and names[-1] == "kwargs":
        names[-1] = "kwargs (not **)"
    return getattr(fn, "__code__", None), names


def _init_problem(base: type) -> str | None:
    try:
        init = list(inspect.signature(base.__init__).parameters)
    except (TypeError, ValueError):
        init = []
    missing = [p for p in INIT_PARAMS if p not in init]
    return f"interface differs: BaseTransform.__init__ lacks {missing}" if missing else None


def interface_problem(base: type) -> str | None:
    """Why ``base.bev_pool`` is not upstream's (None: it is)."""
    code, params = _code(base, POOL)
    if code is None or params != POOL_PARAMS:
        return f"interface differs: BaseTransform.bev_pool{tuple(params)}"
    names = set(code.co_names)
    if "bev_pool" not in names or not names <= POOL_NAMES:
        return f"interface differs: BaseTransform.bev_pool uses {sorted(names - POOL_NAMES) or 'no bev_pool'}"
    return _init_problem(base)


def geometry_problem(base: type) -> str | None:
    """Why ``base.get_geometry`` is not upstream's (None: it is)."""
    if GEOMETRY not in base.__dict__:
        return "interface differs: BaseTransform has no get_geometry"
    code, params = _code(base, GEOMETRY)
    if code is None or params != GEOMETRY_PARAMS:
        return f"interface differs: BaseTransform.get_geometry{tuple(params)}"
    names = set(code.co_names)
    if not names <= GEOMETRY_NAMES or not names >= GEOMETRY_REQUIRED:
        extra = sorted(names - GEOMETRY_NAMES) or f"not {sorted(GEOMETRY_REQUIRED - names)}"
        return f"interface differs: BaseTransform.get_geometry uses {extra}"
    # Keyword arguments are read by string key: a fork reading others (say a lidar_aug_matrix) differs.
    doc = inspect.unwrap(base.__dict__[GEOMETRY]).__doc__
    strings = {c for c in code.co_consts if isinstance(c, str) and c != doc} - set(GEOMETRY_KWARGS)
    if strings:
        return f"interface differs: BaseTransform.get_geometry reads {sorted(strings)}"
    if any(inspect.iscode(c) for c in code.co_consts):
        return "interface differs: BaseTransform.get_geometry defines inner functions"
    return None


def folded_geometry(frustum: Any, camera2lidar_rots: Any, camera2lidar_trans: Any, intrins: Any, post_rots: Any,
                    post_trans: Any, extra_rots: Any = None, extra_trans: Any = None) -> Any:
    """``[B, N, D, H, W, 3]`` lidar-frame points of the frustum ``[D, H, W, 3]``, upstream's maths folded.

    Stage 1 (per camera, upstream's order): p' = inverse(post_rots) @ (p - post_trans), then
    (u, v, d) -> (u d, v d, d). Stage 2 (one affine per camera): M = extra_rots @ camera2lidar_rots @
    inverse(intrins), t = extra_rots @ camera2lidar_trans + extra_trans; out = M p'' + t.
    """
    import torch

    B, N = camera2lidar_trans.shape[:2]
    D, H, W = frustum.shape[:3]
    bn = B * N
    undo = torch.inverse(post_rots).reshape(bn, 3, 3)
    points = frustum.reshape(1, D * H * W, 3) - post_trans.reshape(bn, 1, 3)
    points = torch.matmul(points, undo.transpose(1, 2))  # row-vector form: p @ A^T = (A p)^T
    if torch.is_grad_enabled() and any(t.requires_grad for t in (frustum, post_rots, post_trans)):
        points = torch.cat((points[..., :2] * points[..., 2:3], points[..., 2:3]), 2)
    else:  # the same products, in place (no autograd graph to keep)
        points[..., :2] *= points[..., 2:3]
    rot = camera2lidar_rots.matmul(torch.inverse(intrins))  # [B, N, 3, 3]
    trans = camera2lidar_trans
    if extra_rots is not None:
        rot = extra_rots[:, None].matmul(rot)
        trans = extra_rots[:, None].matmul(trans[..., None])[..., 0]
    if extra_trans is not None:
        trans = trans + extra_trans[:, None]
    points = torch.baddbmm(trans.reshape(bn, 1, 3), points, rot.reshape(bn, 3, 3).transpose(1, 2))
    return points.view(B, N, D, H, W, 3)


def _geometry_inputs_ok(frustum: Any, args: tuple, kwargs: dict) -> bool:
    """All tensors, one device, one dtype among float32/float64, upstream's shapes (else: the original)."""
    import torch

    if not isinstance(frustum, torch.Tensor) or frustum.dim() != 4 or frustum.shape[3] != 3:
        return False
    rots, trans, intrins, post_rots, post_trans = args
    extra = [kwargs[k] for k in GEOMETRY_KWARGS if k in kwargs]
    tensors = [frustum, rots, trans, intrins, post_rots, post_trans, *extra]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if frustum.dtype not in (torch.float32, torch.float64) or any(
            t.dtype != frustum.dtype or t.device != frustum.device for t in tensors):
        return False
    if trans.dim() != 3 or trans.shape[2] != 3:
        return False
    B, N = trans.shape[:2]
    shapes = [(rots, (B, N, 3, 3)), (intrins, (B, N, 3, 3)), (post_rots, (B, N, 3, 3)), (post_trans, (B, N, 3))]
    if "extra_rots" in kwargs:
        shapes.append((kwargs["extra_rots"], (B, 3, 3)))
    if "extra_trans" in kwargs:
        shapes.append((kwargs["extra_trans"], (B, 3)))
    return all(tuple(t.shape) == s for t, s in shapes)


class BevFusionPool(FeatureImpl):
    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        assert target is not None
        from loongkit_ops import kernels
        seen: dict[type, dict[str, str]] = {}
        self._seen = seen
        record = ctx.record

        def skip(where: str, problem: str) -> None:
            ctx.detail("skipped", {**record.details.get("skipped", {}), where: problem})  # type: ignore[dict-item]
            if not any("patched" in v.values() for v in seen.values()):
                record.state, record.reason = State.NOT_APPLICABLE, problem
            ctx.log.warning("BEVFusion method left unpatched", method=where, reason=problem)

        def patched(where: str, what: str, via: str) -> None:
            if record.state == State.NOT_APPLICABLE:
                record.state, record.reason = State.APPLIED, ""
            done = list(record.details.get("patched", []))  # type: ignore[call-overload]
            ctx.detail("patched", done if where in done else [*done, where])
            ctx.log.info(f"BEVFusion {what}", method=where, via=via)

        def on_class(cls: type) -> None:
            base = defining_class(cls)
            if base is None or base in seen:
                return
            outcome: dict[str, str] = {}
            seen[base] = outcome
            where = f"{base.__module__}.{base.__qualname__}"
            problem = interface_problem(base)
            if problem is None and kernels.load() is None:  # built only once a matching class registers
                problem = f"CPU kernel unavailable: {kernels.failure()}"
            if problem:
                outcome[POOL] = problem
                skip(f"{where}.{POOL}", problem)
            else:
                self._patch_pool(ctx, base)
                outcome[POOL] = "patched"
                patched(f"{where}.{POOL}", "bev_pool uses the fused op", cls.__qualname__)
            problem = geometry_problem(base)
            if problem:
                outcome[GEOMETRY] = problem
                skip(f"{where}.{GEOMETRY}", problem)
            else:
                self._patch_geometry(ctx, base)
                outcome[GEOMETRY] = "patched"
                patched(f"{where}.{GEOMETRY}", "get_geometry folded into per-camera affines", cls.__qualname__)

        # one subscription per target registry module (mmengine's and mmcv 1.x's)
        self.__dict__.setdefault("_subscriptions", []).append(watch_registrations(ctx, sys.modules[target], on_class))
        ctx.set_config({"BaseTransform.bev_pool": "loongkit::bev_pool",
                        "BaseTransform.get_geometry": "two batched matmuls per call (per-camera affines)"})
        ctx.log.info("watching registrations for BEVFusion view transforms", registry=target)

    def _patch_pool(self, ctx: ActivationContext, base: type) -> None:
        import torch

        from loongkit_ops.kernels.ops import bev_pool as pool_op

        original = base.__dict__[POOL]
        record = ctx.record

        def bev_pool(self: Any, geom_feats: Any, x: Any) -> Any:
            if not (isinstance(x, torch.Tensor) and isinstance(geom_feats, torch.Tensor) and x.dim() == 6
                    and pool_op.backend(x)[0] == "cpu" and all(hasattr(self, a) for a in ("bx", "dx", "nx"))):
                return original(self, geom_feats, x)
            record.calls += 1
            B, N, D, H, W, C = x.shape
            n = B * N * D * H * W
            # The same quantisation as upstream (truncation toward zero, in the geometry's dtype).
            voxels = ((geom_feats - (self.bx - self.dx / 2.0)) / self.dx).long().view(n, 3)
            batch = torch.arange(B, device=x.device).repeat_interleave(n // B)[:, None]
            coords = torch.cat([voxels, batch], 1)
            nx = [int(v) for v in self.nx]
            out = pool_op.op(x.reshape(n, C), coords, B, nx[2], nx[0], nx[1])
            return torch.cat(out.unbind(dim=2), 1)

        bev_pool.__doc__ = original.__doc__
        bev_pool.__wrapped__ = original  # type: ignore[attr-defined]
        ctx.patcher.patch(base, POOL, bev_pool)

    def _patch_geometry(self, ctx: ActivationContext, base: type) -> None:
        original = base.__dict__[GEOMETRY]
        record = ctx.record

        def get_geometry(self: Any, camera2lidar_rots: Any, camera2lidar_trans: Any, intrins: Any, post_rots: Any,
                         post_trans: Any, **kwargs: Any) -> Any:
            args = (camera2lidar_rots, camera2lidar_trans, intrins, post_rots, post_trans)
            frustum = getattr(self, "frustum", None)
            if not _geometry_inputs_ok(frustum, args, kwargs):
                return original(self, *args, **kwargs)
            record.calls += 1
            return folded_geometry(frustum, *args, kwargs.get("extra_rots"), kwargs.get("extra_trans"))

        get_geometry.__doc__ = original.__doc__
        get_geometry.__wrapped__ = original  # type: ignore[attr-defined]
        ctx.patcher.patch(base, GEOMETRY, get_geometry)

    def deactivate(self, ctx: ActivationContext) -> None:
        for subscription in self.__dict__.pop("_subscriptions", []):
            stop(subscription)
        self._seen = {}
        super().deactivate(ctx)
