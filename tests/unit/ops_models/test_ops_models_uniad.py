"""LOONGKIT_UNIAD against UniAD-style test modules registered in an mmcv 1.x Registry double: the encoder
attentions (UniAD's batch-major SCA and TSA), MotionDeformableAttention and CollisionLoss.

Fresh random inputs each run (seed in failure messages); outputs and gradients with the feature on
equal the unpatched ones within 2e-5 (fp32) / 1e-10 (fp64), relative to the tensor's max.
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from loongkit_ops import kernels
from loongkit_ops.plugin import plugin

from loongkit_core.context import ActivationContext

HERE = Path(__file__).parent
SEED = int(torch.seed() % 2**31)
TARGET = "mmcv.utils.registry"


def _load(name: str) -> types.ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"lk_{name}_uniad", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kit = _load("models_testkit")
double = _load("mmcv1_registry_double")


@pytest.fixture
def uniad(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    assert kernels.load() is not None, kernels.failure()
    fake = types.ModuleType(TARGET)
    fake.Registry = type("Registry", (double.Registry,), {})  # type: ignore[attr-defined]
    for parent in ("mmcv", "mmcv.utils"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, TARGET, fake)
    _, module = kit.install_projects(fake.Registry("attention"), fake.Registry("loss"), uniad=True)
    yield module
    kit.remove_projects()


def activation() -> tuple[Any, ActivationContext]:
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == "uniad")
    ctx = ActivationContext.standalone(feature, logger="test")
    return plugin.impl(feature).__class__(feature), ctx


def compare(module: Any, run: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], ActivationContext]:
    impl, ctx = activation()
    before, after = kit.compare(lambda: module, run, lambda: impl.activate(ctx, TARGET), lambda: impl.deactivate(ctx))
    return before, after, ctx


def test_all_uniad_classes_patched(uniad: types.ModuleType) -> None:
    impl, ctx = activation()
    impl.activate(ctx, TARGET)
    try:
        names = {k.split(" ")[0] for k in ctx.record.details["patched"]}  # type: ignore[union-attr]
        assert names == {"SpatialCrossAttention", "TemporalSelfAttention", "MotionDeformableAttention",
                         "MSDeformableAttention3D", "CollisionLoss"}, ctx.record.details
        assert ctx.record.reason == ""
    finally:
        impl.deactivate(ctx)


@pytest.mark.parametrize("bs", [1, 2])
def test_sca_batch_major_equals_upstream(uniad: types.ModuleType, bs: int) -> None:
    gen = torch.Generator().manual_seed(SEED + bs)
    cfg = {"type": "MSDeformableAttention3D", "embed_dims": 256, "num_points": 8, "num_levels": 1}
    module = uniad.SpatialCrossAttention(embed_dims=256, num_cams=6, dropout=0.0, deformable_attention=cfg)
    kit.randomise(module, gen)
    inputs = kit.camera_inputs(bs, torch.float32, gen, [(15, 25)])
    grad = torch.randn(bs, 2500, 256, generator=gen)
    before, after, ctx = compare(module, lambda m: kit.run_sca(m, inputs, grad))
    kit.assert_same(before, after, torch.float32, SEED)
    assert "batch-major" in str(ctx.record.details["patched"])


@pytest.mark.parametrize("bs", [1, 2])
def test_tsa_equals_upstream(uniad: types.ModuleType, bs: int) -> None:
    for dtype in (torch.float32, torch.float64):
        gen = torch.Generator().manual_seed(SEED + bs)
        module = uniad.TemporalSelfAttention(embed_dims=256, num_levels=1, dropout=0.0).to(dtype)
        kit.randomise(module, gen)
        inputs = kit.tsa_inputs(bs, dtype, gen)
        grad = torch.randn(bs, 2500, 256, generator=gen, dtype=dtype)
        before, after, ctx = compare(module, lambda m, i=inputs, g=grad: kit.run_tsa(m, i, g))
        kit.assert_same(before, after, dtype, SEED)
        assert ctx.record.calls == 1
        assert "fallbacks" not in ctx.record.details, ctx.record.details  # batch-major rows: fused for any bs
        assert "batch>1: batch-major" in str(ctx.record.details["patched"]), ctx.record.details


class CenterBoxes:
    """The slice of mmdet3d's LiDARInstance3DBoxes these modules read (gravity_center)."""

    def __init__(self, centres: torch.Tensor) -> None:
        self.gravity_center = centres


@pytest.mark.parametrize("bs", [1, 2])
def test_motion_deformable_attention_equals_upstream(uniad: types.ModuleType, bs: int) -> None:
    gen = torch.Generator().manual_seed(SEED + bs)
    agents, modes, dims, bev = 11, 6, 256, 50
    module = uniad.MotionDeformableAttention(embed_dims=dims, num_levels=1, num_points=4, num_steps=1,
                                             sample_index=-1, dropout=0.0)
    kit.randomise(module, gen)
    query = torch.randn(bs, agents, modes, dims, generator=gen)
    value = torch.randn(bev * bev, bs, dims, generator=gen)
    trajs = torch.randn(bs, agents, modes, 12, 1, 2, generator=gen) * 10
    boxes = [(CenterBoxes(torch.rand(agents, 3, generator=gen) * 80 - 40),) for _ in range(bs)]
    grad = torch.randn(bs, agents, modes, dims, generator=gen)

    def run(m: Any) -> list[torch.Tensor]:
        m.zero_grad()
        q, v = query.clone().requires_grad_(), value.clone().requires_grad_()
        out = m(q, value=v, spatial_shapes=torch.tensor([[bev, bev]]), level_start_index=torch.tensor([0]),
                bbox_results=boxes, reference_trajs=trajs)
        out.backward(grad)
        return [out.detach(), q.grad, v.grad, *(p.grad.clone() for p in m.parameters())]

    before, after, ctx = compare(module, run)
    kit.assert_same(before, after, torch.float32, SEED)
    assert ctx.record.calls == 1


