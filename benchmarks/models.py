"""LOONGKIT_BEVFORMER / LOONGKIT_UNIAD model blocks, upstream-style module vs patched, same run, CPU.

- ``bevformer_tiny_encoder_attn``: one BEVFormer-tiny encoder layer's attentions, TSA then SCA,
  forward+backward, batch 1: BEV 50x50, 256 dims, 8 heads, TSA 4 points over [previous, current] BEV,
  SCA over 6 cameras (one 15x25 level, 4 Z anchors x 2 points = MSDeformableAttention3D's 8 points),
  each camera seeing a 70-degree sector. Full mode adds the base camera levels (116x200 .. 15x25).
- ``uniad_collision_loss``: UniAD's CollisionLoss on 6 future steps x ~40 GT boxes (nuScenes-like).
- ``bevfusion_camera_to_bev``: BEVFusion's ``get_geometry`` then ``bev_pool`` (LOONGKIT_BEVFUSION),
  forward+backward through the camera features x, batch 1: 6 cameras, 118 depth bins on a 32x88
  feature map (2M frustum points), 80 channels, 360x360 BEV, nuScenes-like camera matrices with
  image and lidar augmentation (--quick: 59 depth bins on 16x44, 250k points). The upstream-style
  module is the vendored test project of ``tests/integration/ops_kernels/upstream_bevfusion_project.py``
  with its CPU stand-in for the CUDA extension (sort + cumulative sums). ``bevfusion_get_geometry``:
  the geometry alone, same inputs; a line after it says whether the patched geometry is upstream's
  bit for bit (it must be).
- ``bev_tiny_train_step``: the full training step of ``examples/bevformer_tiny`` (``cpu`` preset: six
  256x144 cameras, R50/32 + FPN, 16x16 BEV, 3 encoder and 6 decoder layers, 100 queries, a queue of
  3 frames): forward, backward and the AdamW step on pre-loaded samples, LOONGKIT_BEVFORMER +
  LOONGKIT_FUSED_ADAMW off vs on (needs the OpenMMLab 2.x stack; SKIP otherwise).
- ``sparse4d_daf_block``: Sparse4D v3's DeformableFeatureAggregation (LOONGKIT_DAG), forward+backward
  through the feature maps, instance features and anchors, batch 1: 900 anchors, 13 key points (7
  fixed + 6 learnable), 6 cameras, levels 64x176, 32x88, 16x44, 8x22, 256 channels, 8 groups
  (--quick: levels 32x88 .. 4x11). Upstream-style module: the vendored project of
  ``tests/integration/ops_kernels/upstream_sparse4d_project.py`` on its grid_sample path (what runs
  without the CUDA extension).

The upstream-style modules are the test modules in ``tests/unit/ops_models/`` (written from the
published algorithms; mmcv's ``multi_scale_deformable_attn_pytorch`` when mmcv is installed, else an
equivalent grid_sample path), registered in an mmcv 1.x Registry double like a user's project. The
feature is switched on and off between rounds, so both sides see the same machine state.

Prints ``BENCH <name> baseline=<s> ours=<s> ratio=<b/o>`` (median seconds per call).

    python benchmarks/models.py --quick     # < 1 minute
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _timing import bench_line, median_time

TESTS = Path(__file__).parents[1] / "tests"
UNIT = TESTS / "unit" / "ops_models"


def _load(name: str, folder: Path = UNIT) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"lk_bench_{name}", folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _vendored(project_file: str, package: str, target: str) -> tuple[types.ModuleType, types.ModuleType]:
    """(the test-project module, the vendored package it writes and imports) registered at ``target``."""
    import tempfile

    project = _load(project_file, TESTS / "integration" / "ops_kernels")
    with tempfile.TemporaryDirectory() as root:
        sys.path.insert(0, root)
        try:
            return project, importlib.import_module(project.write_project(Path(root), package, project.source(target)))
        finally:
            sys.path.remove(root)


class Switch:
    """LOONGKIT_<feature> on the registry double, as the runtime would activate it."""

    def __init__(self, name: str, target: str) -> None:
        from loongkit_ops.plugin import plugin

        from loongkit_core.context import ActivationContext

        feature = next(f for f in plugin.loongkit_declare_features() if f.name == name)
        self.impl = plugin.impl(feature).__class__(feature)
        self.ctx = ActivationContext.standalone(feature, logger="bench")
        self.target = target

    def on(self) -> None:
        self.impl.activate(self.ctx, self.target)

    def off(self) -> None:
        self.impl.deactivate(self.ctx)


def compare(name: str, fn: Callable[[], Any], switch: Switch, reps: int, rounds: int) -> None:
    fn()
    switch.on()
    fn()  # warm-up both paths (kernel load, first allocations)
    switch.off()
    base, ours = [], []
    for _ in range(rounds):
        base.append(median_time(fn, reps))
        switch.on()
        try:
            ours.append(median_time(fn, reps))
        finally:
            switch.off()
    tb, to = min(base), min(ours)
    bench_line(name, tb, to)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, tiny shapes only (< 1 minute)")
    args = parser.parse_args()
    reps, rounds = (2, 2) if args.quick else (5, 3)

    from loongkit_ops import kernels

    if kernels.load() is None:
        print(f"loongkit-ops kernels unavailable: {kernels.failure()}", file=sys.stderr)
        return 1
    bev_tiny_train_step(args.quick, reps, rounds)  # first: it imports the real mmcv 2.x stack
    kit = _load("models_testkit")
    double = _load("mmcv1_registry_double")
    target = "mmcv.utils.registry"
    fake = types.ModuleType(target)
    fake.Registry = double.Registry  # type: ignore[attr-defined]
    for parent in ("mmcv", "mmcv.utils"):
        sys.modules.setdefault(parent, types.ModuleType(parent))
    sys.modules[target] = fake
    _, uni = kit.install_projects(double.Registry("attention"), double.Registry("loss"), uniad=True)
    bev = sys.modules["lk_upstream_bevformer"]

    gen = torch.Generator().manual_seed(0)
    cases = [("bevformer_tiny_encoder_attn", [(15, 25)])]
    if not args.quick:
        cases.append(("bevformer_base_levels_encoder_attn", [(116, 200), (58, 100), (29, 50), (15, 25)]))
    for name, levels in cases:
        cfg = {"type": "MSDeformableAttention3D", "embed_dims": 256, "num_points": 8, "num_levels": len(levels)}
        sca = bev.SpatialCrossAttention(embed_dims=256, num_cams=6, dropout=0.0, deformable_attention=cfg)
        tsa = bev.TemporalSelfAttention(embed_dims=256, num_levels=1, dropout=0.0)
        kit.randomise(sca, gen)
        kit.randomise(tsa, gen)
        cam = kit.camera_inputs(1, torch.float32, gen, levels)
        tmp = kit.tsa_inputs(1, torch.float32, gen)

        def layer(sca: Any = sca, tsa: Any = tsa, cam: dict = cam, tmp: dict = tmp) -> None:
            query = tmp["query"].clone().requires_grad_()
            feat = cam["feat"].clone().requires_grad_()
            x = tsa(query, None, tmp["value"], query_pos=tmp["query_pos"], reference_points=tmp["reference_points"],
                    spatial_shapes=tmp["spatial_shapes"], level_start_index=tmp["level_start_index"])
            kv = feat.permute(0, 2, 1, 3)
            x = sca(x, kv, kv, query_pos=tmp["query_pos"], reference_points_cam=cam["reference_points_cam"],
                    bev_mask=cam["bev_mask"], spatial_shapes=cam["spatial_shapes"],
                    level_start_index=cam["level_start_index"])
            x.square().mean().backward()

        compare(name, layer, Switch("bevformer", target), reps, rounds)

    loss = uni.CollisionLoss(delta=0.5, weight=1.0)
    traj = torch.randn(1, 6, 2, generator=gen) * 3
    plan = torch.randn(1, 6, 3, generator=gen)
    boxes = []
    for step in range(6):
        n = 40
        centre = traj[0, step] + torch.randn(n, 2, generator=gen) * 8
        dims = torch.rand(n, 3, generator=gen) * 4 + 0.5
        yaw = torch.rand(n, 1, generator=gen) * 6.28
        boxes.append(_boxes(torch.cat([centre, torch.zeros(n, 1), dims, yaw], 1)))
    compare("uniad_collision_loss", lambda: loss(traj, plan, torch.ones(1, 6), boxes), Switch("uniad", target),
            reps * 5, rounds)
    bevfusion_camera_to_bev(args.quick, target, min(reps, 3), rounds)
    sparse4d_daf_block(args.quick, target, min(reps, 3), rounds)
    return 0


def bev_tiny_train_step(quick: bool, reps: int, rounds: int) -> None:
    """The BEV example's full training step (examples/bevformer_tiny, ``cpu`` preset): forward with the
    history frames, backward, gradient clipping, AdamW step (mmengine's optim wrapper, the published
    param-wise lr), on pre-loaded samples; bare vs LOONGKIT_BEVFORMER + LOONGKIT_FUSED_ADAMW, same run.
    Needs the OpenMMLab 2.x stack (SKIP otherwise). Runs before the other cases install their mmcv
    1.x Registry double."""
    try:
        import mmcv.ops  # noqa: F401
        import mmdet.models  # noqa: F401
        import scipy.optimize  # noqa: F401
    except ImportError as exc:
        print(f"SKIP bev_tiny_train_step: {exc.name or exc} is not importable here (run in the stack2 venv)",
              flush=True)
        return
    import tempfile

    from mmengine.logging import MMLogger
    from mmengine.optim import build_optim_wrapper
    from mmengine.registry import DATASETS, MODELS, DefaultScope

    MMLogger.get_instance("lk-bench-bev", log_level="WARNING")  # no per-parameter init_weights report
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "bevformer_tiny"))
    import config as bev_config
    import projects.mmdet3d_plugin  # noqa: F401  (registers the example's classes in mmengine's registries)
    from synthetic_scenes import make_dataset

    s = bev_config.size("cpu")
    DefaultScope.get_instance("lk-bench-bev", scope_name="mmdet")
    with tempfile.TemporaryDirectory(prefix="lk-bench-bev-") as root:
        ann = make_dataset(Path(root), 1, 2 + s.queue_length, s.image[0] * 2, s.image[1] * 2, 0)
        dataset = DATASETS.build(dict(type="SyntheticNuScenesDataset", data_root=root, ann_file=ann.name,
                                      pipeline=bev_config.train_pipeline(), queue_length=s.queue_length,
                                      bev_size=(s.bev, s.bev), test_mode=False))
        samples = [{k: [v] for k, v in dataset[i].items()} for i in range(len(dataset) - 2, len(dataset))]
    torch.manual_seed(0)
    model = MODELS.build(bev_config.model(s))
    model.init_weights()
    model.train()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optim_cfg = bev_config.runner_config(s, "", "", 1, 0, 2e-4, 0, "", None)["optim_wrapper"]
    switches = [Switch("bevformer", "mmengine.registry.registry"), Switch("fused_adamw", "torch.optim")]

    def steps(on: bool, n: int) -> float:
        """Median seconds of ``n`` training steps from the initial weights, features on or off."""
        for switch in switches if on else ():
            switch.on()
        try:
            model.load_state_dict(initial)
            wrapper = build_optim_wrapper(model, optim_cfg)  # AdamW built here: fused when the switch is on
            times = []
            for i in range(n + 1):  # the first step builds the kernels and the optimizer state
                start = time.perf_counter()
                model.train_step(samples[i % len(samples)], wrapper)
                times.append(time.perf_counter() - start)
            return statistics.median(times[1:])
        finally:
            for switch in reversed(switches) if on else ():
                switch.off()

    base, ours = [], []
    for _ in range(1 if quick else rounds):  # ~3 s a step here: --quick is one round of 2 + 2 steps
        base.append(steps(False, reps))
        ours.append(steps(True, reps))
    tb, to = min(base), min(ours)
    bench_line("bev_tiny_train_step", tb, to)


class _Boxes:
    """mmdet3d LiDARInstance3DBoxes' ``tensor`` and ``corners`` (corners precomputed: not what is timed)."""

    def __init__(self, tensor: torch.Tensor, corners: torch.Tensor) -> None:
        self.tensor, self.corners = tensor, corners


