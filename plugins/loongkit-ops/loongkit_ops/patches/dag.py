"""LOONGKIT_DAG: Sparse4D / SparseDrive ``DeformableFeatureAggregation`` on the fused op.

Users vendor Sparse4D as ``projects/mmdet3d_plugin`` and its ``DeformableFeatureAggregation``
registers itself (``@ATTENTION.register_module()`` on mmcv 1.x, ``MODELS`` on mmengine). The
feature wraps the registries' ``_register_module`` (:mod:`.registry`); when a class of that
name is registered, its interface is checked and its ``forward`` replaced (class attribute, undone
by the default deactivation, as the registry subscription is).

Upstream's forward has two aggregation paths, and the patched forward keeps each one's maths:
- ``use_deformable_func=True`` (CUDA extension): ``DAF(mc_ms_feat, spatial_shape,
  scale_start_index, points_2d, weights)``, whose kernel drops a sample not strictly inside (0, 1):
  ``loongkit::deformable_aggregation`` with ``inside_only=True``.
- otherwise (what runs on CPU): one ``grid_sample`` per level into a [bs, anchors, cams, levels, pts,
  C] tensor, weighted per group and summed over cameras, levels and points: the same op with
  ``inside_only=False`` (grid_sample's per-corner rule) on the maps flattened camera-major into
  [bs, cams * sum(H*W), C]. The big intermediate and its backward disappear.
Everything else is the module's own code, called as upstream calls it: ``kps_generator``,
``_get_weights`` (so attention dropout draws the same random numbers), ``project_points``,
``output_proj``, ``proj_drop``, the residual.

Interface check (at registration): forward's parameters, the exact set of names upstream's forward
uses (a fork that adds a step there is left alone), ``feature_sampling`` calling ``grid_sample``
with its defaults only, ``multi_view_level_fusion`` doing only the weighted sums, and the
constructor's arguments; otherwise "not applicable: interface differs: ...". Calls whose tensors
no kernel takes (fp16 on CPU, no triton on CUDA) or whose feature maps are not in the expected form
run the original forward.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from loongkit_core.context import ActivationContext
from loongkit_core.kit import FeatureImpl
from loongkit_ops.patches.registry import watch_registrations

CLASS_NAME = "DeformableFeatureAggregation"
FORWARD_PARAMS = ["self", "instance_feature", "anchor", "anchor_embed", "feature_maps", "metas", "kwargs"]
# Every global and attribute name upstream's forward uses (Sparse4D v3 and SparseDrive alike).
FORWARD_NAMES = frozenset({
    "shape", "kps_generator", "_get_weights", "use_deformable_func", "project_points", "get", "permute", "reshape",
    "num_pts", "num_cams", "contiguous", "num_levels", "num_groups", "DAF", "embed_dims", "feature_sampling",
    "multi_view_level_fusion", "sum", "proj_drop", "output_proj", "residual_mode", "torch", "cat"})
FORWARD_REQUIRED = frozenset({"kps_generator", "_get_weights", "project_points", "feature_sampling",
                              "multi_view_level_fusion", "output_proj", "proj_drop", "residual_mode",
                              "use_deformable_func"})
SAMPLING_PARAMS = ["feature_maps", "key_points", "projection_mat", "image_wh"]
SAMPLING_NAMES = frozenset({"len", "shape", CLASS_NAME, "project_points", "flatten", "append", "torch", "nn",
                            "functional", "grid_sample", "stack", "reshape", "permute"})
FUSION_PARAMS = ["self", "features", "weights"]
FUSION_NAMES = frozenset({"shape", "reshape", "num_groups", "group_dims", "sum", "num_pts", "embed_dims"})
INIT_PARAMS = ("embed_dims", "num_groups", "num_levels", "num_cams", "use_deformable_func", "residual_mode")
GRID_SAMPLE_OPTIONS = {"mode", "padding_mode", "align_corners"}
ATTRIBUTES = ("num_cams", "num_levels", "num_pts", "num_groups", "embed_dims", "use_deformable_func",
              "residual_mode", "kps_generator", "output_proj", "proj_drop")


def _params(fn: Any) -> list[str] | None:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _const_strings(code: Any) -> set[str]:
    found: set[str] = set()
    for const in code.co_consts:
        if isinstance(const, str):
            found.add(const)
        elif isinstance(const, tuple):
            found.update(c for c in const if isinstance(c, str))
    return found


def interface_problem(cls: type) -> str | None:
    """None when ``cls`` looks like upstream's DeformableFeatureAggregation, else what differs."""
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    if code is None or _params(forward) != FORWARD_PARAMS:
        return f"interface differs: {CLASS_NAME}.forward{tuple(_params(forward) or ())}"
    names = set(code.co_names)
    if not names >= FORWARD_REQUIRED:
        return f"interface differs: {CLASS_NAME}.forward does not use {sorted(FORWARD_REQUIRED - names)}"
    if not names <= FORWARD_NAMES:
        return f"interface differs: {CLASS_NAME}.forward also uses {sorted(names - FORWARD_NAMES)}"
    sampling = inspect.getattr_static(cls, "feature_sampling", None)
    sampling = getattr(sampling, "__func__", sampling)  # staticmethod upstream
    scode = getattr(sampling, "__code__", None)
    if scode is None or _params(sampling) != SAMPLING_PARAMS:
        return f"interface differs: {CLASS_NAME}.feature_sampling{tuple(_params(sampling) or ())}"
    if "grid_sample" not in scode.co_names or not set(scode.co_names) <= SAMPLING_NAMES:
        return f"interface differs: {CLASS_NAME}.feature_sampling uses {sorted(set(scode.co_names) - SAMPLING_NAMES)}"
    if GRID_SAMPLE_OPTIONS & _const_strings(scode):
        return f"interface differs: {CLASS_NAME}.feature_sampling passes grid_sample options"
    fusion = getattr(cls, "multi_view_level_fusion", None)
    fcode = getattr(fusion, "__code__", None)
    if fcode is None or _params(fusion) != FUSION_PARAMS or not set(fcode.co_names) <= FUSION_NAMES:
        return f"interface differs: {CLASS_NAME}.multi_view_level_fusion is not the weighted sum"
    for method in ("_get_weights", "project_points"):
        if not callable(getattr(cls, method, None)):
            return f"interface differs: {CLASS_NAME} has no {method}"
    init = _params(cls.__init__) or []
    missing = [p for p in INIT_PARAMS if p not in init]
    if missing:
        return f"interface differs: {CLASS_NAME}.__init__ lacks {missing}"
    return None


