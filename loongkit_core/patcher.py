"""Symmetric monkey-patching: every change is recorded and ``undo`` restores the exact originals.

Three kinds of change, undone newest first by the one ``undo``:

* ``patch(owner, name, value)``: replace (or add) an attribute; undo puts back the object that was
  in ``owner.__dict__`` or deletes the shadowing attribute when it was inherited or missing;
* ``assign(owner, name, value)``: set a value through attribute assignment and restore it the same
  way (properties and configuration objects such as ``torch.backends.*`` or ``torch._dynamo.config``,
  where deleting is wrong);
* ``defer(callback)``: run ``callback()`` at undo (a hook handle's ``remove``, an environment
  variable to pop, a callback to unregister).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at boot (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    from typing import Any

_MISSING = object()


# Plain records, not dataclasses: this module is imported by every booting process, where building a
# dataclass is a boot cost (docs/benchmarks.md, start-up).
class _Patch:
    __slots__ = ("in_dict", "name", "original", "owner", "replacement")

    def __init__(self, owner: Any, name: str, original: Any, replacement: Any, in_dict: bool) -> None:
        self.owner, self.name = owner, name
        self.original = original  # _MISSING when the attribute did not exist (undo deletes it)
        self.replacement = replacement
        self.in_dict = in_dict  # the attribute lived in owner.__dict__ itself (not inherited)


class _Assign:
    __slots__ = ("name", "original", "owner")

    def __init__(self, owner: Any, name: str, original: Any) -> None:
        self.owner, self.name, self.original = owner, name, original


class _Item:
    __slots__ = ("key", "mapping", "original")

    def __init__(self, mapping: MutableMapping[Any, Any], key: Any, original: Any) -> None:
        self.mapping, self.key = mapping, key
        self.original = original  # _MISSING: the key was absent (undo removes it)


class _Deferred:
    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], object]) -> None:
        self.callback = callback


class Patcher:
    """Install changes and remove them again, in reverse order."""

    def __init__(self) -> None:
        self._patches: list[_Patch | _Assign | _Item | _Deferred] = []

    def patch(self, owner: Any, name: str, replacement: Any, *, require: bool = True) -> Any:
        """Set ``owner.name = replacement``; return the previous value as attribute access gave it.

        With ``require`` (default) a missing attribute raises AttributeError: the target's
        structure is not what the patch expects.
        """
        in_dict = name in getattr(owner, "__dict__", {})
        original = owner.__dict__[name] if in_dict else getattr(owner, name, _MISSING)
        if original is _MISSING and require:
            raise AttributeError(f"{getattr(owner, '__name__', owner)!r} has no attribute {name!r}")
        previous = getattr(owner, name, None)
        setattr(owner, name, replacement)
        self._patches.append(_Patch(owner, name, original, replacement, in_dict))
        return previous

    def assign(self, owner: Any, name: str, value: Any) -> Any:
        """``owner.name = value`` through the attribute's own setter; undo assigns the old value back.

        For flags behind properties or config modules, where ``patch``'s delete-on-undo is wrong.
        Returns the previous value.
        """
        previous = getattr(owner, name)
        setattr(owner, name, value)
        self._patches.append(_Assign(owner, name, previous))
        return previous

    def set_item(self, mapping: MutableMapping[Any, Any], key: Any, value: Any) -> Any:
        """``mapping[key] = value`` (``os.environ``, a registry's dict); undo restores or removes the key.
        Returns the previous value or None."""
        original = mapping.get(key, _MISSING) if hasattr(mapping, "get") else _MISSING
        mapping[key] = value
        self._patches.append(_Item(mapping, key, original))
        return None if original is _MISSING else original

    def defer(self, callback: Callable[[], object]) -> None:
        """Run ``callback()`` at undo, in order with the other changes (newest first)."""
        self._patches.append(_Deferred(callback))

    def original(self, owner: Any, name: str) -> Any:
        """The value ``owner.name`` had before the first patch of it."""
        for p in self._patches:
            if isinstance(p, (_Patch, _Assign)) and p.owner is owner and p.name == name:
                return p.original
        return getattr(owner, name)

    @property
    def patched(self) -> list[tuple[Any, str]]:
        return [(p.owner, p.name) for p in self._patches if isinstance(p, (_Patch, _Assign))]

    def undo(self) -> None:
        """Restore every change, newest first; leaves the owners exactly as found.

        Every change is undone even if one raises; the first error is raised at the end.
        """
        error: BaseException | None = None
        while self._patches:
            p = self._patches.pop()
            try:
                _undo_one(p)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error

    def __len__(self) -> int:
        return len(self._patches)


def _undo_one(p: _Patch | _Assign | _Item | _Deferred) -> None:
    if isinstance(p, _Patch):
        if p.in_dict:
            setattr(p.owner, p.name, p.original)
        else:
            try:
                delattr(p.owner, p.name)
            except AttributeError:
                pass
    elif isinstance(p, _Assign):
        setattr(p.owner, p.name, p.original)
    elif isinstance(p, _Item):
        if p.original is _MISSING:
            p.mapping.pop(p.key, None)
        else:
            p.mapping[p.key] = p.original
    else:
        p.callback()
