"""A plain record class: equality and repr from its fields, without building a dataclass.

The core's small typed objects (a feature's run-time record, a fault, the process's role...) are
created in every booting process, where ``@dataclass`` is a cost per class (it generates and ``exec``s
code; docs/benchmarks.md, start-up); a subclass of :class:`Record` only names its ``__slots__`` and writes ``__init__``.

``_fields`` (default: the parent record's, then ``__slots__`` in order) is what equality compares;
``_repr_fields`` (default: ``_fields``) what repr shows. Records are mutable, hence unhashable unless a
subclass says otherwise.
"""

from __future__ import annotations


class Record:
    __slots__ = ()
    _fields: tuple[str, ...] = ()
    _repr_fields: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        slots = own.get("__slots__", ())
        if "_fields" not in own:  # a subclass's record extends its parent's
            inherited = next((b._fields for b in cls.__mro__[1:] if issubclass(b, Record)), ())
            cls._fields = inherited + ((slots,) if isinstance(slots, str) else tuple(slots))
        if "_repr_fields" not in own:
            cls._repr_fields = cls._fields

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self._fields)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._repr_fields)
        return f"{type(self).__name__}({shown})"
