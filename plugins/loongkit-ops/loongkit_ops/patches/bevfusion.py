"""LOONGKIT_BEVFUSION: BEVFusion's camera-to-BEV on the fused ``loongkit::bev_pool`` op; ``get_geometry``
without per-point matrices, bit for bit upstream's.

BEVFusion is vendored, not installed; its view transforms (``LSSTransform``, ``DepthLSSTransform``,
...) register in mmcv / mmengine registries and inherit ``get_geometry`` and ``bev_pool`` from
``BaseTransform``. When a registered class has such a base (found through the registry hook,
:mod:`.registry`), each of the base's two methods is checked and, if it is upstream's, replaced
(class attribute, undone on deactivation); a method whose interface differs is left alone with its
reason, without preventing the other.

``bev_pool``: upstream's method quantises the frustum points to voxels (``((g - (bx - dx/2)) /
dx).long()``, truncation toward zero kept), appends the batch index, drops points outside the grid,
then calls the extension's ``bev_pool`` (a sort by voxel rank plus an interval sum, CUDA only) and
concatenates the Z slices. The patched method computes the same voxels and calls the fused op,
which drops out-of-grid points itself and sums per voxel without sorting; the gradient is a gather.
Inputs the kernel does not take (CUDA, fp16) run the original method (and its ``force_fp32``).

``get_geometry``: upstream maps every frustum point (u, v, d) of every camera through three
broadcast 3x3 matmuls on ``[B, N, D, H, W, 3, 1]`` tensors (each matrix copied per point): undo the
image augmentation (``inverse(post_rots) @ (p - post_trans)``), scale (u, v) by the depth, apply
``camera2lidar_rots @ inverse(intrins)`` and add ``camera2lidar_trans``, then the optional lidar
augmentation (``extra_rots @ p``, ``+ extra_trans``). On CPU those matmuls run torch's small-matrix
bmm kernel, which forms each coordinate as ``((0 + m0*p0) + m1*p1) + m2*p2``: one rounding per
product and per sum, no fused multiply-add. The patched method performs the same products and sums
of the same operands in the same order, as elementwise ops on coordinate planes, in chunks of
cameras x depth bins (matrices kept per camera); when the frustum is upstream's grid (u per column, v per row, d per
depth bin) the first stage's products are taken once per column, row and bin. What holds: the
result is upstream's bit for bit, float32 and float64, voxels included (a zero keeps upstream's
sign: translations are added as ``t + 0.0``). Because that rests on how the installed torch rounds,
the method first checks it, once per dtype and set of keyword arguments, against upstream's own
method on a small random rig, and runs upstream's from then on should they differ. CUDA tensors
(cuBLAS rounds otherwise), other or mixed dtypes, other shapes and inputs that need gradients run
the original.
"""

from __future__ import annotations

import inspect
import sys
import types
import weakref
from collections.abc import Sequence
from typing import Any

from loongkit_core.context import ActivationContext
from loongkit_core.kit import FeatureImpl
from loongkit_ops.patches.registry import watch_registrations

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
# self_check's answers: upstream function -> {(dtype, keyword args): None or why not}.
_CHECKED: weakref.WeakKeyDictionary[Any, dict[tuple[Any, tuple[str, ...]], str | None]] = weakref.WeakKeyDictionary()
# Points per chunk of exact_geometry: the dozen live coordinate planes stay in the caches, and no op
# exceeds torch's parallel grain (at::internal::GRAIN_SIZE, 32768 elements).
CHUNK = 1 << 15


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


def _dot(row: Sequence[Any], planes: Sequence[Any]) -> Any:
    """``row[0]*planes[0] + row[1]*planes[1] + row[2]*planes[2]``, left to right, each op rounded (no FMA)."""
    acc = planes[0] * row[0]
    acc += planes[1] * row[1]
    acc += planes[2] * row[2]
    return acc


