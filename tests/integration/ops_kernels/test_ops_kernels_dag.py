"""LOONGKIT_DAG: a vendored Sparse4D-style DeformableFeatureAggregation, patched at registration.

The test writes a small ``projects/mmdet3d_plugin`` package (written for this project from the
published Sparse4D algorithm: same public interface and maths, no upstream code) that registers its
classes in mmengine's MODELS registry as a ported project does, activates the feature, imports the
package, and compares outputs and every gradient of the patched module with the same module's
original forward: fresh random inputs each run, Sparse4D v3 shapes (6 cameras, 4 levels 64x176 ..
8x22, 256 channels, 8 groups, 13 key points; fewer anchors), batch 1 and 2, both aggregation paths
(grid_sample on CPU; the CUDA extension's rule through a stand-in for ``DAF``).
"""

from __future__ import annotations

import importlib
import math
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.integration

registry_mod = pytest.importorskip("mmengine.registry.registry")

from loongkit_ops import kernels  # noqa: E402
from loongkit_ops.kernels import reference  # noqa: E402
from loongkit_ops.patches.dag import SparseDAG, interface_problem  # noqa: E402
from loongkit_ops.plugin import plugin  # noqa: E402

from loongkit_core.context import ActivationContext, NotApplicable  # noqa: E402
from loongkit_core.feature import FeatureRecord, State  # noqa: E402
from loongkit_core.log import get_logger  # noqa: E402

SEED = int(torch.seed() % 2**31)
TOL = {torch.float32: {"rtol": 2e-5, "atol": 2e-5}, torch.float64: {"rtol": 1e-10, "atol": 1e-10}}
LEVELS = [(64, 176), (32, 88), (16, 44), (8, 22)]

