"""LOONGKIT_MMENGINE_DATA_PREFETCH against mmengine 0.10's real loops and Runner (mmdet data samples).

On a machine without CUDA the loops are driven through the CPU CloneLayer: the batches every hook
and the model see must be identical to a run without the feature, iteration counts and len()
unchanged. With a GPU the real CUDA layer runs the same comparison.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from loongkit_data.prefetch import CloneLayer, CudaLayer
from loongkit_data.prefetch_mmengine import install, preprocessor_device

from loongkit_core.patcher import Patcher

pytestmark = pytest.mark.integration
mmengine = pytest.importorskip("mmengine")
pytest.importorskip("mmcv")
from mmdet.structures import DetDataSample  # noqa: E402
from mmengine.dataset import default_collate, pseudo_collate  # noqa: E402
from mmengine.hooks import Hook  # noqa: E402
from mmengine.model import BaseDataPreprocessor, BaseModel  # noqa: E402
from mmengine.runner import Runner, loops  # noqa: E402
from mmengine.structures import InstanceData  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

CUDA = torch.cuda.is_available()


class Synthetic(Dataset):
    """Fresh random images and boxes each test (seeded by the test), mmdet 3.x packed format."""

    metainfo = {"classes": ("a", "b", "c")}

    def __init__(self, n: int, seed: int, sample: bool = True) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            img = torch.randint(0, 255, (3, 8 + (i % 3 if sample else 0), 10), generator=g, dtype=torch.uint8)
            if not sample:
                self.items.append({"inputs": img.float(), "label": torch.randint(0, 3, (1,), generator=g)})
                continue
            ds = DetDataSample(metainfo={"img_id": i, "img_shape": tuple(img.shape[1:]), "scale_factor": (1.0, 1.0)})
            ds.gt_instances = InstanceData(bboxes=torch.rand(2 + i % 2, 4, generator=g),
                                           labels=torch.randint(0, 3, (2 + i % 2,), generator=g))
            self.items.append({"inputs": img, "data_samples": ds})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


class Tiny(BaseModel):
    def __init__(self) -> None:
        super().__init__(data_preprocessor=BaseDataPreprocessor())
        self.w = torch.nn.Parameter(torch.ones(()))
        self.cast: list[Any] = []  # what cast_data handed to the model

    def forward(self, inputs: Any, data_samples: Any = None, mode: str = "tensor", **kwargs: Any) -> Any:
        self.cast.append((inputs, data_samples, kwargs))
        x = torch.stack([t.float().mean() for t in inputs]).sum() * self.w
        if mode == "loss":
            return {"loss": x}
        return list(data_samples) if mode == "predict" else x


class Record(Hook):
    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []
        self.lengths: list[int] = []

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self.seen.append(("train", batch_idx, data_batch))
        self.lengths.append(len(runner.train_dataloader))

    def before_val_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self.seen.append(("val", batch_idx, data_batch))


class Acc(mmengine.evaluator.BaseMetric):
    def process(self, data_batch: Any, data_samples: Any) -> None:
        self.results.append(len(data_samples))

    def compute_metrics(self, results: list[Any]) -> dict[str, float]:
        return {"n": float(sum(results))}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.cpu(), b.cpu())
    if isinstance(a, mmengine.structures.BaseDataElement):
        return type(a) is type(b) and a.metainfo == b.metainfo and sorted(a.keys()) == sorted(b.keys()) and \
            all(same(a.get(k), b.get(k)) for k in a.keys())  # noqa: SIM118 (not iterable)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def run(tmp_path: Any, layer_for: Callable[[Any], Any] | None, *, by_epoch: bool, collate: str, seed: int,
        name: str) -> tuple[Record, Tiny, Any]:
    hook, model = Record(), Tiny()
    if CUDA:
        model = model.cuda()
    patcher = Patcher()
    if layer_for is not None:
        install(patcher, loops, layer_for)
    sample = collate == "pseudo_collate"
    loader = dict(dataset=Synthetic(7, seed, sample=sample), batch_size=2, num_workers=0,
                  sampler=dict(type="DefaultSampler", shuffle=True, seed=seed), collate_fn=dict(type=collate))
    try:
        runner = Runner(
            model=model, work_dir=str(tmp_path / name), experiment_name=name,
            train_dataloader=loader,
            train_cfg=dict(by_epoch=True, max_epochs=2, val_interval=1) if by_epoch else
            dict(by_epoch=False, max_iters=6, val_interval=3),
            optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.01)),
            val_dataloader={**loader, "sampler": dict(type="DefaultSampler", shuffle=False)} if sample else None,
            val_cfg=dict() if sample else None, val_evaluator=dict(type=Acc) if sample else None,
            custom_hooks=[hook], default_hooks=dict(checkpoint=None, logger=None),
            log_level=logging.ERROR, randomness=dict(seed=seed), default_scope=None,
        )
        runner.train()
        return hook, model, runner
    finally:
        patcher.undo()


def layer_factory() -> tuple[Callable[[Any], Any], list[Any]]:
    made: list[Any] = []

    def layer_for(loop: Any) -> Any:
        layer = CudaLayer(torch, preprocessor_device(loop.runner.model)) if CUDA else CloneLayer(torch)
        made.append(layer)
        return layer

    return layer_for, made


@pytest.mark.parametrize(("by_epoch", "collate"), [(True, "pseudo_collate"), (False, "pseudo_collate"),
                                                   (True, "default_collate")])
def test_batches_identical_to_upstream(tmp_path: Any, by_epoch: bool, collate: str) -> None:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    base_hook, base_model, base_runner = run(tmp_path, None, by_epoch=by_epoch, collate=collate, seed=seed,
                                             name="base")
    layer_for, made = layer_factory()
    hook, model, runner = run(tmp_path, layer_for, by_epoch=by_epoch, collate=collate, seed=seed, name="ours")
    assert made, "the loops never asked for a device layer"
    assert [s[:2] for s in hook.seen] == [s[:2] for s in base_hook.seen]  # same steps, same order
    assert all(same(a[2], b[2]) for a, b in zip(base_hook.seen, hook.seen, strict=True))
    assert len(model.cast) == len(base_model.cast)
    assert all(same(a, b) for a, b in zip(base_model.cast, model.cast, strict=True))
    assert hook.lengths == base_hook.lengths == [4] * len(hook.lengths)
    assert runner.iter == base_runner.iter == (8 if by_epoch else 6)
    assert torch.equal(model.w.detach().cpu(), base_model.w.detach().cpu())
    # the loops got their own loaders back
    assert type(runner.train_loop.dataloader).__name__ == "DataLoader"
    if not CUDA:
        # the hook saw the layer's copies, not the loader's own tensors: the prefetch path really ran
        copied = sum(1 for layer in made for e in layer.log if e[0] == "finish")
        assert copied == len(hook.seen)


def test_cast_data_is_a_no_op_on_tensors_already_on_the_device() -> None:
    """What the feature relies on: cast_data moves nothing that is already on its device."""
    pre = BaseDataPreprocessor()
    dev = torch.device("cuda", 0) if CUDA else torch.device("cpu")
    pre.to(dev)
    batch = pseudo_collate([Synthetic(3, 1)[i] for i in range(3)])
    batch = {"inputs": [t.to(dev) for t in batch["inputs"]], "data_samples": [d.to(dev) for d in batch["data_samples"]]}
    out = pre.cast_data(batch)
    assert all(a is b for a, b in zip(out["inputs"], batch["inputs"], strict=True))
    pairs = zip(out["data_samples"], batch["data_samples"], strict=True)
    assert all(a.gt_instances.bboxes is b.gt_instances.bboxes for a, b in pairs)


def test_map_tensors_matches_base_data_element_to() -> None:
    from loongkit_data.prefetch import map_tensors

    sample = Synthetic(1, 5)[0]["data_samples"]
    ours = map_tensors(sample, lambda t: t.clone(), lambda x: isinstance(x, torch.Tensor))
    theirs = sample.to("cpu")
    assert type(ours) is DetDataSample and same(ours, theirs)
    assert ours.gt_instances.bboxes is not sample.gt_instances.bboxes


def test_default_collate_batch_structure_kept() -> None:
    items = [Synthetic(2, 3, sample=False)[i] for i in range(2)]
    batch = default_collate(items)
    out = CloneLayer(torch).finish(CloneLayer(torch).start(batch))
    assert same(batch, out)


SNIPPET = """
import mmengine.runner
print("LOADED")
"""


def test_not_applicable_without_gpu(run_loongkit: Any, fake_sysfs: Any) -> None:
    topo = fake_sysfs(gpus_per_node=(0, 0))
    res = run_loongkit(SNIPPET, env={"LOONGKIT_MMENGINE_DATA_PREFETCH": "1", "LOONGKIT_SYSFS_ROOT": str(topo.root)})
    assert res.returncode == 0 and "LOADED" in res.stdout, res.stderr
    row = res.feature("mmengine_data_prefetch")
    assert row["state"] == "not applicable" and row["reason"].startswith("no CUDA device"), row


CPU_TRAIN = """
import logging, torch
from mmengine.model import BaseModel, BaseDataPreprocessor
from mmengine.runner import Runner
class M(BaseModel):
    def __init__(self):
        super().__init__(data_preprocessor=BaseDataPreprocessor()); self.w = torch.nn.Parameter(torch.ones(()))
    def forward(self, inputs, data_samples=None, mode="tensor"):
        return {"loss": torch.stack([t.mean() for t in inputs]).sum() * self.w}
