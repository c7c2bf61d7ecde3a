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
