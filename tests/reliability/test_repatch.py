"""Apply, remove, apply again: the original objects come back exactly, nothing leaks."""

from __future__ import annotations

import json
import types

from loongkit_core import importhooks
from loongkit_core.feature import Category, Feature, State
from loongkit_core.kit import FeatureImpl, PluginSpec
from loongkit_core.runtime import Runtime


class WrapDumps(FeatureImpl):
    def activate(self, ctx, target):  # type: ignore[no-untyped-def]
        ctx.patcher.patch(json, "dumps", ctx.counted(json.dumps))
        ctx.patcher.patch(json.JSONEncoder, "item_separator", ";", require=True)


def _runtime() -> Runtime:
    plugin = PluginSpec("repatch")
    module = types.ModuleType("repatch_impl")
    module.WrapDumps = WrapDumps  # type: ignore[attr-defined]
    import sys

    sys.modules["repatch_impl"] = module
    plugin.add(Feature(name="wrap_dumps", env="LOONGKIT_WRAP_DUMPS", level=1, category=Category.OTHER,
                       description="", targets=("json",)), impl="repatch_impl:WrapDumps")
    rt = Runtime({"LOONGKIT_WRAP_DUMPS": "1"})
    rt.manager.load_entry_points = lambda disabled=None: None  # type: ignore[method-assign]
    rt.manager.register("repatch", plugin)
    return rt


def test_apply_remove_apply_restores_originals() -> None:
    original_dumps = json.dumps
    original_sep = json.JSONEncoder.__dict__["item_separator"]
    rt = _runtime()
    try:
        rt.boot(configure_logging=False)
        record = rt.records["wrap_dumps"]
        assert record.state == State.APPLIED and json.dumps is not original_dumps
        json.dumps([1])
        assert record.calls == 1
        for _ in range(3):
            rt.deactivate("wrap_dumps")
            assert json.dumps is original_dumps
            assert json.JSONEncoder.__dict__["item_separator"] is original_sep
            rt.activate(record, "json")
            assert json.dumps is not original_dumps and json.JSONEncoder.item_separator == ";"
        assert len(rt.contexts["wrap_dumps"].patcher) == 2  # no patch stacked on a patch
    finally:
        rt.deactivate("wrap_dumps")
        importhooks.reset()
    assert json.dumps is original_dumps
    assert json.JSONEncoder.__dict__["item_separator"] is original_sep
