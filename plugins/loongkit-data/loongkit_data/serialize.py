"""A read-only sequence of records pickled into one numpy buffer plus offsets.

Why: a forked DataLoader worker that reads a Python list of dicts touches every record's
reference count, so the kernel copies the page it lives on: over an epoch each worker ends up
with a private copy of the whole list (copy-on-read). One numpy byte buffer has a single header;
reading it never writes to the shared pages.

Semantics kept for readers: ``len``, indexing (negative too), slicing (a list), iteration,
``==`` against any sequence, ``in``, ``index``/``count``, pickling and deep copies. In the process
that built it, a record handed out is kept and handed out again, so in-place edits of a record
there persist as they would in a list. Any list mutation (``append``, ``x[i] = ...``, ``sort``...)
turns the proxy back into a real list (logged once, and the owner's attribute gets the list back);
the caller marks such attributes so they are never serialized again.
"""

from __future__ import annotations

import os
import pickle
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

# In the owner process, once this share of the records has been handed out the proxy turns back
# into a list: the owner reads (or edits) most of it itself, so a buffer saves nothing.
MATERIALISE_SHARE = 0.25
MATERIALISE_MIN = 1024


def serialize(records: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 buffer, int64 end offsets) of each record pickled with the highest protocol."""
    pickles = [pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL) for r in records]
    ends = np.cumsum(np.fromiter((len(p) for p in pickles), dtype=np.int64, count=len(pickles)))
    buffer = np.frombuffer(b"".join(pickles), dtype=np.uint8) if pickles else np.zeros(0, np.uint8)
    return buffer, ends


class SerializedList(Sequence):
    """See the module docstring. ``on_mutate(proxy, operation)`` is called before materialising."""

    __slots__ = ("__weakref__", "_attr", "_buffer", "_cache", "_ends", "_list", "_on_mutate", "_owner_pid",
                 "_owner_ref")

    def __init__(self, records: Sequence[Any] | None = None, *, buffer: np.ndarray | None = None,
                 ends: np.ndarray | None = None, owner: object | None = None, attr: str = "",
                 on_mutate: Callable[[SerializedList, str], None] | None = None) -> None:
        if buffer is None or ends is None:
            buffer, ends = serialize(records if records is not None else [])
        self._buffer = buffer
        self._ends = ends
        self._list: list[Any] | None = None  # set once materialised: every operation goes there
        self._cache: dict[int, Any] = {}
        self._owner_pid = os.getpid()
        self._owner_ref = weakref.ref(owner) if owner is not None else None
        self._attr = attr
        self._on_mutate = on_mutate

    # -- reading -------------------------------------------------------------------------------
    @property
    def materialised(self) -> bool:
        return self._list is not None

    @property
    def nbytes(self) -> int:
        return int(self._buffer.nbytes + self._ends.nbytes)

    def __len__(self) -> int:
        return len(self._list) if self._list is not None else len(self._ends)

    def _load(self, i: int) -> Any:
        start = int(self._ends[i - 1]) if i > 0 else 0
        return pickle.loads(memoryview(self._buffer)[start:int(self._ends[i])])

    def _get(self, i: int) -> Any:
        found = self._cache.get(i, _MISSING)
        if found is not _MISSING:
            return found
        record = self._load(i)
        if os.getpid() == self._owner_pid:
            # The owner keeps what it handed out, so edits to a record persist as in a list.
            self._cache[i] = record
            if len(self._cache) >= max(MATERIALISE_MIN, int(len(self._ends) * MATERIALISE_SHARE)):
                self._materialise(None)
        return record

    def __getitem__(self, index: Any) -> Any:
        if self._list is not None:
            return self._list[index]
        if isinstance(index, slice):
            return [self._get(i) for i in range(*index.indices(len(self._ends)))]
        i = index.__index__()
        n = len(self._ends)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("list index out of range")
        return self._get(i)

    def __iter__(self) -> Iterator[Any]:
        if self._list is not None:
            return iter(self._list)
        return (self[i] for i in range(len(self._ends)))

    def __reversed__(self) -> Iterator[Any]:
        if self._list is not None:
            return reversed(self._list)
        return (self[i] for i in range(len(self._ends) - 1, -1, -1))

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if not isinstance(other, (list, tuple, SerializedList)):
            return NotImplemented
        if isinstance(other, tuple):
            return False  # a list never equals a tuple
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    def __ne__(self, other: object) -> bool:
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    __hash__ = None  # type: ignore[assignment]  # unhashable, like a list

    def __add__(self, other: Iterable[Any]) -> list[Any]:
        if not isinstance(other, (list, SerializedList)):
            return NotImplemented
        return list(self) + list(other)

    def __radd__(self, other: Iterable[Any]) -> list[Any]:
        if not isinstance(other, list):
            return NotImplemented
        return other + list(self)

    def __mul__(self, n: int) -> list[Any]:
        return list(self) * n

    def copy(self) -> list[Any]:
        return list(self)

    def __repr__(self) -> str:
        if self._list is not None:
            return repr(self._list)
        return f"SerializedList(len={len(self._ends)}, bytes={self.nbytes})"

    # -- pickling and copies: the compact form, records unchanged --------------------------------
    def __reduce__(self) -> tuple[Any, ...]:
        if self._list is not None:
            return list, (self._list,)
        return _rebuild, (self._buffer.tobytes(), self._ends, dict(self._cache))

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        import copy

        return copy.deepcopy(list(self), memo)

    def __copy__(self) -> list[Any]:
        return list(self)

    # -- mutation: back to a real list -----------------------------------------------------------
    def _materialise(self, operation: str | None) -> list[Any]:
        if self._list is None:
            if operation is not None and self._on_mutate is not None:
                try:
                    self._on_mutate(self, operation)
                except Exception:
                    pass
            records = [self._cache[i] if i in self._cache else self._load(i) for i in range(len(self._ends))]
            self._list = records
            self._cache = {}
            self._buffer = np.zeros(0, np.uint8)
            self._ends = np.zeros(0, np.int64)
            owner = self._owner_ref() if self._owner_ref is not None else None
            if owner is not None and self._attr and getattr(owner, self._attr, None) is self:
                try:
                    setattr(owner, self._attr, records)
                except Exception:
                    pass
        return self._list


_MISSING = object()


def _rebuild(data: bytes, ends: np.ndarray, cache: dict[int, Any]) -> SerializedList:
    proxy = SerializedList(buffer=np.frombuffer(data, dtype=np.uint8), ends=ends)
    proxy._cache.update(cache)
    return proxy


def _mutator(name: str) -> Callable[..., Any]:
    def method(self: SerializedList, *args: Any, **kwargs: Any) -> Any:
        target = self._materialise(name)
        return getattr(target, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"Materialise to a list, then list.{name}."
    return method


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop",
              "remove", "clear", "sort", "reverse"):
    setattr(SerializedList, _name, _mutator(_name))
