"""LOONGKIT_BEVFORMER: BEVFormer's attention modules, found where they are registered.

BEVFormer (and UniAD, which vendors its encoder) lives in the user's tree as
``projects/mmdet3d_plugin/bevformer/modules/*.py``; its classes register themselves in mmcv 1.x's
``ATTENTION`` registry (or mmengine's ``MODELS`` in 2.x ports). :mod:`.registry_watch` reports every
registration; a class whose name is one of :data:`SPECS` is checked against the upstream interface
(forward parameters, ``__init__`` parameters that create the attributes the maths uses, names the
forward references) and patched, or left alone with "interface differs: ..." in the Summary.

- ``SpatialCrossAttention``: the forward is replaced by :func:`make_sca_forward`: the queries each
  camera sees are gathered for all cameras at once and the results scattered back with one
  ``index_add`` (upstream: a Python loop over cameras and batch, one ``nonzero`` host sync per
  camera; here one sync, for the packed length). The inner ``deformable_attention`` is called once,
  exactly as upstream calls it (same tensors, same layout), so whatever module it is keeps working.
- ``MSDeformableAttention3D``, ``TemporalSelfAttention``, ``CustomMSDeformableAttention`` (and
  UniAD's ``MotionDeformableAttention``): their CPU path calls ``multi_scale_deformable_attn_pytorch``
  from their own module's globals (imported from mmcv when the project was imported). That global
  is swapped for the dispatcher of :mod:`.msda` (float32/float64 CPU -> ``loongkit::ms_deform_attn``,
  otherwise the original), so the modules' own maths, layouts and batch behaviour stay upstream's
  line for line and only the sampling kernel changes.

Batch size > 1, derived from upstream's SCA: the queries a camera sees are taken from the mask of
sample 0 (``mask_per_img[0]``) for every sample of the batch, while the normaliser (how many cameras
see a query) uses each sample's own mask. BEVFormer hands the deformable attention key/value rows in
camera-major order (``permute(0, 2, 1, 3).view``) while its queries are batch-major, so for bs > 1
sample j / camera i attends to the features of another (camera, sample) row; UniAD's copy reorders
key/value batch-major (``permute(2, 0, 1, 3).reshape``). The fast path reproduces whichever of the two
the class's source shows; a forward whose source shows neither (or cannot be read) runs the original
for bs > 1 (bs == 1 is the same in all of them). Results therefore equal upstream for every batch
size; a "per-sample" fix would change what models train to, and is not this feature's call.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loongkit_core.context import ActivationContext, NotApplicable
from loongkit_ops.patches import registry_watch
from loongkit_ops.patches.msda import FUNCTION, TARGET, BevformerMSDA, function_problem, fused_dispatcher

REGISTRY_TARGETS = ("mmcv.utils.registry", "mmengine.registry.registry")


@dataclass(frozen=True)
class Spec:
    """What a registered class must look like for its patch: ``kind`` says which patch."""

    kind: str  # "sca": forward replaced; "msda": module global swapped; "collision": see uniad.py
    forward: tuple[str, ...]  # the forward's parameters, "**" for **kwargs
    init: tuple[str, ...]  # __init__ parameters that must exist (they make the attributes used)
    uses: tuple[str, ...]  # names the forward's code must reference


_MSDA_FORWARD = ("self", "query", "key", "value", "identity", "query_pos", "key_padding_mask",
                 "reference_points", "spatial_shapes", "level_start_index")
_MSDA_INIT = ("embed_dims", "num_heads", "num_levels", "num_points")
_MSDA_USES = ("sampling_offsets", "attention_weights", "value_proj", FUNCTION)

SPECS: dict[str, Spec] = {
    "SpatialCrossAttention": Spec(
        "sca",
        ("self", "query", "key", "value", "residual", "query_pos", "key_padding_mask", "reference_points",
         "spatial_shapes", "reference_points_cam", "bev_mask", "level_start_index", "flag", "**"),
        ("embed_dims", "num_cams", "deformable_attention"),
        ("nonzero", "deformable_attention", "output_proj", "num_cams", "embed_dims", "dropout")),
    "MSDeformableAttention3D": Spec("msda", (*_MSDA_FORWARD, "**"), _MSDA_INIT, _MSDA_USES),
    "TemporalSelfAttention": Spec("msda", (*_MSDA_FORWARD, "flag", "**"), (*_MSDA_INIT, "num_bev_queue"),
                                  (*_MSDA_USES, "output_proj")),
    "CustomMSDeformableAttention": Spec("msda", (*_MSDA_FORWARD, "flag", "**"), _MSDA_INIT,
                                        (*_MSDA_USES, "output_proj")),
}


def _params(fn: Any) -> tuple[str, ...]:
    params = inspect.signature(fn).parameters.values()
    return tuple("**" if p.kind is p.VAR_KEYWORD else "*" if p.kind is p.VAR_POSITIONAL else p.name for p in params)


def code_names(code: Any) -> set[str]:
    """Global/attribute names a code object and its nested ones (comprehensions, lambdas) use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= code_names(const)
    return names


