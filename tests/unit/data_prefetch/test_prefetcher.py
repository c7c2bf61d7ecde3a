"""The prefetcher's semantics on the CPU (CloneLayer), and the CUDA layer where a GPU is present."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from loongkit_data import prefetch
from loongkit_data.prefetch import CloneLayer, Prefetcher, PrefetchingLoader, map_tensors
from torch.utils.data import DataLoader, Dataset

from loongkit_core import requirements
from loongkit_core.context import NotApplicable
from loongkit_core.patcher import Patcher


def batches(n: int, seed: int = 0) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    return [{"inputs": [torch.randn(3, 4, generator=g)], "label": torch.randint(0, 9, (2,), generator=g),
             "meta": {"idx": i, "name": f"img{i}"}} for i in range(n)]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class Counting:
    """An iterator over ``items`` that counts how many were pulled."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.pulled = 0

    def __iter__(self) -> Counting:
        return self

    def __next__(self) -> Any:
        if self.pulled >= len(self.items):
            raise StopIteration
        self.pulled += 1
        item = self.items[self.pulled - 1]
        if isinstance(item, Exception):
            raise item
        return item


def test_same_batches_same_order_copied() -> None:
    src = batches(5)
    out = list(Prefetcher(iter(src), CloneLayer(torch)))
    assert len(out) == 5 and all(same(a, b) for a, b in zip(src, out, strict=True))
    # really copied by the layer: new tensors, same values
    pairs = zip(src, out, strict=True)
    assert all(a["label"] is not b["label"] and a["inputs"][0] is not b["inputs"][0] for a, b in pairs)


def test_next_copy_is_queued_before_the_step_runs() -> None:
    layer = CloneLayer(torch)
    it = Prefetcher(iter(batches(3)), layer)
    next(it)
    assert layer.log == [("start", 0), ("finish", 0), ("start", 1)]  # batch 1 in flight during step 0
    next(it)
    assert layer.log[3:] == [("finish", 1), ("start", 2)]
    next(it)
    assert layer.log[5:] == [("finish", 2)]
    with pytest.raises(StopIteration):
        next(it)


def test_exhaustion_is_sticky_and_empty_source() -> None:
    src = Counting(batches(2))
    it = Prefetcher(src, CloneLayer(torch))
    assert len(list(it)) == 2
    for _ in range(3):
        with pytest.raises(StopIteration):
            next(it)
    assert list(Prefetcher(iter([]), CloneLayer(torch))) == []


def test_source_error_is_the_same_object_at_the_same_step_and_iteration_goes_on() -> None:
    err = ValueError("bad sample 2")
    items = [*batches(2), err, *batches(2, seed=1)]
    plain, ours = [], []
    for target, it in ((plain, Counting(items)), (ours, Prefetcher(Counting(items), CloneLayer(torch)))):
        while True:
            try:
                target.append(next(it))
            except StopIteration:
                break
            except ValueError as exc:
                target.append(exc)
    assert len(plain) == len(ours) == 5
    assert ours[2] is err and plain[2] is err
    assert all(same(a, b) for i, (a, b) in enumerate(zip(plain, ours, strict=True)) if i != 2)


def test_error_does_not_surface_one_step_early() -> None:
    src = Counting([*batches(1), KeyError("k")])
    it = Prefetcher(src, CloneLayer(torch))
    next(it)  # batch 0 is fine although batch 1's read (already done) failed
    assert src.pulled == 2
    with pytest.raises(KeyError, match="k"):
        next(it)