class LidarBoxes:
    """The slice of mmdet3d's LiDARInstance3DBoxes CollisionLoss reads: ``tensor`` [N, 7] (x, y, z, dx,
    dy, dz, yaw; bottom-centre origin) and ``corners`` [N, 8, 3]; corners 0, 3, 4, 7 span the bottom."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def corners(self) -> torch.Tensor:
        unit = torch.tensor([[0, 0, 0], [0, 0, 1], [0, 1, 1], [0, 1, 0], [1, 0, 0], [1, 0, 1], [1, 1, 1], [1, 1, 0]],
                            dtype=self.tensor.dtype) - torch.tensor([0.5, 0.5, 0.0], dtype=self.tensor.dtype)
        local = self.tensor[:, None, 3:6] * unit[None]
        c, s = self.tensor[:, 6].cos()[:, None], self.tensor[:, 6].sin()[:, None]
        x = local[..., 0] * c - local[..., 1] * s
        y = local[..., 0] * s + local[..., 1] * c
        return torch.stack([x, y, local[..., 2]], -1) + self.tensor[:, None, :3]


def collision_inputs(bs: int, gen: torch.Generator, steps: int = 6) -> tuple[Any, ...]:
    traj = (torch.randn(bs, steps, 2, generator=gen) * 3).requires_grad_()
    plan_gt = torch.randn(bs, steps, 3, generator=gen)
    boxes = []
    for step in range(steps):
        n = 0 if step == 2 else int(torch.randint(1, 60, (1,), generator=gen))  # one future without boxes
        near = traj.detach()[0, step] + torch.randn(n, 2, generator=gen) * 3  # many overlap the ego box
        dims = torch.rand(n, 3, generator=gen) * 4 + 0.5
        yaw = torch.rand(n, 1, generator=gen) * 2 * math.pi
        boxes.append(LidarBoxes(torch.cat([near, torch.zeros(n, 1), dims, yaw], 1)))
    return traj, plan_gt, torch.ones(bs, steps), boxes


@pytest.mark.parametrize("bs", [1, 2])
def test_collision_loss_equals_upstream(uniad: types.ModuleType, bs: int) -> None:
    gen = torch.Generator().manual_seed(SEED + bs)
    loss = uniad.CollisionLoss(delta=0.5, weight=2.5)
    traj, plan_gt, mask, boxes = collision_inputs(bs, gen)

    def run(m: Any) -> list[torch.Tensor]:
        traj.grad = None
        out = m(traj, plan_gt, mask, boxes)
        assert out.shape == (1,) and not out.requires_grad  # upstream: no gradient to the trajectory
        (out.sum() + (traj ** 2).sum()).backward()  # in a total loss, only the other term trains traj
        return [out.detach(), traj.grad.clone()]

    before, after, ctx = compare(loss, run)
    assert before[0].item() > 0, "inputs must overlap for the test to mean anything"
    kit.assert_same(before, after, torch.float32, SEED)
    assert ctx.record.calls == 1


def test_collision_loss_no_boxes_and_double_trajectory(uniad: types.ModuleType) -> None:
    gen = torch.Generator().manual_seed(SEED)
    loss = uniad.CollisionLoss()
    traj, plan_gt, mask, boxes = collision_inputs(1, gen)
    empty = [LidarBoxes(torch.zeros(0, 7)) for _ in boxes]
    impl, ctx = activation()
    impl.activate(ctx, TARGET)
    try:
        assert torch.equal(loss(traj, plan_gt, mask, empty), torch.zeros(1))
        with pytest.raises(RuntimeError):  # upstream's float32 corners @ float64 rotation: kept
            loss(traj.double(), plan_gt, mask, boxes)
        assert ctx.record.details["fallbacks"] == {  # type: ignore[comparison-overlap]
            "trajectory dtype is not the default dtype (upstream's corner matmul mixes dtypes)": 1}
    finally:
        impl.deactivate(ctx)


def test_collision_loss_variant_is_not_patched(uniad: types.ModuleType) -> None:
    """A fork that skips masked steps is another loss: reported, not patched."""
    impl, ctx = activation()
    impl.activate(ctx, TARGET)
    try:
        class CollisionLoss(uniad.CollisionLoss):  # type: ignore[name-defined,misc]
            def forward(self, sdc_traj_all: Any, sdc_planning_gt: Any, sdc_planning_gt_mask: Any,
                        future_gt_bbox: Any) -> Any:
                kept = [b if sdc_planning_gt_mask[0, i] else LidarBoxes(b.tensor[:0])
                        for i, b in enumerate(future_gt_bbox)]
                _ = (self.to_corners, self.inter_bbox, self.w, self.h, self.weight, kept[0].corners, kept[0].tensor)
                return super().forward(sdc_traj_all, sdc_planning_gt, sdc_planning_gt_mask, kept)

        sys.modules["lk_upstream_registry"].LOSSES.register_module(module=CollisionLoss, force=True)
        assert "__loongkit_feature__" not in vars(CollisionLoss)
        assert "reads sdc_planning_gt_mask" in ctx.record.reason, ctx.record.reason
    finally:
        impl.deactivate(ctx)