def forward_function(cls: type) -> Any:
    """The class's forward without decorators (mmcv's force_fp32 / deprecated_api_warning use wraps)."""
    return inspect.unwrap(getattr(cls, "forward", None))


def interface_problem(name: str, cls: type, spec: Spec) -> str | None:
    """None when ``cls`` has the upstream interface ``spec`` describes, else what differs."""
    import torch

    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        return f"interface differs: {name} is not an nn.Module class"
    forward = forward_function(cls)
    code = getattr(forward, "__code__", None)
    if code is None:
        return f"interface differs: {name}.forward is not a Python function"
    try:
        fparams = _params(forward)
        iparams = set(_params(cls.__init__))
    except (TypeError, ValueError):
        return f"interface differs: cannot read {name}'s signatures"
    if fparams != spec.forward:
        return f"interface differs: {name}.forward{fparams}, expected {spec.forward}"
    missing = [p for p in spec.init if p not in iparams]
    if missing:
        return f"interface differs: {name}.__init__ lacks {missing}"
    used = code_names(code)
    unused = [n for n in spec.uses if n not in used]
    if unused:
        return f"interface differs: {name}.forward does not use {unused}"
    return None


# ------------------------------------------------------------------------------------------------
# SpatialCrossAttention


def sca_layout(forward: Any) -> str | None:
    """Which upstream batch layout the forward's source shows: 'camera-major' (BEVFormer),
    'batch-major' (UniAD) or None (unknown: bs > 1 then runs the original)."""
    try:
        compact = "".join(inspect.getsource(forward).split())
    except (OSError, TypeError):
        return None
    if "mask_per_img[0]" not in compact:
        return None
    if "key.permute(0,2,1,3).view(" in compact and "value.permute(0,2,1,3).view(" in compact:
        return "camera-major"
    if "key.permute(2,0,1,3).reshape(" in compact and "value.permute(2,0,1,3).reshape(" in compact:
        return "batch-major"
    return None


def _sca_fallback(module: Any, query: Any, key: Any, residual: Any, reference_points_cam: Any, bev_mask: Any,
                  layout: str | None) -> str | None:
    """Why this call must run the original forward (None: the fast path computes the same)."""
    import torch

    if residual is not None:
        return "residual given"  # upstream never defines slots then; let it fail as it does
    if getattr(module, "fp16_enabled", False):
        return "fp16_enabled (force_fp32 casts)"
    num_cams, embed_dims = getattr(module, "num_cams", None), getattr(module, "embed_dims", None)
    if not (isinstance(num_cams, int) and isinstance(embed_dims, int)
            and all(callable(getattr(module, a, None)) for a in ("deformable_attention", "output_proj", "dropout"))):
        return "instance lacks num_cams/embed_dims/deformable_attention/output_proj/dropout"
    if not all(isinstance(t, torch.Tensor) for t in (query, key, reference_points_cam, bev_mask)):
        return "missing tensors"
    if (query.dim() != 3 or key.dim() != 4 or reference_points_cam.dim() != 5 or bev_mask.dim() != 4
            or query.shape[-1] != embed_dims or bev_mask.shape[0] != num_cams
            or reference_points_cam.shape[0] != num_cams or bev_mask.shape[1] != query.shape[0]):
        return "unexpected shapes"
    if query.shape[0] > 1 and layout is None:
        return "batch > 1 with an unknown key/value layout"
    return None


