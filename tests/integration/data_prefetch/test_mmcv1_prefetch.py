"""LOONGKIT_DATA_CONTAINER and LOONGKIT_DATA_PREFETCH against mmcv-full 1.7 / mmdet 2.28 (nox -s stack1)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from loongkit_data import datacontainer, prefetch_mmcv
from loongkit_data.prefetch import CloneLayer
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

from loongkit_core.patcher import Patcher

pytestmark = [pytest.mark.integration, pytest.mark.stack1]
mmcv = pytest.importorskip("mmcv")
if not mmcv.__version__.startswith("1."):
    pytest.skip(f"needs mmcv 1.x, found {mmcv.__version__}", allow_module_level=True)
from mmcv.parallel import DataContainer, MMDataParallel, collate  # noqa: E402
from mmcv.runner import EpochBasedRunner, Hook, IterBasedRunner  # noqa: E402
from mmdet.datasets import build_dataset  # noqa: E402
from mmdet.datasets import builder as mmdet_builder  # noqa: E402
from mmdet.datasets.pipelines import Collect, DefaultFormatBundle  # noqa: E402

CUDA = torch.cuda.is_available()
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


class Synthetic(torch.utils.data.Dataset):
    """mmdet 2.x results after the transforms: DefaultFormatBundle + Collect, fresh random data."""

    def __init__(self, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        bundle, collect = DefaultFormatBundle(), Collect(keys=["img", "gt_bboxes", "gt_labels"])
        self.items = []
        for i in range(n):
            img = rng.random((16, 16, 3), dtype=np.float32)
            k = 1 + i % 3
            results = {"img": img, "gt_bboxes": rng.random((k, 4), dtype=np.float32),
                       "gt_labels": rng.integers(0, 3, k), "filename": f"{i}.jpg", "ori_filename": f"{i}.jpg",
                       "ori_shape": img.shape, "img_shape": img.shape, "pad_shape": img.shape,
                       "scale_factor": np.ones(4, dtype=np.float32), "flip": False, "flip_direction": None,
                       "img_norm_cfg": {"mean": np.zeros(3), "std": np.ones(3), "to_rgb": False}}
            self.items.append(collect(bundle(results)))
        # mmdet 2.x CustomDataset's aspect-ratio group (width/height > 1); GroupSampler asserts it exists.
        self.flag = np.zeros(n, dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, DataContainer):
        return type(b) is DataContainer and (a.stack, a.cpu_only, a.padding_value, a.pad_dims) == \
            (b.stack, b.cpu_only, b.padding_value, b.pad_dims) and same(a.data, b.data)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


@pytest.fixture
def pinned_dc() -> Any:
    patcher = Patcher()
    patcher.patch(DataContainer, "pin_memory", datacontainer.make_pin_memory(), require=False)
    yield
    patcher.undo()
    assert not hasattr(DataContainer, "pin_memory")


def test_collated_batch_pins_like_upstream_values(pinned_dc: None, monkeypatch: pytest.MonkeyPatch) -> None:
    if not CUDA:  # torch cannot pin without CUDA: stand in for Tensor.pin_memory
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t.clone())
    ds = Synthetic(4, int(np.random.default_rng().integers(1 << 30)))
    batch = collate([ds[i] for i in range(4)], samples_per_gpu=2)
    out = torch_pin_memory(batch)
    assert same(batch, out)
    assert out["img_metas"] is batch["img_metas"] and out["img_metas"].cpu_only
    assert out["img"].data[0] is not batch["img"].data[0]
    if CUDA:
        assert out["img"].data[0].is_pinned() and all(t.is_pinned() for t in out["gt_bboxes"].data[0])


def test_mmdet_build_dataloader_gets_pin_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = Synthetic(4, 0)
    original = mmdet_builder.build_dataloader
    wrapped = datacontainer.wrap_build_dataloader(original, possible=lambda: True)
    assert wrapped(ds, 2, 0, dist=False, seed=0).pin_memory is True
    assert wrapped(ds, 2, 0, dist=False, seed=0, pin_memory=False).pin_memory is False
    assert original(ds, 2, 0, dist=False, seed=0).pin_memory is False  # upstream hard-codes False
    reasons: list[str] = []
    real = datacontainer.wrap_build_dataloader(original, on_skip=reasons.append)
    assert real(ds, 2, 0, dist=False).pin_memory is CUDA
    assert reasons == ([] if CUDA else [datacontainer.NO_CUDA])


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))
        self.seen: list[Any] = []

    def train_step(self, data: dict[str, Any], optimizer: Any, **kwargs: Any) -> dict[str, Any]:
        self.seen.append(data)
        loss = data["img"].float().mean() * self.w
        return {"loss": loss, "log_vars": {"loss": float(loss.detach())}, "num_samples": data["img"].shape[0]}

    def val_step(self, data: dict[str, Any], optimizer: Any = None, **kwargs: Any) -> dict[str, Any]:
        return self.train_step(data, optimizer)


class Capture(Hook):
    def __init__(self, into: list[Any]) -> None:
        self.into = into

    def before_train_iter(self, runner: Any) -> None:
        self.into.append(runner.data_batch)


def run(tmp_path: Any, seed: int, layer_for: Any, iter_based: bool, dataset: Any = None,
        build: Any = None, workers: int = 0, raw: list[Any] | None = None) -> list[Any]:
    """Train Tiny through a real mmcv runner on an mmdet 2.x loader; the batches train_step saw (after
    MMDataParallel's scatter); ``raw`` gets the DataContainer batches the runner iterated."""
    patcher = Patcher()
    if layer_for is not None:
        prefetch_mmcv.install(patcher, mmcv.runner, layer_for)
    try:
        # mmdet 2.x's GroupSampler shuffles with the global numpy RNG (what set_random_seed seeds), the
        # iter-based samplers with a torch generator: seed both, as a training script does.
        np.random.seed(seed)
        torch.manual_seed(seed)
        build = build or mmdet_builder.build_dataloader
        loader = build(Synthetic(7, seed) if dataset is None else dataset, 2, workers, dist=False, seed=seed,
                       shuffle=True, runner_type="IterBasedRunner" if iter_based else "EpochBasedRunner")
        tiny = Tiny()
        model = MMDataParallel(tiny.cuda(), device_ids=[0]) if CUDA else MMDataParallel(tiny)  # CPU: no device_ids
        cls = IterBasedRunner if iter_based else EpochBasedRunner
        runner = cls(model, work_dir=str(tmp_path), logger=logging.getLogger("t"),
                     max_iters=6 if iter_based else None, max_epochs=None if iter_based else 2)
        if raw is not None:
            runner.register_hook(Capture(raw))
        runner.run([loader], [("train", 1)])
        return tiny.seen
    finally:
        patcher.undo()


@pytest.mark.parametrize("iter_based", [False, True])
def test_runner_batches_identical(tmp_path: Any, iter_based: bool) -> None:
    seed = int(np.random.default_rng().integers(1 << 30))
    base = run(tmp_path / "a", seed, None, iter_based)
    layers: list[CloneLayer] = []

    def layer_for(runner: Any) -> CloneLayer:
        layers.append(CloneLayer(torch))
        return layers[-1]

    ours = run(tmp_path / "b", seed, layer_for, iter_based)
    assert len(base) == len(ours) == (6 if iter_based else 8)
    assert all(same(a, b) for a, b in zip(base, ours, strict=True))
    assert sum(1 for la in layers for e in la.log if e[0] == "finish") >= len(ours)


def coco_pipeline_dataset(root: Any, seed: int) -> Any:
    """mmdet 2.x CocoDataset over the examples' synthetic COCO files, with the training pipeline of a
    2.x config (random PhotoMetricDistortion and RandomFlip included) ending in DataContainers."""
    spec = importlib.util.spec_from_file_location("lk_synthetic_coco", EXAMPLES / "synthetic_coco.py")
    synthetic = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(synthetic)  # type: ignore[union-attr]
    root.mkdir(parents=True, exist_ok=True)
    ann = synthetic.make_dataset(root, 6, seed)
    pipeline = [
        dict(type="LoadImageFromFile", to_float32=True), dict(type="LoadAnnotations", with_bbox=True),
        dict(type="PhotoMetricDistortion"), dict(type="Resize", img_scale=(96, 96), keep_ratio=True),
        dict(type="RandomFlip", flip_ratio=0.5),
        dict(type="Normalize", mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375], to_rgb=True),
        dict(type="Pad", size_divisor=32), dict(type="DefaultFormatBundle"),
        dict(type="Collect", keys=["img", "gt_bboxes", "gt_labels"]),
    ]
    return build_dataset(dict(type="CocoDataset", ann_file=str(ann), img_prefix=str(root) + "/",
                              classes=synthetic.CLASSES, pipeline=pipeline))