def _grid_axes(frustum: Any, chunk: int = CHUNK) -> tuple[Any, Any, Any] | None:
    """(u [W], v [H], d [D]) when ``frustum[d, h, w]`` is bit for bit (u[w], v[h], d[d]), as upstream makes it.

    Checked at every call (a frustum can change in place unseen, through ``.data``), in slices of at
    most ``chunk`` points: serial ops, no OpenMP region to wake.
    """
    import torch

    D, H, W = frustum.shape[:3]
    bits = torch.int32 if frustum.dtype == torch.float32 else torch.int64
    u, v, d = frustum[0, 0, :, 0], frustum[0, :, 0, 1], frustum[:, 0, 0, 2]
    ub, vb, db = u.view(bits)[None, None, :], v.view(bits)[None, :, None], d.view(bits)[:, None, None]
    step = max(1, chunk // (H * W))
    for d0 in range(0, D, step):
        part = frustum[d0:d0 + step].view(bits)
        if not bool(((part[..., 0] == ub) & (part[..., 1] == vb) & (part[..., 2] == db[d0:d0 + step])).all()):
            return None
    return u, v, d


def exact_geometry(frustum: Any, camera2lidar_rots: Any, camera2lidar_trans: Any, intrins: Any, post_rots: Any,
                   post_trans: Any, extra_rots: Any = None, extra_trans: Any = None, chunk: int = CHUNK) -> Any:
    """``[B, N, D, H, W, 3]`` lidar-frame points of the frustum ``[D, H, W, 3]``: upstream's float operations.

    Per camera and point, in upstream's order (each line one rounding per product and per sum):
    p = frustum - post_trans; q = inverse(post_rots) . p; r = (q0 q2, q1 q2, q2);
    s = (camera2lidar_rots @ inverse(intrins)) . r + camera2lidar_trans; then, when given,
    s = extra_rots . s and s + extra_trans; where m . p is ((0 + m_i0 p0) + m_i1 p1) + m_i2 p2.
    The matrix inverses and the 3x3 product are upstream's own calls on the same tensors. The
    leading ``0 +`` only turns a -0 sum into +0; its effect is reproduced by adding the translations
    as ``t + 0.0`` (x + t equals (0 + x) + t for every x once t is not -0), and by a final ``+ 0.0``
    after ``extra_rots`` when no ``extra_trans`` follows. Works on chunks of whole cameras x depth bins
    of at most ``chunk`` points (or one camera's bin): cache-resident, and at most torch's parallel
    grain, so each op runs inline (an OpenMP region per op costs more than the op when cores are busy).
    """
    import torch

    B, N = camera2lidar_trans.shape[:2]
    D, H, W = frustum.shape[:3]
    bn = B * N

    def coefficients(m: Any) -> Any:  # [B, N, ...] -> [k, bn, 1, 1, 1]: entry k of every camera's matrix
        return m.reshape(bn, -1).T.reshape(-1, bn, 1, 1, 1)

    undo = torch.inverse(post_rots).reshape(bn, 3, 3)
    shift = post_trans.reshape(bn, 3)
    # Per-camera factors, as [k, bn, 1, 1, 1] stacks: combine, camera2lidar_trans (+0: see above), lidar.
    factors = [coefficients(camera2lidar_rots.matmul(torch.inverse(intrins))), coefficients(camera2lidar_trans + 0.0)]
    if extra_rots is not None:
        factors.append(coefficients(extra_rots[:, None].expand(B, N, 3, 3)))
    if extra_trans is not None:
        factors.append(coefficients(extra_trans[:, None].expand(B, N, 3) + 0.0))
    axes = _grid_axes(frustum)
    if axes is not None:  # stage 1's products once per column, row and depth bin; its two sums per chunk
        p = [axis[None] - shift[:, k, None] for k, axis in enumerate(axes)]  # [bn, W], [bn, H], [bn, D]
        rows = [(undo[:, i, 0, None] * p[0])[:, None, None, :] + (undo[:, i, 1, None] * p[1])[:, None, :, None]
                for i in range(3)]  # [bn, 1, H, W]
        bins = [(undo[:, i, 2, None] * p[2])[:, :, None, None] for i in range(3)]  # [bn, D, 1, 1]
    else:
        factors += [coefficients(undo), coefficients(shift)]
    out = frustum.new_empty(bn, D, H, W, 3)
    cams = max(1, min(bn, chunk // (H * W)))
    step = max(1, chunk // (cams * H * W))
    for c0 in range(0, bn, cams):
        c1 = min(bn, c0 + cams)
        f = [m[:, c0:c1].unbind(0) for m in factors]  # this chunk's cameras: one [cams, 1, 1, 1] per entry
        combine, trans = f[0], f[1]
        lidar = f[2] if extra_rots is not None else None
        lidar_trans = f[2 + (extra_rots is not None)] if extra_trans is not None else None
        for d0 in range(0, D, step):
            d1 = min(D, d0 + step)
            if axes is not None:
                q = [rows[i][c0:c1] + bins[i][c0:c1, d0:d1] for i in range(3)]
            else:
                undo_c, shift_c = f[-2], f[-1]
                part = frustum[d0:d1]
                p = [part[None, ..., k] - shift_c[k] for k in range(3)]  # [cams, bins, H, W]
                q = [_dot(undo_c[3 * i:3 * i + 3], p) for i in range(3)]
            q[0] *= q[2]
            q[1] *= q[2]
            pts = [_dot(combine[3 * i:3 * i + 3], q).add_(trans[i]) for i in range(3)]
            if lidar is not None:
                pts = [_dot(lidar[3 * i:3 * i + 3], pts) for i in range(3)]
            chunk_out = out[c0:c1, d0:d1]
            for i in range(3):
                if lidar_trans is not None:
                    torch.add(pts[i], lidar_trans[i], out=chunk_out[..., i])
                elif lidar is not None:
                    torch.add(pts[i], 0.0, out=chunk_out[..., i])
                else:
                    chunk_out[..., i] = pts[i]
    return out.view(B, N, D, H, W, 3)


def geometry_fallback(frustum: Any, args: tuple, kwargs: dict) -> str | None:
    """Why a call must run upstream's method (None: exact_geometry takes it)."""
    import torch

    rots, trans, intrins, post_rots, post_trans = args
    extra = [kwargs[k] for k in GEOMETRY_KWARGS if k in kwargs]
    tensors = [frustum, rots, trans, intrins, post_rots, post_trans, *extra]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "get_geometry: an input is not a tensor"
    if any(t.device.type != "cpu" for t in tensors):
        return "get_geometry: not CPU tensors (upstream's matmuls round as that device's kernels do)"
    if frustum.dtype not in (torch.float32, torch.float64) or any(t.dtype != frustum.dtype for t in tensors):
        return "get_geometry: not all float32 or all float64"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "get_geometry: inputs require grad"
    if frustum.dim() != 4 or frustum.shape[3] != 3 or trans.dim() != 3 or trans.shape[2] != 3:
        return "get_geometry: shapes differ from upstream's"
    B, N = trans.shape[:2]
    shapes = [(rots, (B, N, 3, 3)), (intrins, (B, N, 3, 3)), (post_rots, (B, N, 3, 3)), (post_trans, (B, N, 3))]
    if "extra_rots" in kwargs:
        shapes.append((kwargs["extra_rots"], (B, 3, 3)))
    if "extra_trans" in kwargs:
        shapes.append((kwargs["extra_trans"], (B, 3)))
    if not all(tuple(t.shape) == s for t, s in shapes):
        return "get_geometry: shapes differ from upstream's"
    return None


def self_check(original: Any, dtype: Any, keys: tuple[str, ...]) -> str | None:
    """None when exact_geometry reproduces ``original`` (upstream's method) bit for bit on a small random
    rig in ``dtype`` with the keyword arguments ``keys``, grid frustum and not, several chunks; else why."""
    import torch

    gen = torch.Generator().manual_seed(0)
    B, N, D, H, W = 2, 3, 4, 5, 7

    def rand(*shape: int, scale: float = 1.0, offset: float = 0.0) -> Any:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + offset).to(dtype)

    eye = torch.eye(3, dtype=dtype)
    args = (rand(B, N, 3, 3), rand(B, N, 3), rand(B, N, 3, 3) + 4 * eye, rand(B, N, 3, 3) + 2 * eye,
            rand(B, N, 3, scale=20))
    kwargs = {k: rand(B, 3, 3) if k == "extra_rots" else rand(B, 3) for k in keys}
    axes = (rand(1, 1, W, scale=200, offset=300), rand(1, H, 1, scale=100, offset=200),
            rand(D, 1, 1, scale=10, offset=30))
    grid = torch.stack(torch.broadcast_tensors(*axes), -1)
    fn = inspect.unwrap(original)  # past force_fp32: no nn.Module needed, the inputs are already in dtype
    for frustum in (grid, grid + rand(D, H, W, 3, scale=1e-3)):
        try:
            theirs = fn(types.SimpleNamespace(frustum=frustum), *args, **kwargs)
            # chunks of 2 cameras x 1 depth bin: both chunk loops run
            mine = exact_geometry(frustum, *args, *(kwargs.get(k) for k in GEOMETRY_KWARGS), chunk=2 * H * W)
        except Exception as exc:  # upstream's code misbehaving on a plain object: keep it
            return f"get_geometry: self-check raised {type(exc).__name__}"
        bits = torch.int32 if dtype == torch.float32 else torch.int64
        if theirs.shape != mine.shape or not torch.equal(theirs.contiguous().view(bits), mine.view(bits)):
            return "get_geometry: this torch build's matmul rounds otherwise (self-check)"
    return None


class BevFusionPool(FeatureImpl):
    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        assert target is not None
        from loongkit_ops import kernels

        # Shared by both registry targets; forgotten at undo so a new activation patches again.
        scratch = ctx.scratch
        if not hasattr(scratch, "seen"):
            scratch.seen, scratch.patched, scratch.skipped = {}, [], {}
        seen: dict[type, dict[str, str]] = scratch.seen
        done: list[str] = scratch.patched
        skipped: dict[str, str] = scratch.skipped

        def skip(where: str, problem: str) -> None:
            skipped[where] = problem
            ctx.detail("skipped", dict(skipped))
            if not done:  # nothing patched yet: the feature has no effect so far
                ctx.not_applicable(problem)
            ctx.log.warning("BEVFusion method left unpatched", method=where, reason=problem)

        def patched(where: str, what: str, via: str) -> None:
            ctx.applied()  # after a not_applicable for an earlier base
            if where not in done:
                done.append(where)
            ctx.detail("patched", list(done))
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
                patched(f"{where}.{GEOMETRY}", "get_geometry without per-point matrices (bit for bit)",
                        cls.__qualname__)

        # one subscription per target registry module (mmengine's and mmcv 1.x's), ended by the undo
        watch_registrations(ctx, sys.modules[target], on_class)
        ctx.set_config({"BaseTransform.bev_pool": "loongkit::bev_pool",
                        "BaseTransform.get_geometry": "upstream's float ops without per-point matrices (bit for bit)"})
        ctx.log.info("watching registrations for BEVFusion view transforms", registry=target)

    def _patch_pool(self, ctx: ActivationContext, base: type) -> None:
        import torch

        from loongkit_ops.kernels.ops import bev_pool as pool_op

        original = base.__dict__[POOL]
        count, fallback = ctx.count, ctx.fallback

        def bev_pool(self: Any, geom_feats: Any, x: Any) -> Any:
            if not (isinstance(x, torch.Tensor) and isinstance(geom_feats, torch.Tensor) and x.dim() == 6
                    and all(hasattr(self, a) for a in ("bx", "dx", "nx"))):
                fallback("bev_pool: inputs differ from upstream's")
                return original(self, geom_feats, x)
            which, why = pool_op.backend(x)
            if which != "cpu":
                fallback(f"bev_pool: {why or 'CUDA tensors: upstream extension'}")
                return original(self, geom_feats, x)
            count()
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
        count, fallback = ctx.count, ctx.fallback
        # (dtype, keyword args) -> self_check's answer, per upstream function: once per process, not per
        # activation (the answer depends only on the function and the torch build)
        checked = _CHECKED.setdefault(inspect.unwrap(original), {})

        def get_geometry(self: Any, camera2lidar_rots: Any, camera2lidar_trans: Any, intrins: Any, post_rots: Any,
                         post_trans: Any, **kwargs: Any) -> Any:
            args = (camera2lidar_rots, camera2lidar_trans, intrins, post_rots, post_trans)
            frustum = getattr(self, "frustum", None)
            why = geometry_fallback(frustum, args, kwargs)
            if why is None:
                key = (frustum.dtype, tuple(k for k in GEOMETRY_KWARGS if k in kwargs))
                if key not in checked:
                    checked[key] = self_check(original, *key)
                why = checked[key]
            if why is not None:
                fallback(why)
                return original(self, *args, **kwargs)
            count()
            return exact_geometry(frustum, *args, kwargs.get("extra_rots"), kwargs.get("extra_trans"))

        get_geometry.__doc__ = original.__doc__
        get_geometry.__wrapped__ = original  # type: ignore[attr-defined]
        ctx.patcher.patch(base, GEOMETRY, get_geometry)
