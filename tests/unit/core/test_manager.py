"""loongkit_core.manager: plugins registered one by one and called plugin by plugin, so that one broken
plugin only ever touches its own features; every fault a :class:`~loongkit_core.manager.Fault` record."""

from __future__ import annotations

import sys
from typing import Any

from loongkit_core import manager, runtime
from loongkit_core.hookspecs import hookimpl


class Lines:
    """A plugin with a Summary section."""

    def __init__(self, *lines: str) -> None:
        self.lines = lines

    @hookimpl
    def loongkit_summary(self, records: Any) -> list[str]:
        return list(self.lines)


class Broken:
    @hookimpl
    def loongkit_summary(self, records: Any) -> list[str]:
        raise ValueError("no section today")


def test_the_strict_error_is_the_runtimes() -> None:
    assert runtime.LoongkitStrictError is manager.LoongkitStrictError
    assert issubclass(manager.LoongkitStrictError, RuntimeError)


def test_nothing_registered_calls_nothing_and_imports_no_pluggy() -> None:
    m = manager.PluginManager()
    assert m.call_each("loongkit_summary", records=[]) == [] and m.call_owner("x", "loongkit_summary") is None
    assert m._pm is None


def test_call_each_isolates_a_raising_plugin() -> None:
    seen: list[manager.Fault] = []
    m = manager.PluginManager(on_fault=seen.append)
    assert m.register("first", Lines("first line")) and m.register("broken", Broken())
    assert m.register("last", Lines("last line"))
    # pluggy's order (the last registered first); the broken one in between costs only its own result
    assert m.call_each("loongkit_summary", records=[]) == [("last", ["last line"]), ("first", ["first line"])]
    assert [(f.plugin, f.where, f.error) for f in m.faults] == [
        ("broken", "loongkit_summary", "ValueError: no section today")]
    assert seen == m.faults and "Traceback" in m.faults[0].traceback


def test_call_owner_calls_one_plugin_and_lets_its_error_through() -> None:
    m = manager.PluginManager()
    m.register("first", Lines("first line"))
    m.register("broken", Broken())
    assert m.call_owner("first", "loongkit_summary", records=[]) == ["first line"]
    try:
        m.call_owner("broken", "loongkit_summary", records=[])
    except ValueError as exc:
        assert str(exc) == "no section today"
    else:
        raise AssertionError("call_owner swallowed the owner's error")
    assert m.faults == []  # the caller records it


def test_a_plugin_built_for_another_core_is_refused() -> None:
    plugin = Lines("x")
    plugin.LOONGKIT_CORE_API = (7, 9)  # type: ignore[attr-defined]
    m = manager.PluginManager()
    assert not m.register("future", plugin) and "future" not in m.plugins
    assert m.faults[0].where == "load" and "built for loongkit core API (7, 9)" in m.faults[0].error


def test_ensure_loads_a_restored_entry_point_once_and_never_retries_a_failed_one(monkeypatch: Any) -> None:
    module = type(sys)("planted_manager_plugin")
    module.plugin = Lines("restored")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "planted_manager_plugin", module)
    m = manager.PluginManager()
    m.restore({"good": ("planted_manager_plugin:plugin", "planted-dist", "1.0"),
               "bad": ("planted_manager_plugin_missing:plugin", "bad-dist", "0.1"),
               "off": ("planted_manager_plugin:plugin", "off-dist", "1.0")}, {"off": "off-dist"}, [], ["bad", "good"])
    assert m.plugins == {}  # nothing imported until asked
    assert m.ensure("good") and m.ensure("good")
    assert m.plugins["good"].version == "1.0" and m.call_owner("good", "loongkit_summary", records=[]) == ["restored"]
    assert not m.ensure("off") and not m.ensure("unknown")
    assert not m.ensure("bad") and not m.ensure("bad")
    assert [(f.plugin, f.where) for f in m.faults] == [("bad", "load")]