def sca_fused(module: Any, query: Any, key: Any, value: Any, query_pos: Any, reference_points_cam: Any,
              bev_mask: Any, spatial_shapes: Any, level_start_index: Any, layout: str | None) -> Any:
    """SpatialCrossAttention.forward's maths with batched gather/scatter (see the module docstring)."""
    import torch

    if value is None:
        value = key
    inp_residual = query
    if query_pos is not None:
        query = query + query_pos
    bs, num_query, _ = query.shape
    num_cams, embed_dims = module.num_cams, module.embed_dims
    depth = reference_points_cam.size(3)

    # The queries each camera sees: those with any visible anchor in sample 0's mask (upstream rule).
    visible = bev_mask[:, 0].sum(-1) != 0  # [cams, Q]
    max_len = int(visible.sum(-1).max()) if num_query else 0  # the one host sync: the packed length
    # table[i, s] = s-th visible query of camera i, ascending like nonzero(); num_query marks padding.
    slot = visible.cumsum(-1) - 1 + torch.arange(num_cams, device=visible.device)[:, None] * max_len
    dump = num_cams * max_len
    target = torch.where(visible, slot, torch.full_like(slot, dump)).reshape(-1)
    queries_index = torch.arange(num_query, device=visible.device).repeat(num_cams)
    table = torch.full((dump + 1,), num_query, dtype=torch.int64, device=visible.device)
    table = table.scatter(0, target, queries_index)[:dump]  # the dump slot (invisible pairs) is dropped

    # Gather: padding reads an appended zero row, as upstream's zero-initialised buffers hold.
    query_pad = torch.cat([query, query.new_zeros(bs, 1, query.shape[-1])], 1)
    queries_rebatch = query_pad[:, table].reshape(bs * num_cams, max_len, embed_dims)
    ref_pad = torch.cat([reference_points_cam, reference_points_cam.new_zeros(num_cams, bs, 1, depth, 2)], 2)
    cams = torch.arange(num_cams, device=visible.device)[:, None]
    ref_rebatch = ref_pad.transpose(0, 1)[:, cams, table.view(num_cams, max_len)]
    ref_rebatch = ref_rebatch.reshape(bs * num_cams, max_len, depth, 2)

    _, length, key_bs, _ = key.shape
    if layout == "batch-major":
        key = key.permute(2, 0, 1, 3).reshape(key_bs * num_cams, length, embed_dims)
        value = value.permute(2, 0, 1, 3).reshape(key_bs * num_cams, length, embed_dims)
    else:  # camera-major, BEVFormer's (identical to batch-major when bs == 1)
        key = key.permute(0, 2, 1, 3).view(num_cams * key_bs, length, embed_dims)
        value = value.permute(0, 2, 1, 3).view(num_cams * key_bs, length, embed_dims)
    queries = module.deformable_attention(query=queries_rebatch, key=key, value=value, reference_points=ref_rebatch,
                                          spatial_shapes=spatial_shapes, level_start_index=level_start_index)

    # Scatter: index_add walks the index in order, so each query sums its cameras in camera order.
    out = queries.reshape(bs, num_cams * max_len, -1)
    slots = torch.zeros(bs, num_query + 1, out.shape[-1], dtype=inp_residual.dtype, device=inp_residual.device)
    slots = slots.index_add(1, table, out.to(slots.dtype))[:, :num_query]
    count = bev_mask.sum(-1) > 0
    count = count.permute(1, 2, 0).sum(-1)
    count = torch.clamp(count, min=1.0)
    slots = slots / count[..., None]
    slots = module.output_proj(slots)
    return module.dropout(slots) + inp_residual


def make_sca_forward(original: Any, layout: str | None, record: Any, on_fallback: Callable[[str], None]) -> Any:
    def forward(self: Any, query: Any, key: Any, value: Any, residual: Any = None, query_pos: Any = None,
                key_padding_mask: Any = None, reference_points: Any = None, spatial_shapes: Any = None,
                reference_points_cam: Any = None, bev_mask: Any = None, level_start_index: Any = None,
                flag: str = "encoder", **kwargs: Any) -> Any:
        why = _sca_fallback(self, query, key, residual, reference_points_cam, bev_mask, layout)
        if why is not None:
            on_fallback(why)
            return original(self, query, key, value, residual, query_pos, key_padding_mask, reference_points,
                            spatial_shapes, reference_points_cam, bev_mask, level_start_index, flag, **kwargs)
        record.calls += 1
        return sca_fused(self, query, key, value, query_pos, reference_points_cam, bev_mask, spatial_shapes,
                         level_start_index, layout)

    forward.__doc__ = getattr(original, "__doc__", None)
    forward.__loongkit_feature__ = record.feature.name  # type: ignore[attr-defined]
    forward.__loongkit_original__ = original  # type: ignore[attr-defined]
    return forward


# ------------------------------------------------------------------------------------------------
# The feature


