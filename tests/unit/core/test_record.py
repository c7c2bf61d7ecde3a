"""loongkit_core.record.Record: equality and repr from the fields, what the core's records rely on."""

from __future__ import annotations

import pickle

import pytest

from loongkit_core.activity import Totals
from loongkit_core.feature import FeatureRecord, PolicyDecision
from loongkit_core.manager import Fault
from loongkit_core.process import ProcessInfo
from loongkit_core.record import Record


class Point(Record):
    __slots__ = ("y", "x")  # noqa: RUF023  # the repr's order

    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y


class Point3(Point):
    __slots__ = ("z",)

    def __init__(self, x: int, y: int, z: int) -> None:
        super().__init__(x, y)
        self.z = z


def test_fields_follow_slots_and_compare_by_value() -> None:
    assert Point._fields == ("y", "x") and repr(Point(1, 2)) == "Point(y=2, x=1)"
    assert Point(1, 2) == Point(1, 2) and Point(1, 2) != Point(2, 1)
    assert Point(1, 2) != (1, 2) and Point(1, 2).__eq__((1, 2)) is NotImplemented
    with pytest.raises(TypeError):
        hash(Point(1, 2))  # mutable: unhashable
    with pytest.raises(AttributeError):
        Point(1, 2).w = 3  # type: ignore[attr-defined]  # slotted: no stray attributes


def test_a_subclass_is_a_different_record() -> None:
    assert Point3._fields == ("y", "x", "z") and repr(Point3(1, 2, 3)) == "Point3(y=2, x=1, z=3)"
    assert Point3(1, 2, 3) == Point3(1, 2, 3) != Point3(9, 2, 3)  # the parent's fields count too
    assert Point3(1, 2, 3) != Point(1, 2)


def test_chosen_fields_and_repr_fields() -> None:
    a = Fault("p", "load", "boom", traceback="tb1", feature="f")
    assert a == Fault("p", "load", "boom", traceback="tb1", feature="f")
    assert a != Fault("p", "load", "boom", traceback="tb2", feature="f")  # equality sees the traceback
    assert repr(a) == "Fault(plugin='p', where='load', error='boom', feature='f')"  # repr leaves it out


def test_core_records_pickle_and_compare() -> None:
    info = ProcessInfo("main", 7, "host", 0, 0, 2, 2)
    assert pickle.loads(pickle.dumps(info)) == info and info.to_json()["local_world_size"] == 2
    assert repr(info).startswith("ProcessInfo(role='main', pid=7, host='host'")
    assert pickle.loads(pickle.dumps(Totals(3, 4, 2))) == Totals(3, 4, 2) != Totals(3, 4, 1)
    decision = PolicyDecision("amd", True, {"chunk": 8})
    assert repr(decision) == "PolicyDecision(reason='amd', enabled_by_default=True, option_defaults={'chunk': 8})"
    assert FeatureRecord.__eq__(FeatureRecord.__new__(FeatureRecord), decision) is NotImplemented