@pytest.mark.parametrize("workers", [0, 2])
def test_mmdet2_pipeline_batches_identical_with_pinning_and_prefetch(
        tmp_path: Any, pinned_dc: None, monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    """DATA_CONTAINER (pinned DataContainers from mmdet's build_dataloader) + DATA_PREFETCH (through the
    CPU copy layer) against upstream: the batches train_step sees are the same, in the same order."""
    seed = int(np.random.default_rng().integers(1 << 30))
    dataset = coco_pipeline_dataset(tmp_path / "data", seed)
    pinned: list[torch.Tensor] = []
    real_pin = torch.Tensor.pin_memory

    def pin(t: torch.Tensor) -> torch.Tensor:
        out = real_pin(t) if CUDA else t.clone()
        pinned.append(out)
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    if not CUDA:  # torch's DataLoader pins only where an accelerator exists: let it believe one does
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
        monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)

    raw_base: list[Any] = []
    raw_ours: list[Any] = []
    base = run(tmp_path / "a", seed, None, False, dataset=dataset, workers=workers, raw=raw_base)
    assert not pinned  # upstream's loader does not pin
    layers: list[CloneLayer] = []

    def layer_for(runner: Any) -> CloneLayer:
        layers.append(CloneLayer(torch))
        return layers[-1]

    build = datacontainer.wrap_build_dataloader(mmdet_builder.build_dataloader, possible=lambda: True)
    ours = run(tmp_path / "b", seed, layer_for, False, dataset=dataset, build=build, workers=workers, raw=raw_ours)
    assert len(base) == len(ours) == len(raw_base) == len(raw_ours) == 6  # 2 epochs of 3 batches
    assert all(same(a, b) for a, b in zip(base, ours, strict=True))
    # The DataContainers themselves too: stack, cpu_only, padding_value, pad_dims, metas.
    assert all(same(a, b) for a, b in zip(raw_base, raw_ours, strict=True))
    # Every tensor of the non-cpu_only DataContainers went through pin_memory once; metas never did.
    expected = sum(len(b["img"].data) + sum(len(x) for x in b["gt_bboxes"].data) +
                   sum(len(x) for x in b["gt_labels"].data) for b in raw_base)
    assert len(pinned) == expected
    assert all(b["img_metas"].cpu_only for b in raw_base)
    assert sum(1 for la in layers for e in la.log if e[0] == "finish") == len(ours)


