"""SerializedList behaves like the list it replaces, for readers; mutation turns it back into one."""

from __future__ import annotations

import copy
import os
import pickle
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loongkit_data import serialize
from loongkit_data.serialize import SerializedList

records_strategy = st.lists(
    st.one_of(
        st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=8),
                                                       st.lists(st.integers(), max_size=4)), max_size=5),
        st.tuples(st.integers(), st.text(max_size=6)),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(records=records_strategy, index=st.integers(-80, 80), start=st.integers(-80, 80) | st.none(),
       stop=st.integers(-80, 80) | st.none(), step=st.sampled_from([None, 1, 2, -1, -3]))
def test_reads_match_the_list(records: list, index: int, start: int | None, stop: int | None, step: int | None) -> None:
    proxy = SerializedList(copy.deepcopy(records))
    assert len(proxy) == len(records)
    assert proxy == records and records == proxy and not (proxy != records)  # noqa: SIM202 (tests __ne__)
    assert list(proxy) == records
    assert list(reversed(proxy)) == list(reversed(records))
    assert proxy[start:stop:step] == records[start:stop:step]
    if -len(records) <= index < len(records):
        assert proxy[index] == records[index]
    else:
        with pytest.raises(IndexError):
            proxy[index]
    again = pickle.loads(pickle.dumps(proxy))
    assert again == records and isinstance(again, SerializedList)
    assert copy.deepcopy(proxy) == records
    if records:
        assert records[-1] in proxy
        assert proxy.index(records[-1]) == records.index(records[-1])
        assert proxy.count(records[0]) == records.count(records[0])


def test_fresh_random_records_and_list_semantics() -> None:
    rng = random.Random(os.urandom(8))
    records = [{"filename": f"{rng.random():.6f}.jpg", "width": rng.randrange(1, 4000),
                "ann": {"bboxes": [[rng.random() for _ in range(4)] for _ in range(rng.randrange(4))],
                        "labels": (rng.randrange(80),)}} for _ in range(5000)]
    proxy = SerializedList(records)
    assert proxy == records and proxy != records[:-1] and proxy != tuple(records)
    assert proxy + [1] == [*records, 1] and [1] + proxy == [1, *records]  # noqa: RUF005 (tests __add__)
    assert proxy.copy() == records and isinstance(proxy.copy(), list)
    with pytest.raises(TypeError):
        hash(proxy)
    assert proxy.nbytes < 5000 * 200


def test_records_edited_in_the_owner_process_persist() -> None:
    proxy = SerializedList([{"a": i} for i in range(10)])
    proxy[3]["a"] = 99
    assert proxy[3] == {"a": 99} and proxy[3] is proxy[3]
    assert pickle.loads(pickle.dumps(proxy))[3] == {"a": 99}  # the kept record travels along


def test_owner_reading_most_records_gets_the_list_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serialize, "MATERIALISE_MIN", 4)
    proxy = SerializedList([{"a": i} for i in range(16)])
    first = proxy[0]
    for i in range(3):
        proxy[i]
    assert not proxy.materialised  # 3 of 16 handed out: still a buffer
    proxy[3]
    assert proxy.materialised and proxy[0] is first and proxy == [{"a": i} for i in range(16)]


class Owner:
    pass


@pytest.mark.parametrize(("operation", "args"), [
    ("append", ({"x": 1},)), ("extend", ([{"x": 1}],)), ("insert", (0, {"x": 1})), ("pop", ()),
    ("remove", ({"a": 2},)), ("clear", ()), ("sort", ()), ("reverse", ()),
    ("__setitem__", (1, {"x": 1})), ("__delitem__", (0,)), ("__iadd__", ([{"x": 1}],)), ("__imul__", (2,)),
])
def test_mutation_materialises_and_reports(operation: str, args: tuple) -> None:
    records = [{"a": i} for i in range(5)]
    expected = copy.deepcopy(records)
    seen: list[str] = []
    owner = Owner()
    proxy = SerializedList(records, owner=owner, attr="infos", on_mutate=lambda p, op: seen.append(op))
    owner.infos = proxy
    if operation == "sort":
        args = ()
        kwargs = {"key": lambda r: -r["a"]}
        expected.sort(**kwargs)
        getattr(proxy, operation)(**kwargs)
    else:
        result = getattr(proxy, operation)(*args)
        expected_result = getattr(expected, operation)(*args)
        if operation not in ("__iadd__", "__imul__"):
            assert result == expected_result
    assert seen == [operation]
    assert proxy.materialised and proxy == expected
    assert type(owner.infos) is list and owner.infos == expected
    proxy.append({"again": 1})  # later mutations do not report again
    assert seen == [operation]


def test_augmented_assignment_rebinds_to_a_list() -> None:
    owner = Owner()
    owner.infos = SerializedList([(1, "a")] * 3, owner=owner, attr="infos")
    owner.infos += [(2, "b")]
    assert type(owner.infos) is list and owner.infos == [(1, "a")] * 3 + [(2, "b")]
