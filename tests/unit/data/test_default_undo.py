"""loongkit-data features undo through the default FeatureImpl.deactivate (ctx.patcher.undo(); that none
overrides it is the conformance check's, run on every plugin): apply -> undo -> exactly the prior state
-> apply again works.

imnormalize and distortion run here on stand-ins for their mmcv/mmdet targets (the real packages:
tests/integration/data_kernels); no kernel is built, only the patch layer is exercised."""

from __future__ import annotations

import resource
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from loongkit_data import allocator, distortion, imnormalize, pytorch_memory
from loongkit_data.plugin import plugin

from loongkit_core import workers
from loongkit_core.context import ActivationContext
from loongkit_core.feature import State


# -- imnormalize ---------------------------------------------------------------------------------------
def test_imnormalize_undo_covers_bindings_made_after_activation(monkeypatch: pytest.MonkeyPatch) -> None:
    # Local functions: rebind scans every module, and a module-level original here would be patched too.
    def _imnormalize(img: Any, mean: Any, std: Any, to_rgb: bool = True) -> Any:
        return "upstream"

    def _imnormalize_(img: Any, mean: Any, std: Any, to_rgb: bool = True) -> Any:
        return "upstream in place"

    photometric = types.ModuleType("lk_fake_photometric")
    image = types.ModuleType("lk_fake_image")  # binds the originals before activation (mmcv.image later on)
    for module in (photometric, image):
        module.imnormalize, module.imnormalize_ = _imnormalize, _imnormalize_  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module.__name__, module)
    late = types.ModuleType("lk_fake_mmcv")  # a package __init__ still running: copies the wrappers
    monkeypatch.setitem(sys.modules, late.__name__, late)
    feature = plugin.feature("imnormalize")
    impl = imnormalize.ImNormalize(feature)
    ctx = ActivationContext.standalone(feature)
    for bound in (4, 6):  # the second time `late` binds the originals too
        impl.activate(ctx, photometric.__name__)
        wrapper = photometric.imnormalize
        assert wrapper is not _imnormalize and wrapper.__wrapped__ is _imnormalize  # not a wrapper of a wrapper
        assert image.imnormalize is wrapper and image.imnormalize_ is photometric.imnormalize_
        late.imnormalize, late.imnormalize_ = photometric.imnormalize, photometric.imnormalize_  # type: ignore[attr-defined]
        assert ctx.record.details["bindings_patched"] == bound
        impl.deactivate(ctx)
        for module in (photometric, image, late):
            assert (module.imnormalize, module.imnormalize_) == (_imnormalize, _imnormalize_), module  # type: ignore[attr-defined]
        assert len(ctx.patcher) == 0


# -- distortion ----------------------------------------------------------------------------------------
def test_distortion_v3_undo_and_reapply(monkeypatch: pytest.MonkeyPatch) -> None:
    class PhotoMetricDistortion:
        def _random_flags(self) -> tuple[Any, ...]:
            return ()

        def transform(self, results: dict) -> dict:
            return results

    original = PhotoMetricDistortion.__dict__["transform"]
    module = types.ModuleType(distortion.V3)
    module.PhotoMetricDistortion = PhotoMetricDistortion  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, distortion.V3, module)
    feature = plugin.feature("distortion")
    impl = distortion.Distortion(feature)
    ctx = ActivationContext.standalone(feature)
    for _ in range(2):
        impl.activate(ctx, distortion.V3)
        patched = PhotoMetricDistortion.__dict__["transform"]
        assert patched is not original and patched.__wrapped__ is original
        assert isinstance(ctx.config, dict) and ctx.config["fallbacks"] is impl.fallbacks
        impl.deactivate(ctx)
        assert PhotoMetricDistortion.__dict__["transform"] is original and len(ctx.patcher) == 0


# -- pytorch: the iterator patch, the worker callback, RLIMIT_NOFILE ---------------------------------------
@pytest.fixture
def low_nofile() -> Iterator[tuple[int, int]]:
    """A soft RLIMIT_NOFILE below the hard one, so that the feature raises it; put back afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"hard RLIMIT_NOFILE {hard}: no room to lower the soft limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        yield 256, hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        workers.uninstall()


def test_pytorch_apply_undo_apply(loongkit_runtime: Any, low_nofile: tuple[int, int],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.data import dataloader

    cls = dataloader._MultiProcessingDataLoaderIter
    original_init = cls.__dict__["__init__"]
    tuned: list[int] = []
    monkeypatch.setattr(allocator, "apply_glibc",  # the pytest process must not be tuned
                        lambda values=None: (tuned.append(1), allocator.TuningResult({}, {}, "test"))[1])
    rt = loongkit_runtime({"LOONGKIT_PYTORCH": "1"}, activate={"pytorch": "torch.utils.data"})
    record = rt.records["pytorch"]
    for _ in range(2):
        assert record.state == State.APPLIED, record.reason
        assert cls.__dict__["__init__"] is not original_init
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > low_nofile[0]
        workers.run_callbacks(0)  # what a DataLoader worker runs first
        assert tuned == [1] and pytorch_memory.worker_state["worker_id"] == 0
        rt.deactivate("pytorch")
        assert cls.__dict__["__init__"] is original_init
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == low_nofile
        workers.run_callbacks(0)  # the callback stays registered, switched off
        assert tuned == [1]
        tuned.clear()
        rt.activate(record, "torch.utils.data")
    assert len(rt.contexts["pytorch"].patcher) == 3  # switch, RLIMIT_NOFILE, __init__: nothing stacked