SNIPPET = """
import mmcv.runner, mmdet.datasets
print("LOADED", mmdet.datasets.build_dataloader.__name__)
"""


def test_prefetch_needs_data_container(run_loongkit: Any, fake_sysfs: Any) -> None:
    topo = fake_sysfs(gpus_per_node=(1, 1))
    res = run_loongkit(SNIPPET, env={"LOONGKIT_DATA_PREFETCH": "1", "LOONGKIT_SYSFS_ROOT": str(topo.root)})
    assert res.returncode == 0 and "LOADED" in res.stdout, res.stderr
    row = res.feature("data_prefetch")
    assert row["state"] == "not applicable"
    assert row["reason"] == "needs LOONGKIT_DATA_CONTAINER enabled and applicable"


# What train_detector calls is mmdet.apis.train's own copy of the name, bound by ``from ... import``.
SNIPPET_APIS = SNIPPET + """
import mmdet.apis.train, mmdet.datasets.builder as b
print("WRAPPED", b.build_dataloader.__wrapped__ is not None,
      mmdet.datasets.build_dataloader is b.build_dataloader, mmdet.apis.train.build_dataloader is b.build_dataloader)
"""


def test_both_applied_with_a_gpu_in_sysfs(run_loongkit: Any, fake_sysfs: Any) -> None:
    topo = fake_sysfs(gpus_per_node=(1, 1))
    res = run_loongkit(SNIPPET_APIS, env={"LOONGKIT_DATA_PREFETCH": "1", "LOONGKIT_DATA_CONTAINER": "1",
                                          "LOONGKIT_SYSFS_ROOT": str(topo.root)})
    assert res.returncode == 0 and "LOADED" in res.stdout, res.stderr
    assert "WRAPPED True True True" in res.stdout, res.stdout
    dc, pf = res.feature("data_container"), res.feature("data_prefetch")
    assert dc["state"] == "applied" and pf["state"] == "applied", (dc, pf)
    assert dc["config"]["build_dataloader"] == ["mmdet.datasets.builder", "mmdet.datasets", "mmdet.apis.train"]
    if not CUDA:
        assert dc["reason"] == datacontainer.NO_CUDA


def test_prefetch_not_applicable_without_gpu(run_loongkit: Any, fake_sysfs: Any) -> None:
    topo = fake_sysfs(gpus_per_node=(0, 0))
    res = run_loongkit(SNIPPET, env={"LOONGKIT_DATA_PREFETCH": "1", "LOONGKIT_DATA_CONTAINER": "1",
                                     "LOONGKIT_MMENGINE_DATA_PREFETCH": "1", "LOONGKIT_SYSFS_ROOT": str(topo.root)})
    assert res.returncode == 0, res.stderr
    assert res.feature("data_prefetch")["reason"].startswith("no CUDA device")
    assert res.feature("data_container")["state"] == "applied"
    # The mmengine variant's version gate on this stack (the unit test of the gates skips where mmcv exists).
    row = res.feature("mmengine_data_prefetch")
    assert row["state"] == "not applicable" and f"mmcv {mmcv.__version__} outside" in row["reason"], row