def _boxes(tensor: torch.Tensor) -> _Boxes:
    unit = torch.tensor([[0, 0, 0], [0, 0, 1], [0, 1, 1], [0, 1, 0], [1, 0, 0], [1, 0, 1], [1, 1, 1], [1, 1, 0]],
                        dtype=tensor.dtype) - torch.tensor([0.5, 0.5, 0.0])
    local = tensor[:, None, 3:6] * unit[None]
    c, s = tensor[:, 6].cos()[:, None], tensor[:, 6].sin()[:, None]
    xy = torch.stack([local[..., 0] * c - local[..., 1] * s, local[..., 0] * s + local[..., 1] * c], -1)
    return _Boxes(tensor, torch.cat([xy, local[..., 2:]], -1) + tensor[:, None, :3])


def bevfusion_camera_to_bev(quick: bool, target: str, reps: int, rounds: int) -> None:
    """BEVFusion's camera-to-BEV block: the vendored project registered in the Registry double at ``target``."""
    project, vt = _vendored("upstream_bevfusion_project", "lk_bench_bevfusion", target)
    feature, dbound = ((16, 44), (1.0, 60.0, 1.0)) if quick else ((32, 88), (1.0, 60.0, 0.5))
    lss = vt.LSSTransform(256, 80, (256, 704), feature, (-54.0, 54.0, 0.3), (-54.0, 54.0, 0.3), (-10.0, 10.0, 20.0),
                          dbound)
    gen = torch.Generator().manual_seed(0)
    cams, extra = project.camera_inputs(1, torch.float32, gen)
    x = torch.randn(1, 6, lss.D, *feature, 80, generator=gen).requires_grad_()
    grad = torch.randn(1, 80, 360, 360, generator=gen)

    def block() -> None:
        x.grad = None  # a fresh gradient per step, as for the depth-weighted features of a real model
        geom = lss.get_geometry(*cams, **extra)
        lss.bev_pool(geom, x).backward(grad)

    switch = Switch("bevfusion", target)
    compare("bevfusion_camera_to_bev", block, switch, reps, rounds)
    compare("bevfusion_get_geometry", lambda: lss.get_geometry(*cams, **extra), switch, reps, rounds)
    theirs = lss.get_geometry(*cams, **extra)
    switch.on()
    try:
        mine = lss.get_geometry(*cams, **extra)
    finally:
        switch.off()
    same = torch.equal(theirs.view(torch.int32), mine.view(torch.int32))
    print(f"bevfusion_get_geometry: patched == upstream bit for bit: {same}", flush=True)


