"""Patch and unpatch are symmetric: undo restores the exact original objects."""

from __future__ import annotations

import types

import pytest

from loongkit_core.patcher import Patcher


class Base:
    def inherited(self) -> str:
        return "base"


class Child(Base):
    def own(self) -> str:
        return "own"

    @staticmethod
    def static() -> str:
        return "static"


def test_undo_restores_identity() -> None:
    module = types.ModuleType("m")
    module.f = lambda: 1  # type: ignore[attr-defined]
    original = module.f  # type: ignore[attr-defined]
    p = Patcher()
    assert p.patch(module, "f", lambda: 2) is original
    assert module.f() == 2  # type: ignore[attr-defined]
    p.undo()
    assert module.f is original  # type: ignore[attr-defined]


def test_inherited_attribute_is_deleted_again() -> None:
    p = Patcher()
    p.patch(Child, "inherited", lambda self: "patched")
    assert Child().inherited() == "patched"
    p.undo()
    assert "inherited" not in Child.__dict__
    assert Child().inherited() == "base"


def test_staticmethod_descriptor_is_restored() -> None:
    descriptor = Child.__dict__["static"]
    p = Patcher()
    p.patch(Child, "static", staticmethod(lambda: "x"))
    p.undo()
    assert Child.__dict__["static"] is descriptor


def test_repatch_after_undo_is_clean() -> None:
    original = Child.__dict__["own"]
    p = Patcher()
    for _ in range(3):
        p.patch(Child, "own", lambda self: "1")
        p.patch(Child, "own", lambda self: "2")
        p.undo()
        assert Child.__dict__["own"] is original
    assert len(p) == 0


def test_missing_attribute() -> None:
    p = Patcher()
    with pytest.raises(AttributeError):
        p.patch(Child, "nothing", 1)
    p.patch(Child, "nothing", 1, require=False)
    p.undo()
    assert not hasattr(Child, "nothing")


def test_assign_restores_through_the_setter() -> None:
    class Flags:
        def __init__(self) -> None:
            self._v = "ieee"

        @property
        def mode(self) -> str:
            return self._v

        @mode.setter
        def mode(self, value: str) -> None:
            self._v = value

    flags = Flags()
    p = Patcher()
    assert p.assign(flags, "mode", "tf32") == "ieee"
    assert flags.mode == "tf32"
    p.undo()
    assert flags.mode == "ieee" and "mode" not in flags.__dict__


def test_set_item_and_defer_undo_newest_first() -> None:
    env = {"KEEP": "1"}
    order: list[str] = []
    p = Patcher()
    p.set_item(env, "NEW", "x")
    p.set_item(env, "KEEP", "2")
    p.defer(lambda: order.append("first registered"))
    p.defer(lambda: order.append("second registered"))
    p.undo()
    assert env == {"KEEP": "1"}
    assert order == ["second registered", "first registered"]


def test_undo_finishes_every_change_when_one_raises() -> None:
    class Owner:
        pass

    p = Patcher()
    p.patch(Owner, "a", 1, require=False)

    def boom() -> None:
        raise RuntimeError("boom")

    p.defer(boom)
    with pytest.raises(RuntimeError):
        p.undo()
    assert not hasattr(Owner, "a") and len(p) == 0