class ModelClasses:
    """Watches the registries for ``specs`` and patches what matches; shared by BEVFORMER and UNIAD."""

    def __init__(self, ctx: ActivationContext, specs: dict[str, Spec],
                 patchers: dict[str, Callable[[str, type, Spec], str]]) -> None:
        self.ctx = ctx
        self.specs = specs
        self.patchers = patchers  # kind -> patch(name, cls, spec) returning what was done
        self.seen: set[type] = set()
        self.patched: dict[str, str] = {}
        self.problems: dict[str, str] = {}
        self.fallbacks: dict[str, int] = {}
        self.registries: list[type] = []

    def watch(self, module_name: str) -> None:
        module = sys.modules[module_name]
        registry_cls = getattr(module, "Registry", None)
        problem = registry_watch.registry_problem(registry_cls)
        if problem:  # not NotApplicable: that would also undo this feature's other targets
            self.problems[module_name] = f"registry hook not installed: {problem}"
            self.ctx.log.warning("registry not watched", target=module_name, reason=problem)
            self.refresh()
            return
        if registry_cls not in self.registries:
            registry_watch.subscribe(registry_cls, self.on_register, self.ctx.log)
            self.registries.append(registry_cls)
        for name, cls in registry_watch.registered_classes(registry_cls, frozenset(self.specs)):
            self.on_register(name, cls)
        self.ctx.log.info("watching registrations", registry=f"{registry_cls.__module__}.Registry",
                          classes=sorted(self.specs), patched=sorted(self.patched))
        self.refresh()

    def on_register(self, name: str, cls: type) -> None:
        spec = self.specs.get(name)
        if spec is None or cls in self.seen:
            return
        self.seen.add(cls)
        label = f"{name} ({cls.__module__})"
        owner = getattr(forward_function(cls), "__loongkit_feature__", None)
        if owner is not None:  # BEVFORMER and UNIAD watch the same classes: the first one patches
            self.patched[label] = f"patched by LOONGKIT_{str(owner).upper()}"
            self.refresh()
            return
        problem = interface_problem(name, cls, spec)
        if problem is None:
            try:
                done = self.patchers[spec.kind](name, cls, spec)
            except NotApplicable as exc:
                problem = str(exc)
            else:
                self.patched[label] = done
                self.problems.pop(label, None)
                self.ctx.log.info("model class patched", cls=label, how=done)
        if problem is not None:
            self.problems[label] = problem
            self.ctx.log.warning("model class not patched", cls=label, reason=problem)
        self.refresh()

    def on_fallback(self, why: str) -> None:
        if why not in self.fallbacks:
            self.ctx.log.info("original forward used for a call", reason=why)
        self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
        self.ctx.detail("fallbacks", dict(self.fallbacks))

    def refresh(self) -> None:
        """What the Summary shows: patched classes in the config, mismatches as the reason."""
        self.ctx.detail("patched", dict(self.patched))
        self.ctx.detail("not_applicable", dict(self.problems))
        self.ctx.record.reason = "; ".join(f"{k}: {v}" for k, v in self.problems.items())

    def close(self) -> None:
        registry_watch.unsubscribe(self.on_register)
        self.registries.clear()


class Bevformer(BevformerMSDA):
    """LOONGKIT_BEVFORMER: mmcv's MSDA (target mmcv.ops.multi_scale_deform_attn, :mod:`.msda`) and
    BEVFormer's registered attention classes (targets: the mmcv 1.x and mmengine registry modules)."""

    specs: dict[str, Spec] = SPECS

    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        if target == TARGET:
            super().activate(ctx, target)
            self.classes(ctx).refresh()
            return
        if target not in REGISTRY_TARGETS:
            raise NotApplicable(f"unknown target {target}")
        # No kernel build here: every OpenMMLab program imports the registries; the kernel is loaded
        # when a class that needs it registers (patch_msda), and SCA's gather/scatter needs none.
        self.classes(ctx).watch(target)

    def classes(self, ctx: ActivationContext) -> ModelClasses:
        found = getattr(self, "_classes", None)
        if found is None or found.ctx is not ctx:
            found = self._classes = ModelClasses(ctx, self.specs, self.patchers(ctx))
        return found

    def patchers(self, ctx: ActivationContext) -> dict[str, Callable[[str, type, Spec], str]]:
        return {"sca": lambda n, c, s: self.patch_sca(ctx, n, c), "msda": lambda n, c, s: self.patch_msda(ctx, n, c)}

    def patch_sca(self, ctx: ActivationContext, name: str, cls: type) -> str:
        original = cls.forward
        layout = sca_layout(forward_function(cls))
        forward = make_sca_forward(original, layout, ctx.record, self.classes(ctx).on_fallback)
        ctx.patcher.patch(cls, "forward", forward)
        return f"batched gather/scatter over cameras (batch>1 layout: {layout or 'unknown, original forward'})"

    def patch_msda(self, ctx: ActivationContext, name: str, cls: type) -> str:
        forward = forward_function(cls)
        namespace = forward.__globals__
        module = sys.modules.get(namespace.get("__name__", ""))
        if module is None or module.__dict__ is not namespace:
            raise NotApplicable(f"interface differs: {name}.forward's module is not importable")
        current = namespace.get(FUNCTION)
        if getattr(current, "__loongkit_original__", None) is not None:
            return f"{module.__name__}.{FUNCTION} already on loongkit::ms_deform_attn"
        problem = function_problem(current)
        if problem:
            raise NotApplicable(f"interface differs: {module.__name__}.{problem}")
        ctx.patcher.patch(module, FUNCTION, fused_dispatcher(current, ctx.record))  # kernel built at first call
        return f"{module.__name__}.{FUNCTION} -> loongkit::ms_deform_attn (CPU)"

    def deactivate(self, ctx: ActivationContext) -> None:
        found = getattr(self, "_classes", None)
        if found is not None:
            found.close()
            self._classes = None
        super().deactivate(ctx)
