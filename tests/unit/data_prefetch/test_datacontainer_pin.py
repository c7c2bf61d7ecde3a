"""LOONGKIT_DATA_CONTAINER's logic and LOONGKIT_DATA_PREFETCH's runner patches, against test doubles of
mmcv 1.x's DataContainer / runners / IterLoader (the real packages: tests/integration/data_prefetch)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from loongkit_data import datacontainer, prefetch_mmcv
from loongkit_data.prefetch import CloneLayer
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

from loongkit_core.context import NotApplicable
from loongkit_core.patcher import Patcher

CUDA = torch.cuda.is_available()


class DataContainer:
    """Behaves like mmcv 1.7's container: read-only properties, pad_dims in (None, 1, 2, 3)."""

    def __init__(self, data: Any, stack: bool = False, padding_value: int = 0, cpu_only: bool = False,
                 pad_dims: int | None = 2) -> None:
        assert pad_dims in (None, 1, 2, 3)
        self._data, self._stack, self._padding_value, self._cpu_only, self._pad_dims = \
            data, stack, padding_value, cpu_only, pad_dims

    data = property(lambda self: self._data)
    stack = property(lambda self: self._stack)
    padding_value = property(lambda self: self._padding_value)
    cpu_only = property(lambda self: self._cpu_only)
    pad_dims = property(lambda self: self._pad_dims)


@pytest.fixture
def dc_cls() -> Any:
    cls = type("DataContainer", (DataContainer,), {})  # a fresh class per test: patches never leak
    patcher = Patcher()
    pins: list[int] = []
    patcher.patch(cls, "pin_memory", datacontainer.make_pin_memory(lambda: pins.append(1)), require=False)
    cls.pins = pins
    yield cls
    patcher.undo()
    assert not hasattr(cls, "pin_memory")