BLOCKS = textwrap.dedent('''
    """Sparse4D-style blocks written for loongkit's tests (interface and maths of the published model)."""
    from typing import List, Optional

    import torch
    from torch import nn
    from mmengine.model import BaseModule
    from mmengine.registry import MODELS

    DAF = None  # the CUDA extension; tests may install a stand-in


    @MODELS.register_module(force=True)
    class KeyPoints(BaseModule):
        """7 fixed key points on the box (centre, +-x, +-y, +-z faces) and learnable ones."""

        def __init__(self, embed_dims=256, num_learnable_pts=6):
            super().__init__()
            fixed = [[0, 0, 0], [0.45, 0, 0], [-0.45, 0, 0], [0, 0.45, 0], [0, -0.45, 0], [0, 0, 0.45],
                     [0, 0, -0.45]]
            self.register_buffer("fixed", torch.tensor(fixed, dtype=torch.float32))
            self.num_learnable_pts = num_learnable_pts
            self.num_pts = len(fixed) + num_learnable_pts
            self.learnable_fc = nn.Linear(embed_dims, num_learnable_pts * 3)

        def forward(self, anchor, instance_feature):
            bs, num_anchor = anchor.shape[:2]
            learned = self.learnable_fc(instance_feature).reshape(bs, num_anchor, self.num_learnable_pts, 3)
            scale = torch.cat([self.fixed.to(anchor.dtype).expand(bs, num_anchor, -1, -1),
                               learned.sigmoid() - 0.5], dim=2)
            pts = scale * anchor[:, :, None, 3:6].exp()
            sin, cos = anchor[:, :, None, 6], anchor[:, :, None, 7]
            x = cos * pts[..., 0] - sin * pts[..., 1]
            y = sin * pts[..., 0] + cos * pts[..., 1]
            return torch.stack([x, y, pts[..., 2]], -1) + anchor[:, :, None, :3]


    @MODELS.register_module(force=True)
    class DeformableFeatureAggregation(BaseModule):
        def __init__(self, embed_dims=256, num_groups=8, num_levels=4, num_cams=6, proj_drop=0.0, attn_drop=0.0,
                     kps_generator=None, temporal_fusion_module=None, use_temporal_anchor_embed=True,
                     use_deformable_func=False, use_camera_embed=False, residual_mode="add"):
            super().__init__()
            self.group_dims = embed_dims // num_groups
            self.embed_dims = embed_dims
            self.num_levels = num_levels
            self.num_groups = num_groups
            self.num_cams = num_cams
            self.use_deformable_func = use_deformable_func
            self.attn_drop = attn_drop
            self.residual_mode = residual_mode
            self.proj_drop = nn.Dropout(proj_drop)
            self.kps_generator = MODELS.build({**kps_generator, "embed_dims": embed_dims})
            self.num_pts = self.kps_generator.num_pts
            self.output_proj = nn.Linear(embed_dims, embed_dims)
            self.camera_encoder = None
            self.weights_fc = nn.Linear(embed_dims, num_groups * num_cams * num_levels * self.num_pts)

        def forward(self, instance_feature, anchor, anchor_embed, feature_maps, metas, **kwargs):
            bs, num_anchor = instance_feature.shape[:2]
            key_points = self.kps_generator(anchor, instance_feature)
            weights = self._get_weights(instance_feature, anchor_embed, metas)
            if self.use_deformable_func:
                points_2d = self.project_points(key_points, metas["projection_mat"], metas.get("image_wh"))
                points_2d = points_2d.permute(0, 2, 3, 1, 4).reshape(bs, num_anchor, self.num_pts, self.num_cams, 2)
                weights = weights.permute(0, 1, 4, 2, 3, 5).contiguous().reshape(
                    bs, num_anchor, self.num_pts, self.num_cams, self.num_levels, self.num_groups)
                features = DAF(*feature_maps, points_2d, weights).reshape(bs, num_anchor, self.embed_dims)
            else:
                features = self.feature_sampling(feature_maps, key_points, metas["projection_mat"],
                                                 metas.get("image_wh"))
                features = self.multi_view_level_fusion(features, weights)
                features = features.sum(dim=2)
            output = self.proj_drop(self.output_proj(features))
            if self.residual_mode == "add":
                output = output + instance_feature
            elif self.residual_mode == "cat":
                output = torch.cat([output, instance_feature], dim=-1)
            return output

        def _get_weights(self, instance_feature, anchor_embed, metas=None):
            bs, num_anchor = instance_feature.shape[:2]
            logits = self.weights_fc(instance_feature + anchor_embed).reshape(bs, num_anchor, -1, self.num_groups)
            weights = logits.softmax(dim=-2).reshape(bs, num_anchor, self.num_cams, self.num_levels, self.num_pts,
                                                     self.num_groups)
            if self.training and self.attn_drop > 0:
                keep = torch.rand(bs, num_anchor, self.num_cams, 1, self.num_pts, 1).to(weights) > self.attn_drop
                weights = keep * weights / (1 - self.attn_drop)
            return weights

        @staticmethod
        def project_points(key_points, projection_mat, image_wh=None):
            homogeneous = torch.cat([key_points, torch.ones_like(key_points[..., :1])], dim=-1)
            points = torch.matmul(projection_mat[:, :, None, None], homogeneous[:, None, ..., None]).squeeze(-1)
            points_2d = points[..., :2] / torch.clamp(points[..., 2:3], min=1e-5)
            if image_wh is not None:
                points_2d = points_2d / image_wh[:, :, None, None]
            return points_2d

        @staticmethod
        def feature_sampling(feature_maps: List[torch.Tensor], key_points: torch.Tensor,
                             projection_mat: torch.Tensor, image_wh: Optional[torch.Tensor] = None) -> torch.Tensor:
            num_levels = len(feature_maps)
            num_cams = feature_maps[0].shape[1]
            bs, num_anchor, num_pts = key_points.shape[:3]
            grid = DeformableFeatureAggregation.project_points(key_points, projection_mat, image_wh) * 2 - 1
            grid = grid.flatten(end_dim=1)
            sampled = []
            for fm in feature_maps:
                sampled.append(torch.nn.functional.grid_sample(fm.flatten(end_dim=1), grid))
            sampled = torch.stack(sampled, dim=1)
            return sampled.reshape(bs, num_cams, num_levels, -1, num_anchor, num_pts).permute(0, 4, 1, 2, 5, 3)

        def multi_view_level_fusion(self, features, weights):
            bs, num_anchor = weights.shape[:2]
            features = weights[..., None] * features.reshape(features.shape[:-1] + (self.num_groups, self.group_dims))
            features = features.sum(dim=2).sum(dim=2)
            return features.reshape(bs, num_anchor, self.num_pts, self.embed_dims)
''')


def write_project(root: Path, package: str, blocks: str = BLOCKS) -> str:
    """projects/<package>/models/blocks.py under ``root``; returns the module name to import."""
    models = root / package / "models"
    models.mkdir(parents=True)
    (root / package / "__init__.py").write_text("from . import models\n")
    (models / "__init__.py").write_text("from .blocks import DeformableFeatureAggregation, KeyPoints\n")
    (models / "blocks.py").write_text(blocks)
    return f"{package}.models.blocks"