def _fused_inputs(module: Any, feature_maps: Any, daf: Any, torch: Any) -> tuple[Any, ...] | None:
    """(mc_ms_feat, spatial_shape, scale_start_index, inside_only) for the op, or None: run the original."""
    if not all(hasattr(module, a) for a in ATTRIBUTES) or not isinstance(feature_maps, list | tuple):
        return None
    if module.use_deformable_func:
        if len(feature_maps) != 3 or not all(isinstance(t, torch.Tensor) for t in feature_maps):
            return None
        feat, shapes, starts = feature_maps
        if feat.dim() != 3 or shapes.dim() != 3 or daf.backend(feat)[0] == "reference":
            return None
        return feat, shapes, starts, True
    if (len(feature_maps) != module.num_levels or not all(isinstance(t, torch.Tensor) and t.dim() == 5
                                                          for t in feature_maps)):
        return None
    bs, cams, c = feature_maps[0].shape[:3]
    if cams != module.num_cams or any(t.shape[:3] != (bs, cams, c) for t in feature_maps):
        return None
    if daf.backend(feature_maps[0])[0] == "reference" or any(t.dtype != feature_maps[0].dtype
                                                                  for t in feature_maps):
        return None
    # [bs, cams, C, H, W] per level -> [bs, cams * sum(H*W), C]: camera-major, then level, row-major.
    # One copy: cat writes the transposed levels straight into the channels-last result.
    feat = torch.cat([t.flatten(3).transpose(2, 3) for t in feature_maps], dim=2).reshape(bs, -1, c)
    hw = [(int(t.shape[3]), int(t.shape[4])) for t in feature_maps]
    shapes = torch.tensor([hw] * cams, dtype=torch.int64, device=feat.device)
    offsets = [0]
    for h, w in hw[:-1]:
        offsets.append(offsets[-1] + h * w)
    per_cam = offsets[-1] + hw[-1][0] * hw[-1][1]
    starts = torch.tensor([[cam * per_cam + o for o in offsets] for cam in range(cams)], dtype=torch.int64,
                          device=feat.device)
    return feat, shapes, starts, False