class Flaky(Dataset):
    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            raise RuntimeError(f"cannot decode sample {i}")
        return torch.full((2,), float(i))


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_worker_error_propagates_unchanged(workers: int) -> None:
    torch_version = requirements.installed("torch").version
    if workers and torch_version.startswith("2.4."):
        # Seen with torch 2.4.1 (nox -s compat-torch2.4): the file's run hung in 1 of 6 tries here, the main
        # process waiting for a batch after an earlier errored run's iterator (and its workers) was left to the
        # garbage collector; never seen on torch 2.13/2.14 (CI runs this every time). Not looked into further.
        pytest.skip(f"torch {torch_version}: DataLoader workers after an errored run hang intermittently")
    def run(wrap: bool) -> tuple[int, type, str]:
        loader = DataLoader(Flaky(8, bad=5), batch_size=2, num_workers=workers)
        if wrap:
            loader = PrefetchingLoader(loader, lambda it: Prefetcher(it, CloneLayer(torch)))
        steps = 0
        try:
            for _ in loader:
                steps += 1
        except RuntimeError as exc:
            return steps, type(exc), str(exc).splitlines()[0] if workers else str(exc)
        raise AssertionError("no error")

    assert run(True) == run(False)
    assert run(True)[0] == 2


def test_loader_stand_in_keeps_len_attributes_and_reiterates_each_epoch() -> None:
    g = torch.Generator().manual_seed(3)
    data = [torch.tensor([i]) for i in range(10)]
    loader = DataLoader(data, batch_size=3, shuffle=True, generator=g)
    proxy = PrefetchingLoader(loader, lambda it: Prefetcher(it, CloneLayer(torch)))
    assert len(proxy) == len(loader) == 4
    assert isinstance(proxy, DataLoader) and proxy.dataset is data and proxy.batch_size == 3
    proxy.custom_flag = True  # writes reach the loader
    assert loader.custom_flag is True
    g.manual_seed(7)
    ours = [list(proxy), list(proxy)]
    g.manual_seed(7)
    plain = [list(loader), list(loader)]
    assert all(same(a, b) for a, b in zip(ours, plain, strict=True))
    assert not same(ours[0], ours[1])  # two different shuffles: the epochs really re-iterate


def test_skip_passes_through_and_limit_pulls_nothing_extra() -> None:
    src = Counting(batches(10))
    layer = CloneLayer(torch)
    it = Prefetcher(src, layer, skip=3, limit=4)
    skipped = [next(it) for _ in range(3)]
    assert all(a is b for a, b in zip(skipped, src.items[:3], strict=True)) and layer.log == []
    live = [next(it) for _ in range(4)]
    assert src.pulled == 7  # no eighth batch was read ahead
    assert all(same(a, b) for a, b in zip(live, src.items[3:7], strict=True))
    assert [e for e in layer.log if e[0] == "finish"] == [("finish", n) for n in range(4)]
    extra = next(it)  # past the limit the source is read directly, uncopied
    assert extra is src.items[7]


class Failing(CloneLayer):
    def __init__(self, fail_start_at: int | None = None, fail_finish: bool = False) -> None:
        super().__init__(torch)
        self.fail_start_at, self.fail_finish = fail_start_at, fail_finish

    def start(self, batch: Any) -> Any:
        if self._started == self.fail_start_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().start(batch)

    def finish(self, handle: Any) -> Any:
        if self.fail_finish:
            raise RuntimeError("stream broken")
        return super().finish(handle)


@pytest.mark.parametrize("layer", [Failing(fail_start_at=2), Failing(fail_finish=True)])
def test_layer_fault_falls_back_to_host_batches(layer: Failing) -> None:
    src = batches(6)
    faults: list[BaseException] = []
    copied: list[int] = []
    out = list(Prefetcher(iter(src), layer, on_fault=faults.append, on_copied=lambda: copied.append(1)))
    assert len(out) == 6 and all(same(a, b) for a, b in zip(src, out, strict=True))
    assert len(faults) == 1
    assert out[-1] is src[-1]  # the rest pass through untouched
    assert len(copied) == (2 if layer.fail_start_at == 2 else 0)


Point = collections.namedtuple("Point", "xy label")


class DataContainer:  # mmcv 1.x's DataContainer, as far as the prefetcher looks at it
    def __init__(self, data: Any, stack: bool = False, padding_value: int = 0, cpu_only: bool = False,
                 pad_dims: int | None = 2) -> None:
        self.data, self.stack, self.padding_value, self.cpu_only, self.pad_dims = \
            data, stack, padding_value, cpu_only, pad_dims