def activation() -> tuple[SparseDAG, ActivationContext]:
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == "dag")
    record = FeatureRecord(feature)
    record.state = State.APPLIED
    ctx = ActivationContext(record, None, get_logger("test"),  # type: ignore[arg-type]
                            lambda module, cb: cb(sys.modules[module]))
    return SparseDAG(feature), ctx


@pytest.fixture
def project(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Any, ActivationContext]]:
    """The vendored package imported with the feature active (undone afterwards)."""
    assert kernels.load() is not None, kernels.failure()
    impl, ctx = activation()
    impl.activate(ctx, "mmengine.registry.registry")
    package = f"lk_sparse4d_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}"
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(write_project(tmp_path, package))
        yield module, ctx
    finally:
        impl.deactivate(ctx)
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith(package)]:
            del sys.modules[name]


def cameras(bs: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Six cameras around the ego car (yaw 0, 60, ... 300 degrees), 704x256 images, 4x4 projections."""
    w, h = 704.0, 256.0
    mats = []
    for cam in range(6):
        yaw = math.radians(60 * cam) + float(torch.rand((), generator=gen)) * 0.1
        forward = torch.tensor([math.cos(yaw), math.sin(yaw), 0.0])
        right = torch.tensor([math.sin(yaw), -math.cos(yaw), 0.0])
        down = torch.tensor([0.0, 0.0, -1.0])
        rot = torch.stack([right, down, forward])  # lidar -> camera axes (x right, y down, z forward)
        extrinsic = torch.eye(4)
        extrinsic[:3, :3] = rot
        extrinsic[:3, 3] = -rot @ torch.tensor([0.5, 0.0, 1.6])
        intrinsic = torch.eye(4)
        intrinsic[0, 0] = intrinsic[1, 1] = 0.55 * w
        intrinsic[0, 2], intrinsic[1, 2] = w / 2, h / 2
        mats.append(intrinsic @ extrinsic)
    projection = torch.stack(mats).to(dtype).expand(bs, -1, -1, -1).contiguous()
    image_wh = torch.tensor([w, h], dtype=dtype).expand(bs, 6, 2).contiguous()
    return {"projection_mat": projection, "image_wh": image_wh}


def inputs(bs: int, anchors: int, dtype: torch.dtype, gen: torch.Generator, channels: int = 256,
           levels: list[tuple[int, int]] = LEVELS) -> dict[str, Any]:
    anchor = torch.zeros(bs, anchors, 11, dtype=dtype)
    anchor[..., :2] = torch.rand(bs, anchors, 2, generator=gen, dtype=dtype) * 80 - 40
    anchor[..., 2] = torch.rand(bs, anchors, generator=gen, dtype=dtype) * 2 - 1
    anchor[..., 3:6] = torch.rand(bs, anchors, 3, generator=gen, dtype=dtype) * 2
    yaw = torch.rand(bs, anchors, generator=gen, dtype=dtype) * 2 * math.pi
    anchor[..., 6], anchor[..., 7] = yaw.sin(), yaw.cos()
    return {
        "instance_feature": torch.randn(bs, anchors, channels, generator=gen, dtype=dtype),
        "anchor": anchor,
        "anchor_embed": torch.randn(bs, anchors, channels, generator=gen, dtype=dtype),
        "feature_maps": [torch.randn(bs, 6, channels, h, w, generator=gen, dtype=dtype) for h, w in levels],
        "metas": cameras(bs, dtype, gen),
    }


def build(module: Any, dtype: torch.dtype, gen: torch.Generator, **cfg: Any) -> Any:
    dfa = module.DeformableFeatureAggregation(kps_generator={"type": "KeyPoints"}, **cfg).to(dtype)
    with torch.no_grad():  # upstream init zeroes weights_fc: randomise so every weight matters
        for p in dfa.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.05)
    return dfa


def run(dfa: Any, forward: Callable[..., Any], data: dict[str, Any], grad: torch.Tensor) -> list[torch.Tensor]:
    dfa.zero_grad()
    feats = [t.clone().requires_grad_() for t in data["feature_maps"]]
    inst = data["instance_feature"].clone().requires_grad_()
    anchor = data["anchor"].clone().requires_grad_()
    out = forward(dfa, inst, anchor, data["anchor_embed"], feats, data["metas"])
    out.backward(grad)
    return [out.detach(), inst.grad, anchor.grad, *(f.grad for f in feats),
            *(p.grad.clone() for p in dfa.parameters())]


def assert_same(before: list[torch.Tensor], after: list[torch.Tensor], dtype: torch.dtype) -> None:
    for i, (theirs, mine) in enumerate(zip(before, after, strict=True)):
        scale = theirs.abs().max().clamp(min=1e-3)
        torch.testing.assert_close(mine / scale, theirs / scale, **TOL[dtype],
                                   msg=lambda m, i=i: f"#{i} seed {SEED}: {m}")


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grid_sample_path_equals_unpatched(project: tuple[Any, ActivationContext], bs: int,
                                           dtype: torch.dtype) -> None:
    module, ctx = project
    cls = module.DeformableFeatureAggregation
    assert cls.forward.__wrapped__ is not cls.forward, "the class was not patched at registration"
    gen = torch.Generator().manual_seed(SEED + bs)
    dfa = build(module, dtype, gen)
    data = inputs(bs, 96, dtype, gen)
    grad = torch.randn(bs, 96, 256, generator=gen, dtype=dtype)
    before = run(dfa, cls.forward.__wrapped__, data, grad)
    after = run(dfa, cls.forward, data, grad)
    assert ctx.record.calls == 1
    assert_same(before, after, dtype)
    # (earlier tests' classes, still in MODELS when the feature activates, are patched too)
    assert f"{module.__name__}.DeformableFeatureAggregation" in ctx.record.details["patched"]


@pytest.mark.parametrize("bs", [1, 2])
def test_deformable_func_path_equals_unpatched(project: tuple[Any, ActivationContext], bs: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """use_deformable_func=True: the CUDA op's rule (samples outside (0, 1) dropped), here with the fp64
    reference standing in for the extension the unpatched module would call."""
    module, ctx = project
    dtype = torch.float64
    monkeypatch.setattr(module, "DAF", lambda *args: reference.deformable_aggregation(*args, inside_only=True))
    cls = module.DeformableFeatureAggregation
    gen = torch.Generator().manual_seed(SEED + 10 * bs)
    levels = [(16, 44), (8, 22)]
    dfa = build(module, dtype, gen, num_levels=2, embed_dims=64)
    data = inputs(bs, 40, dtype, gen, channels=64, levels=levels)
    maps = data.pop("feature_maps")
    flat = torch.cat([t.flatten(3) for t in maps], 3).transpose(2, 3).reshape(bs, -1, 64)
    per_cam = sum(h * w for h, w in levels)
    shapes = torch.tensor([levels] * 6)
    starts = torch.tensor([[cam * per_cam, cam * per_cam + levels[0][0] * levels[0][1]] for cam in range(6)])
    grad = torch.randn(bs, 40, 64, generator=gen, dtype=dtype)

    def go(forward: Callable[..., Any]) -> list[torch.Tensor]:
        dfa.zero_grad()
        feat = flat.clone().requires_grad_()
        inst = data["instance_feature"].clone().requires_grad_()
        out = forward(dfa, inst, data["anchor"], data["anchor_embed"], [feat, shapes, starts], data["metas"])
        out.backward(grad)
        return [out.detach(), inst.grad, feat.grad, *(p.grad.clone() for p in dfa.parameters())]

    dfa.use_deformable_func = True
    assert_same(go(cls.forward.__wrapped__), go(cls.forward), dtype)
    assert ctx.record.calls == 1


def test_attention_dropout_draws_the_same_numbers(project: tuple[Any, ActivationContext]) -> None:
    module, _ = project
    cls = module.DeformableFeatureAggregation
    gen = torch.Generator().manual_seed(SEED)
    dfa = build(module, torch.float64, gen, attn_drop=0.3).train()
    data = inputs(1, 24, torch.float64, gen, levels=[(16, 44), (8, 22), (4, 11), (2, 6)])
    grad = torch.randn(1, 24, 256, generator=gen, dtype=torch.float64)
    torch.manual_seed(SEED)
    before = run(dfa, cls.forward.__wrapped__, data, grad)
    torch.manual_seed(SEED)
    assert_same(before, run(dfa, cls.forward, data, grad), torch.float64)


def test_other_dtypes_run_the_original(project: tuple[Any, ActivationContext]) -> None:
    module, ctx = project
    gen = torch.Generator().manual_seed(SEED)
    dfa = build(module, torch.bfloat16, gen)
    data = inputs(1, 8, torch.bfloat16, gen, levels=[(8, 22), (4, 11), (2, 6), (1, 3)])
    with torch.no_grad():
        out = dfa(data["instance_feature"], data["anchor"], data["anchor_embed"], data["feature_maps"], data["metas"])
    assert out.dtype == torch.bfloat16 and ctx.record.calls == 0


FORK = BLOCKS.replace("        output = self.proj_drop(self.output_proj(features))\n",
                      "        features = torch.tanh(features)\n"
                      "        output = self.proj_drop(self.output_proj(features))\n")


def test_fork_with_another_forward_is_left_alone(tmp_path: Path) -> None:
    assert FORK != BLOCKS
    impl, ctx = activation()
    impl.activate(ctx, "mmengine.registry.registry")
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(write_project(tmp_path, "lk_sparse4d_fork", FORK))
        assert not hasattr(module.DeformableFeatureAggregation.forward, "__wrapped__")
        reason = ctx.record.details["skipped"][f"{module.__name__}.DeformableFeatureAggregation"]
        assert "interface differs" in reason and "tanh" in reason
        if not ctx.record.details.get("patched"):  # earlier tests' classes may still be in MODELS
            assert ctx.record.state == State.NOT_APPLICABLE and ctx.record.reason == reason
    finally:
        impl.deactivate(ctx)
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith("lk_sparse4d_fork")]:
            del sys.modules[name]


def test_interface_checks() -> None:
    class NoSampling:
        def forward(self, instance_feature: Any, anchor: Any, anchor_embed: Any, feature_maps: Any, metas: Any,
                    **kwargs: Any) -> Any:
            return instance_feature

    assert "does not use" in str(interface_problem(NoSampling))

    class OtherSignature:
        def forward(self, query: Any) -> Any:
            return query

    assert "forward(" in str(interface_problem(OtherSignature))


def test_broken_registry_is_not_applicable(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    fake = types.ModuleType("fake_registry")
    fake.Registry = type("Registry", (), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_registry", fake)
    impl, ctx = activation()
    with pytest.raises(NotApplicable, match="interface differs"):
        impl.activate(ctx, "fake_registry")


def test_kernel_unavailable_leaves_the_class_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No kernel build when the registry is imported; a matching class that registers is skipped."""
    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels, "failure", lambda: "RuntimeError: no compiler")
    impl, ctx = activation()
    impl.activate(ctx, "mmengine.registry.registry")  # applies: nothing built yet
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(write_project(tmp_path, "lk_sparse4d_nokernel", BLOCKS))
        assert not hasattr(module.DeformableFeatureAggregation.forward, "__wrapped__")
        reason = ctx.record.details["skipped"][f"{module.__name__}.DeformableFeatureAggregation"]
        assert "no compiler" in reason
    finally:
        impl.deactivate(ctx)
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith("lk_sparse4d_nokernel")]:
            del sys.modules[name]