class SparseDAG(FeatureImpl):
    def activate(self, ctx: ActivationContext, target: str | None) -> None:
        assert target is not None
        from loongkit_ops import kernels

        # Shared by both registry targets (mmengine's and mmcv 1.x's); forgotten at undo, so a later
        # activation checks and patches every class again.
        patched: dict[type, str] | None = getattr(ctx.scratch, "patched", None)
        if patched is None:
            patched = ctx.scratch.patched = {}
        details = ctx.record.details  # read only: the JSON's lists are written through ctx.detail

        def on_class(cls: type) -> None:
            if cls.__name__ != CLASS_NAME or cls in patched:
                return
            problem = interface_problem(cls)
            if problem is None and kernels.load() is None:
                # Built here, when a matching class registers, not when the registry is imported
                # (every OpenMMLab program imports it).
                problem = f"CPU kernel unavailable: {kernels.failure()}"
            where = f"{cls.__module__}.{cls.__qualname__}"
            if problem:
                patched[cls] = problem
                ctx.detail("skipped", {**details.get("skipped", {}), where: problem})  # type: ignore[dict-item]
                if not any(v == "patched" for v in patched.values()):
                    ctx.not_applicable(problem)
                ctx.log.warning("DeformableFeatureAggregation left unpatched", cls=where, reason=problem)
                return
            self._patch(ctx, cls)
            patched[cls] = "patched"
            ctx.applied()  # an earlier class may have differed; this one is patched
            done = list(details.get("patched", []))  # type: ignore[call-overload]
            ctx.detail("patched", done if where in done else [*done, where])  # once, however often activated
            ctx.log.info("DeformableFeatureAggregation uses the fused deformable aggregation", cls=where)

        watch_registrations(ctx, sys.modules[target], on_class)  # ends at ctx.patcher.undo()
        ctx.set_config({CLASS_NAME: "loongkit::deformable_aggregation"})
        ctx.log.info("watching registrations for DeformableFeatureAggregation", registry=target)

    def _patch(self, ctx: ActivationContext, cls: type) -> None:
        import torch

        from loongkit_ops.kernels.ops import daf

        original = cls.forward
        count = ctx.count

        def forward(self: Any, instance_feature: Any, anchor: Any, anchor_embed: Any, feature_maps: Any, metas: Any,
                    **kwargs: Any) -> Any:
            plan = _fused_inputs(self, feature_maps, daf, torch)
            if plan is None:
                return original(self, instance_feature, anchor, anchor_embed, feature_maps, metas, **kwargs)
            feat, shapes, starts, inside_only = plan
            count()
            bs, num_anchor = instance_feature.shape[:2]
            key_points = self.kps_generator(anchor, instance_feature)
            weights = self._get_weights(instance_feature, anchor_embed, metas)
            points_2d = (self.project_points(key_points, metas["projection_mat"], metas.get("image_wh"))
                         .permute(0, 2, 3, 1, 4).reshape(bs, num_anchor, self.num_pts, self.num_cams, 2))
            weights = weights.permute(0, 1, 4, 2, 3, 5).reshape(bs, num_anchor, self.num_pts, self.num_cams,
                                                                 self.num_levels, self.num_groups)
            features = daf.deformable_aggregation(feat, shapes, starts, points_2d, weights, inside_only)
            output = self.proj_drop(self.output_proj(features.reshape(bs, num_anchor, self.embed_dims)))
            if self.residual_mode == "add":
                output = output + instance_feature
            elif self.residual_mode == "cat":
                output = torch.cat([output, instance_feature], dim=-1)
            return output

        forward.__doc__ = original.__doc__
        forward.__wrapped__ = original  # type: ignore[attr-defined]
        ctx.patcher.patch(cls, "forward", forward)