class Tagged(dict):
    tag = "kept"


def test_map_tensors_keeps_structures() -> None:
    t = torch.arange(4)
    dc = DataContainer([t], stack=True, padding_value=7, pad_dims=1)
    meta = DataContainer([{"file": "a.jpg"}], cpu_only=True)
    data = Tagged(img=dc, meta=meta, p=Point(t, 3), tup=(t, "s"), lst=[t, None], b=b"x")
    out = map_tensors(data, lambda x: x + 1, lambda x: isinstance(x, torch.Tensor))
    assert type(out) is Tagged and out.tag == "kept"
    assert type(out["img"]) is DataContainer and torch.equal(out["img"].data[0], t + 1)
    assert (out["img"].stack, out["img"].padding_value, out["img"].cpu_only, out["img"].pad_dims) == (True, 7, False, 1)
    assert out["meta"] is meta  # cpu_only data never moves
    assert type(out["p"]) is Point and torch.equal(out["p"].xy, t + 1) and out["p"].label == 3
    assert type(out["tup"]) is tuple and out["tup"][1] == "s"
    assert out["lst"][1] is None and out["b"] == b"x"
    assert torch.equal(t, torch.arange(4))  # input untouched


def fake_loops() -> SimpleNamespace:
    class Loop:
        def __init__(self, loader: Any) -> None:
            self.dataloader = loader
            self.seen: list[Any] = []

        def run(self) -> list[Any]:
            for batch in self.dataloader:
                self.seen.append(batch)
            return self.seen

    class Epoch(Loop):
        def run_epoch(self) -> list[Any]:
            assert len(self.dataloader) == 3
            return self.run()

    class Iter:
        def __init__(self, it: Iterator[Any], max_iters: int, start: int = 0) -> None:
            self.dataloader_iterator, self._max_iters, self._iter = it, max_iters, start

        def run(self) -> list[Any]:
            for _ in range(self._iter):
                next(self.dataloader_iterator)
            out = []
            while self._iter < self._max_iters:
                out.append(next(self.dataloader_iterator))
                self._iter += 1
            return out

    return SimpleNamespace(EpochBasedTrainLoop=Epoch, IterBasedTrainLoop=Iter, ValLoop=Loop, TestLoop=Loop)


def test_install_patches_loops_and_undo_restores() -> None:
    from loongkit_data.prefetch_mmengine import install

    loops = fake_loops()
    before = {name: getattr(loops, name).__dict__.get(m) for name, m in
              (("EpochBasedTrainLoop", "run_epoch"), ("IterBasedTrainLoop", "run"), ("ValLoop", "run"))}
    patcher, layer = Patcher(), CloneLayer(torch)
    assert install(patcher, loops, lambda loop: layer) == [
        "EpochBasedTrainLoop.run_epoch", "IterBasedTrainLoop.run", "ValLoop.run", "TestLoop.run"]
    src = batches(3)
    loop = loops.EpochBasedTrainLoop(src)
    assert all(same(a, b) for a, b in zip(loop.run_epoch(), src, strict=True)) and len(loop.seen) == 3
    assert loop.dataloader is src  # restored after the epoch
    pulled = Counting(batches(8))
    it_loop = loops.IterBasedTrainLoop(pulled, max_iters=5, start=2)
    assert all(same(a, b) for a, b in zip(it_loop.run(), pulled.items[2:5], strict=True))
    assert pulled.pulled == 5 and it_loop.dataloader_iterator is pulled
    patcher.undo()
    assert loops.ValLoop.__dict__.get("run") is before["ValLoop"]
    assert loops.EpochBasedTrainLoop.__dict__.get("run_epoch") is before["EpochBasedTrainLoop"]


def test_install_leaves_a_loop_alone_without_a_layer() -> None:
    from loongkit_data.prefetch_mmengine import install

    loops = fake_loops()
    install(Patcher(), loops, lambda loop: None)
    src = batches(3)
    seen = loops.ValLoop(src).run()
    assert all(a is b for a, b in zip(seen, src, strict=True))