data = [{"inputs": torch.rand(3, 4)} for _ in range(6)]
Runner(model=M(), work_dir=WORK, train_dataloader=dict(dataset=data, batch_size=2,
       sampler=dict(type="DefaultSampler", shuffle=False), collate_fn=dict(type="pseudo_collate")),
       train_cfg=dict(by_epoch=True, max_epochs=1), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
       default_hooks=dict(checkpoint=None), log_level=logging.ERROR).train()
print("TRAINED")
"""


@pytest.mark.skipif(CUDA, reason="checks the CPU-model path; with a GPU the CUDA tests cover activation")
def test_applies_with_a_gpu_in_sysfs_and_says_why_a_cpu_model_is_not_prefetched(run_loongkit: Any, fake_sysfs: Any,
                                                                                  tmp_path: Any) -> None:
    topo = fake_sysfs(gpus_per_node=(1, 1))
    res = run_loongkit(f"WORK = {str(tmp_path / 'w')!r}\n" + CPU_TRAIN,
                       env={"LOONGKIT_MMENGINE_DATA_PREFETCH": "1", "LOONGKIT_SYSFS_ROOT": str(topo.root),
                            "LOONGKIT_LOGLEVEL": "info"})
    assert res.returncode == 0 and "TRAINED" in res.stdout, res.stderr
    row = res.feature("mmengine_data_prefetch")
    assert row["state"] == "applied" and row["targets"] == ["mmengine.runner"], row
    assert row["config"]["loops"][0] == "EpochBasedTrainLoop.run_epoch"
    assert row["reason"] == "not prefetching: the model's data_preprocessor is on cpu, not a CUDA device"
    assert "loop left without prefetch" in res.logs()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_active_on_a_gpu(run_loongkit: Any, tmp_path: Any) -> None:
    code = CPU_TRAIN.replace("model=M()", "model=M().cuda()")
    res = run_loongkit(f"WORK = {str(tmp_path / 'w')!r}\n" + code, env={"LOONGKIT_MMENGINE_DATA_PREFETCH": "1"})
    assert res.returncode == 0 and "TRAINED" in res.stdout, res.stderr
    row = res.feature("mmengine_data_prefetch")
    assert row["state"] == "active" and row["calls"] == 3, row


def test_invalid_value_leaves_it_off(run_loongkit: Any) -> None:
    res = run_loongkit(SNIPPET, env={"LOONGKIT_MMENGINE_DATA_PREFETCH": "maybe"})
    assert res.returncode == 0
    rows = [r for r in res.summary["features"] if r["name"] == "mmengine_data_prefetch"]
    assert all(r["enabled"] is False for r in rows)  # a disabled feature has no row, or an off one
    assert "LOONGKIT_MMENGINE_DATA_PREFETCH='maybe' is invalid" in res.stderr + res.logs()


def test_mmcv1_features_not_applicable_on_mmcv2(run_loongkit: Any) -> None:
    res = run_loongkit(SNIPPET, env={"LOONGKIT_DATA_CONTAINER": "1", "LOONGKIT_DATA_PREFETCH": "1"})
    assert res.returncode == 0, res.stderr
    for name in ("data_container", "data_prefetch"):
        row = res.feature(name)
        assert row["state"] == "not applicable" and "mmcv" in row["reason"], row