def sparse4d_daf_block(quick: bool, target: str, reps: int, rounds: int) -> None:
    """Sparse4D's DeformableFeatureAggregation: the vendored project registered in the Registry double at ``target``."""
    import warnings

    project, blocks = _vendored("upstream_sparse4d_project", "lk_bench_sparse4d", target)
    levels = [(32, 88), (16, 44), (8, 22), (4, 11)] if quick else project.LEVELS
    gen = torch.Generator().manual_seed(0)
    dfa = project.build(blocks, torch.float32, gen)
    data = project.inputs(1, 900, torch.float32, gen, levels=levels)
    grad = torch.randn(1, 900, 256, generator=gen)

    def block() -> None:
        dfa.zero_grad()
        maps = [t.detach().requires_grad_() for t in data["feature_maps"]]  # the FPN's outputs in a real step
        instance = data["instance_feature"].detach().requires_grad_()
        anchor = data["anchor"].detach().requires_grad_()
        dfa(instance, anchor, data["anchor_embed"], maps, data["metas"]).backward(grad)

    with warnings.catch_warnings():  # upstream's grid_sample call relies on the default align_corners
        warnings.filterwarnings("ignore", "Default grid_sample", UserWarning)
        compare("sparse4d_daf_block", block, Switch("dag", target), reps, rounds)


if __name__ == "__main__":
    sys.exit(main())