def test_broken_target_is_not_applicable() -> None:
    from loongkit_data.prefetch_mmengine import install

    loops = fake_loops()
    del loops.IterBasedTrainLoop
    patcher = Patcher()
    with pytest.raises(NotApplicable, match="IterBasedTrainLoop"):
        install(patcher, loops, lambda loop: None)
    assert len(patcher) == 0


def _env(role: str = "main", environ: dict[str, str] | None = None, gpus: int = 1) -> Any:
    return SimpleNamespace(process=SimpleNamespace(role=role), environ=environ or {},
                           hardware=SimpleNamespace(root="/fake/", accelerators=(object(),) * gpus))


def test_no_cuda_reason() -> None:
    assert prefetch.no_cuda_reason(_env()) is None
    assert prefetch.no_cuda_reason(_env(gpus=0)) == "no CUDA device (no GPU under /fake/sys/bus/pci/devices)"
    assert "CUDA_VISIBLE_DEVICES=''" in prefetch.no_cuda_reason(_env(environ={"CUDA_VISIBLE_DEVICES": ""}))
    assert "-1" in prefetch.no_cuda_reason(_env(environ={"CUDA_VISIBLE_DEVICES": "-1"}))
    assert prefetch.no_cuda_reason(_env(environ={"CUDA_VISIBLE_DEVICES": "1"})) is None
    assert "worker process" in prefetch.no_cuda_reason(_env(role="worker"))


def test_cuda_layers_skip_a_cpu_model_with_a_reason() -> None:
    from loongkit_data.prefetch_mmengine import CudaLayers

    reasons: list[str] = []
    pick = CudaLayers(reasons.append)
    loop = SimpleNamespace(runner=SimpleNamespace(model=SimpleNamespace(
        module=SimpleNamespace(data_preprocessor=SimpleNamespace(device=torch.device("cpu"))))))
    assert pick(loop) is None
    assert reasons == ["the model's data_preprocessor is on cpu, not a CUDA device"]
    assert pick(SimpleNamespace(runner=SimpleNamespace(model=object()))) is None
    assert "no data_preprocessor" in reasons[-1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_cuda_layer_copies_on_a_side_stream() -> None:
    from loongkit_data.prefetch import CudaLayer

    dev = torch.device("cuda", torch.cuda.current_device())
    layer = CudaLayer(torch, dev)
    src = [{"inputs": [torch.randn(256, 256).pin_memory()], "label": torch.arange(5).pin_memory(),
            "meta": DataContainer([{"f": 1}], cpu_only=True)} for _ in range(4)]
    out = []
    for batch in Prefetcher(iter(src), layer):
        assert batch["inputs"][0].device == dev and batch["label"].device == dev
        assert batch["inputs"][0].to(dev) is batch["inputs"][0]  # what cast_data does is then a no-op
        out.append((batch["inputs"][0] * 2).sum().item())  # compute on the default stream
        assert batch["meta"] is not None and batch["meta"].cpu_only
    torch.cuda.synchronize()
    assert out == pytest.approx([(b["inputs"][0] * 2).sum().item() for b in src], rel=1e-5)
    assert layer.stream != torch.cuda.current_stream(dev)


@pytest.mark.skipif(requirements.installed("mmcv") is not None,
                    reason="mmcv is installed: the gates are checked by tests/integration/data_prefetch")
def test_version_gates_without_mmcv(run_loongkit: Any) -> None:
    res = run_loongkit("import torch", env={"LOONGKIT_DATA_CONTAINER": "1", "LOONGKIT_DATA_PREFETCH": "1",
                                            "LOONGKIT_MMENGINE_DATA_PREFETCH": "1"})
    assert res.returncode == 0, res.stderr
    for name in ("data_container", "data_prefetch", "mmengine_data_prefetch"):
        row = res.feature(name)
        assert row["state"] == "not applicable" and "mmcv" in row["reason"], row
