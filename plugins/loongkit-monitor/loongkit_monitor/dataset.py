"""What the training loader's dataset is, looked at in this process (once per loader, at its first
batch): its type, whether it keeps per-sample Python records (what copy-on-write makes fork workers'
private memory grow), and the transforms of an OpenMMLab pipeline. Advice about the dataset is given
only from this, never assumed: a ``TensorDataset`` holds two tensors and no record list.

Nothing here calls ``__getitem__`` (it may read files or draw random numbers): attributes only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RECORDS_MIN = 1000  # a list of at least this many dicts/lists/tuples/strs is a record list
MAX_ATTRS = 64  # attributes looked at per object
DEPTH = 2  # wrappers followed (Subset.dataset, ConcatDataset.datasets, mmengine's wrappers)


@dataclass(frozen=True)
class DatasetView:
    kind: str  # "module.QualName" of the dataset
    records: str | None = None  # "data_list: list of 20,000 dict" (the largest record list found)
    record_count: int = 0
    tensors_only: bool = False  # TensorDataset-like: its samples are slices of tensors or arrays
    transforms: tuple[str, ...] = ()  # class names of an OpenMMLab pipeline's transforms

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "records": self.records, "record_count": self.record_count,
                "tensors_only": self.tensors_only, "transforms": list(self.transforms)}


def _qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _record_list(value: Any) -> tuple[int, str] | None:
    """(length, element type) when ``value`` is a list/tuple of Python records."""
    if not isinstance(value, (list, tuple)) or len(value) < RECORDS_MIN:
        return None
    probe = [value[0], value[len(value) // 2], value[-1]]
    kinds = {type(v) for v in probe}
    if len(kinds) == 1 and next(iter(kinds)) in (dict, list, tuple, str):
        return len(value), next(iter(kinds)).__name__
    return None


def _array_like(value: Any) -> bool:
    cls = type(value)
    return cls.__module__.split(".")[0] in ("torch", "numpy") and hasattr(value, "shape")


def _attrs(obj: Any) -> list[tuple[str, Any]]:
    try:
        items = list(vars(obj).items())
    except TypeError:
        return []
    return items[:MAX_ATTRS]


def _children(obj: Any) -> list[Any]:
    found: list[Any] = []
    for name in ("dataset", "datasets", "_dataset"):
        value = getattr(obj, name, None) if name in getattr(obj, "__dict__", {}) else None
        if value is None:
            continue
        found.extend(value if isinstance(value, (list, tuple)) else [value])
    return found


def _transforms(obj: Any) -> tuple[str, ...]:
    pipeline = getattr(obj, "__dict__", {}).get("pipeline")
    transforms = getattr(pipeline, "transforms", None)
    if not isinstance(transforms, (list, tuple)):
        return ()
    return tuple(type(t).__name__ for t in transforms[:MAX_ATTRS])


def describe(dataset: Any) -> DatasetView:
    """The view of ``dataset`` (never raises: a dataset that resists looking gives its type only)."""
    try:
        return _describe(dataset)
    except Exception:
        return DatasetView(_qualname(dataset))


def _describe(dataset: Any) -> DatasetView:
    best: tuple[int, str] | None = None
    transforms: tuple[str, ...] = ()
    tensors_only = False
    todo = [(dataset, 0)]
    seen: set[int] = set()
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        transforms = transforms or _transforms(obj)
        attrs = _attrs(obj)
        tensors = getattr(obj, "__dict__", {}).get("tensors")
        if obj is dataset and isinstance(tensors, (list, tuple)) and tensors and all(_array_like(t) for t in tensors):
            tensors_only = True
        for name, value in attrs:
            found = _record_list(value)
            if found is not None and (best is None or found[0] > best[0]):
                best = (found[0], f"{name}: {type(value).__name__} of {found[0]:,} {found[1]}")
        if depth < DEPTH:
            todo.extend((child, depth + 1) for child in _children(obj))
    if best is None:
        return DatasetView(_qualname(dataset), tensors_only=tensors_only, transforms=transforms)
    return DatasetView(_qualname(dataset), best[1], best[0], tensors_only, transforms)