@pytest.fixture
def fake_pinning(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Without CUDA Tensor.pin_memory raises; stand in for it (records what was pinned)."""
    if CUDA:
        return []
    pinned: list[torch.Tensor] = []

    def pin(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        pinned.append(out)
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    return pinned


def collated(cls: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(int(torch.randint(0, 1000, ()).item()))
    return {"img": cls([torch.rand(2, 3, 8, 8, generator=g)], stack=True, padding_value=0, pad_dims=2),
            "gt_bboxes": cls([[torch.rand(3, 4, generator=g), torch.rand(1, 4, generator=g)]]),
            "gt_semantic_seg": cls([torch.zeros(2, 1, 8, 8, dtype=torch.uint8)], stack=True, padding_value=255),
            "img_metas": cls([[{"filename": "a.jpg", "ori_shape": (8, 8, 3)}]], cpu_only=True)}


def test_torch_pin_memory_uses_the_container_method(dc_cls: Any, fake_pinning: list[torch.Tensor]) -> None:
    batch = collated(dc_cls)
    out = torch_pin_memory(batch)  # what DataLoader's pin thread runs
    assert out.keys() == batch.keys()
    assert out["img_metas"] is batch["img_metas"]  # cpu_only: never pinned, same object
    for key in ("img", "gt_bboxes", "gt_semantic_seg"):
        a, b = batch[key], out[key]
        assert type(b) is dc_cls and b is not a
        assert (b.stack, b.padding_value, b.cpu_only, b.pad_dims) == (a.stack, a.padding_value, a.cpu_only, a.pad_dims)
    assert torch.equal(out["img"].data[0], batch["img"].data[0])
    assert all(torch.equal(x, y) for x, y in zip(out["gt_bboxes"].data[0], batch["gt_bboxes"].data[0], strict=True))
    assert dc_cls.pins == [1, 1, 1]
    if CUDA:
        assert out["img"].data[0].is_pinned() and out["gt_bboxes"].data[0][1].is_pinned()
    else:
        assert len(fake_pinning) == 4  # img, two boxes, seg: every tensor outside cpu_only


@pytest.mark.skipif(CUDA, reason="checks torch's behaviour without a CUDA device")
def test_without_cuda_torch_cannot_pin(dc_cls: Any) -> None:
    with pytest.raises(RuntimeError):
        torch.ones(1).pin_memory()
    assert not datacontainer.pinning_possible()
    meta = dc_cls([{"a": 1}], cpu_only=True)
    assert meta.pin_memory() is meta  # cpu_only never touches torch's pinning


def test_build_dataloader_wrapper_respects_an_explicit_choice() -> None:
    seen: list[dict[str, Any]] = []

    def build_dataloader(dataset: Any, samples_per_gpu: int, workers_per_gpu: int, **kwargs: Any) -> dict[str, Any]:
        seen.append(kwargs)
        return kwargs

    skips: list[str] = []
    on = datacontainer.wrap_build_dataloader(build_dataloader, possible=lambda: True, on_skip=skips.append)
    off = datacontainer.wrap_build_dataloader(build_dataloader, possible=lambda: False, on_skip=skips.append)
    assert on([], 2, 2, dist=False) == {"dist": False, "pin_memory": True}
    assert on([], 2, 2, pin_memory=False) == {"pin_memory": False}
    assert off([], 2, 2) == {}
    assert skips == [datacontainer.NO_CUDA]
    assert on.__wrapped__ is build_dataloader and on.__name__ == "build_dataloader"
    # A from-import copy outlives an undo: with the feature off the wrapper only calls through.
    enabled = [False]
    gated = datacontainer.wrap_build_dataloader(build_dataloader, possible=lambda: True, enabled=lambda: enabled[0])
    assert gated([], 2, 2) == {}
    enabled[0] = True
    assert gated([], 2, 2) == {"pin_memory": True}


def test_patch_builder_rebinds_modules_that_imported_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def build_dataloader() -> str:
        return "orig"

    builder = types.ModuleType("mmdet.datasets.builder")
    builder.build_dataloader = build_dataloader
    pkg = types.ModuleType("mmdet.datasets")
    pkg.build_dataloader = build_dataloader
    other = types.ModuleType("mmdet.apis")
    other.build_dataloader = lambda: "someone else's"
    monkeypatch.setitem(sys.modules, "mmdet.datasets", pkg)
    monkeypatch.setitem(sys.modules, "mmdet.apis", other)
    monkeypatch.delitem(sys.modules, "mmdet.apis.train", raising=False)
    patcher = Patcher()

    def wrapper() -> str:
        return "ours"

    assert datacontainer.patch_builder(patcher, builder, wrapper) == ["mmdet.datasets.builder", "mmdet.datasets"]
    assert builder.build_dataloader() == pkg.build_dataloader() == "ours"
    assert other.build_dataloader() == "someone else's"
    patcher.undo()
    assert builder.build_dataloader is build_dataloader and pkg.build_dataloader is build_dataloader
    with pytest.raises(NotApplicable):
        datacontainer.patch_builder(patcher, types.ModuleType("mmdet.datasets.builder"), wrapper)


def test_feature_default_deactivate_restores_and_reapplies(monkeypatch: pytest.MonkeyPatch) -> None:
    """DataContainerPin on stand-ins for mmcv.parallel and mmdet's builder: the default deactivate
    (ctx.patcher.undo(), no override) removes pin_memory, rebinds the builders, and turns the wrapper
    a module copied by name into a call-through; activating again wraps the original (not the old
    wrapper) and rebinds that module too."""
    from loongkit_data.plugin import plugin

    from loongkit_core.context import ActivationContext

    cls = type("DataContainer", (DataContainer,), {})
    parallel = types.ModuleType("mmcv.parallel")
    parallel.DataContainer = cls  # type: ignore[attr-defined]

    def build_dataloader(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return kwargs

    builder = types.ModuleType("mmdet.datasets.builder")
    builder.build_dataloader = build_dataloader  # type: ignore[attr-defined]
    pkg = types.ModuleType("mmdet.datasets")
    pkg.build_dataloader = build_dataloader  # type: ignore[attr-defined]
    train = types.ModuleType("mmdet.apis.train")  # imported later: copies the wrapper by name
    for name, module in (("mmcv", types.ModuleType("mmcv")), ("mmcv.parallel", parallel),
                         ("mmdet.datasets.builder", builder), ("mmdet.datasets", pkg)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "mmdet.apis.train", raising=False)
    # Pinning possible, so the wrapper pins: torch.accelerator from torch 2.6, torch.cuda before (as the wrapper reads).
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        monkeypatch.setattr(accelerator, "is_available", lambda: True)
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pins = {"dist": False, "pin_memory": True}

    feature = plugin.feature("data_container")
    impl = datacontainer.DataContainerPin(feature)
    ctx = ActivationContext.standalone(feature)
    impl.activate(ctx, "mmcv.parallel")
    assert callable(cls.pin_memory)
    first = builder.build_dataloader
    assert first is pkg.build_dataloader and first.__wrapped__ is build_dataloader and first(dist=False) == pins
    train.build_dataloader = first  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mmdet.apis.train", train)
    impl.deactivate(ctx)
    assert not hasattr(cls, "pin_memory") and len(ctx.patcher) == 0
    assert builder.build_dataloader is build_dataloader and pkg.build_dataloader is build_dataloader
    assert train.build_dataloader is first and first(dist=False) == {"dist": False}  # off: calls through

    impl.activate(ctx, "mmcv.parallel")
    second = builder.build_dataloader
    assert second is not first and second.__wrapped__ is build_dataloader  # not a wrapper of a wrapper
    assert pkg.build_dataloader is second and train.build_dataloader is second and second(dist=False) == pins
    assert ctx.config == {"DataContainer.pin_memory": True,
                          "build_dataloader": ["mmdet.datasets.builder", "mmdet.datasets", "mmdet.apis.train"]}
    impl.deactivate(ctx)
    assert not hasattr(cls, "pin_memory")
    assert (builder.build_dataloader, pkg.build_dataloader, train.build_dataloader) == (build_dataloader,
                                                                                        build_dataloader, first)
    assert first(dist=False) == second(dist=False) == {"dist": False}


# -- mmcv 1.x runners ----------------------------------------------------------------------------------
class IterLoader:
    """mmcv 1.x IterLoader: restarts its DataLoader at the end, counting epochs."""

    def __init__(self, loader: Any) -> None:
        self._loader, self._epoch, self.iter_loader = loader, 0, iter(loader)

    @property
    def epoch(self) -> int:
        return self._epoch

    def __next__(self) -> Any:
        try:
            return next(self.iter_loader)
        except StopIteration:
            self._epoch += 1
            self.iter_loader = iter(self._loader)
            return next(self.iter_loader)

    def __len__(self) -> int:
        return len(self._loader)


def fake_runners() -> types.SimpleNamespace:
    class Base:
        def __init__(self, model: Any) -> None:
            self.model, self.steps = model, []

    class EpochBasedRunner(Base):
        def train(self, data_loader: Any, **kwargs: Any) -> None:
            self.data_loader = data_loader
            self.max_iters = len(data_loader)
            for i, batch in enumerate(data_loader):
                self.steps.append(("train", i, batch))

        def val(self, data_loader: Any, **kwargs: Any) -> None:
            for i, batch in enumerate(data_loader):
                self.steps.append(("val", i, batch))

    class IterBasedRunner(Base):
        def train(self, data_loader: Any, **kwargs: Any) -> None:
            epoch = data_loader.epoch  # read before next(), as mmcv does
            self.steps.append(("iter", epoch, next(data_loader)))

    return types.SimpleNamespace(EpochBasedRunner=EpochBasedRunner, IterBasedRunner=IterBasedRunner)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, DataContainer):
        return type(a) is type(b) and a.cpu_only == b.cpu_only and a.stack == b.stack and same(a.data, b.data)
    return a == b


def drive(runners: Any, loader: list[Any], iters: int) -> list[Any]:
    model = types.SimpleNamespace(device_ids=[0])
    er = runners.EpochBasedRunner(model)
    er.train(loader)
    er.val(loader)
    assert er.max_iters == len(loader)
    ir = runners.IterBasedRunner(model)
    it_loader = IterLoader(loader)
    for _ in range(iters):
        ir.train(it_loader)
    return er.steps + ir.steps


def test_runner_patches_same_batches_same_epochs() -> None:
    loader = [collated(DataContainer) for _ in range(3)]
    baseline = drive(fake_runners(), loader, iters=7)
    runners = fake_runners()
    patcher, layers = Patcher(), []

    def layer_for(runner: Any) -> CloneLayer:
        layers.append(CloneLayer(torch))
        return layers[-1]

    assert prefetch_mmcv.install(patcher, runners, layer_for) == [
        "EpochBasedRunner.train", "EpochBasedRunner.val", "IterBasedRunner.train"]
    ours = drive(runners, loader, iters=7)
    assert [s[:2] for s in ours] == [s[:2] for s in baseline]  # epochs of IterBasedRunner unchanged too
    assert all(same(a[2], b[2]) for a, b in zip(baseline, ours, strict=True))
    assert len(layers) == 3  # train, val, and one for the IterLoader (not one per step)
    assert ours[0][2]["img"].data[0] is not loader[0]["img"].data[0]  # went through the layer
    assert ours[0][2]["img_metas"] is loader[0]["img_metas"]  # cpu_only untouched
    patcher.undo()
    assert "train" in fake_runners().EpochBasedRunner.__dict__


def test_runner_without_a_single_cuda_device_is_left_alone() -> None:
    for model, why in ((types.SimpleNamespace(), "has no device_ids"),
                       (types.SimpleNamespace(device_ids=[0, 1]), "spans 2 devices"),
                       (types.SimpleNamespace(device_ids=[-1]), "not a CUDA device"),
                       (types.SimpleNamespace(device_ids=[torch.device("cpu")]), "not a CUDA device")):
        index, reason = prefetch_mmcv.wrapper_device(model)
        assert index is None and why in reason
    assert prefetch_mmcv.wrapper_device(types.SimpleNamespace(device_ids=[torch.device("cuda", 3)])) == (3, None)
    reasons: list[str] = []
    pick = prefetch_mmcv.CudaLayers(reasons.append)
    assert pick(types.SimpleNamespace(model=types.SimpleNamespace(device_ids=[-1]))) is None and reasons


def test_broken_runner_module_is_not_applicable() -> None:
    runners = fake_runners()
    del runners.IterBasedRunner
    patcher = Patcher()
    with pytest.raises(NotApplicable, match="IterBasedRunner"):
        prefetch_mmcv.install(patcher, runners, lambda r: None)
    assert len(patcher) == 0