RUN = """
import sys, importlib, torch
sys.path.insert(0, {root!r})
blocks = importlib.import_module("lk_sparse4d_e2e.models.blocks")
m = blocks.DeformableFeatureAggregation(embed_dims=32, num_groups=4, num_levels=1, num_cams=2,
                                        kps_generator=dict(type="KeyPoints"))
bs, a = 1, 5
anchor = torch.zeros(bs, a, 11); anchor[..., 0] = 5; anchor[..., 7] = 1
proj = torch.eye(4).expand(bs, 2, 4, 4).clone(); proj[..., 2, 3] = 10
out = m(torch.randn(bs, a, 32), anchor, torch.randn(bs, a, 32), [torch.randn(bs, 2, 32, 4, 6)],
        dict(projection_mat=proj, image_wh=torch.full((bs, 2, 2), 20.0)))
out.sum().backward()
"""


@pytest.mark.parametrize("blocks", ["upstream", "fork"])
def test_end_to_end_summary(run_loongkit: Callable[..., Any], tmp_path: Path, blocks: str) -> None:
    write_project(tmp_path, "lk_sparse4d_e2e", BLOCKS if blocks == "upstream" else FORK)
    result = run_loongkit(RUN.format(root=str(tmp_path)), env={"LOONGKIT_DAG": "1"})
    assert result.returncode == 0, result.stderr
    row = result.feature("dag")
    if blocks == "upstream":
        assert row["active"] and row["calls"] == 1, row
        assert "mmengine.registry.registry" in str(row["targets"]), row
    else:
        assert row["state"] == "not applicable" and "interface differs" in row["reason"], row
