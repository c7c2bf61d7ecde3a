"""LOONGKIT_DATALOADER_WORKERS: the worker count tune turns, set on every DataLoader with no code change."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from loongkit_monitor.tune.registration import WORKERS_FEATURE, register
from loongkit_monitor.tune.workers import DataLoaderWorkers, WorkersOptions
from torch.utils.data import DataLoader

from loongkit_core import process, settings
from loongkit_core.context import ActivationContext, Environment, NotApplicable
from loongkit_core.kit import PluginSpec
from loongkit_core.testing.conformance import plugin_problems


def environment(environ: dict[str, str]) -> Environment:
    core, _ = settings.load_settings(settings.CoreSettings, environ={})
    return Environment(core, process.detect(), environ=environ)


def configured(environ: dict[str, str]) -> tuple[DataLoaderWorkers, object, list[str]]:
    impl = DataLoaderWorkers(WORKERS_FEATURE)
    config, warnings = impl.configure(environment(environ), None)
    return impl, config, warnings


def test_detect_needs_a_count() -> None:
    impl = DataLoaderWorkers(WORKERS_FEATURE)
    assert impl.detect(environment({})) == "LOONGKIT_DATALOADER_WORKERS_COUNT is not set (the worker count to use)"
    assert impl.detect(environment({"LOONGKIT_DATALOADER_WORKERS_COUNT": "3"})) is None


def test_bad_count_falls_back_with_a_warning_and_does_not_apply() -> None:
    impl, config, warnings = configured({"LOONGKIT_DATALOADER_WORKERS_COUNT": "lots"})
    assert isinstance(config, WorkersOptions) and config.count is None
    assert any("LOONGKIT_DATALOADER_WORKERS_COUNT='lots' is invalid" in w for w in warnings)
    ctx = ActivationContext.standalone(WORKERS_FEATURE, config=config)
    with pytest.raises(NotApplicable, match="invalid"):
        impl.activate(ctx, "torch.utils.data")
    _, config, warnings = configured({"LOONGKIT_DATALOADER_WORKERS_COUNT": "-1"})
    assert config.count is None and warnings  # type: ignore[attr-defined]


class Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(float(i * i))


def _seed(worker_id: int) -> None:
    pass


def test_every_dataloader_gets_the_count_and_undo_restores() -> None:
    original = DataLoader.__init__
    impl, config, _ = configured({"LOONGKIT_DATALOADER_WORKERS_COUNT": "0"})
    ctx = ActivationContext.standalone(WORKERS_FEATURE, config=config)
    impl.activate(ctx, "torch.utils.data")
    try:
        # Options that only exist with workers are dropped rather than breaking the loader.
        loader = DataLoader(Squares(), batch_size=4, num_workers=2, persistent_workers=True, prefetch_factor=4,
                            worker_init_fn=_seed)
        assert loader.num_workers == 0 and loader.persistent_workers is False
        assert [b.tolist() for b in loader] == [[0.0, 1.0, 4.0, 9.0], [16.0, 25.0, 36.0, 49.0]]
        positional = DataLoader(Squares(), 4, False, None, None, 3)  # num_workers passed by position
        assert positional.num_workers == 0
        assert ctx.calls == 2
        assert ctx.record.details["changes"] == [
            "num_workers 2 -> 0 (persistent_workers dropped, prefetch_factor dropped, worker_init_fn not run "
            "(no workers))", "num_workers 3 -> 0"]
        assert ctx.config == {"count": 0}
    finally:
        impl.deactivate(ctx)
    assert DataLoader.__init__ is original
    assert DataLoader(Squares(), num_workers=2).num_workers == 2


def test_more_workers_than_the_job_asked() -> None:
    impl, config, _ = configured({"LOONGKIT_DATALOADER_WORKERS_COUNT": "2"})
    ctx = ActivationContext.standalone(WORKERS_FEATURE, config=config)
    impl.activate(ctx, "torch.utils.data")
    try:
        loader = DataLoader(Squares(), batch_size=4)
        assert loader.num_workers == 2
        assert sorted(x for b in loader for x in b.tolist()) == [float(i * i) for i in range(8)]
    finally:
        impl.deactivate(ctx)


def test_registration_conforms() -> None:
    spec = PluginSpec("tunecheck")
    register(spec, version="9.9")
    holder = types.ModuleType("tune_registration_probe")
    holder.spec = spec  # type: ignore[attr-defined]
    sys.modules[holder.__name__] = holder
    try:
        assert plugin_problems(spec, imports=False) == []
    finally:
        del sys.modules[holder.__name__]
    assert spec.feature("dataloader_workers").plugin_version == "9.9"
    assert len(spec._cli) == 1


def test_declaring_and_the_impl_module_import_no_torch() -> None:
    import subprocess

    code = ("import sys, loongkit_monitor.tune.registration, loongkit_monitor.tune.workers\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
