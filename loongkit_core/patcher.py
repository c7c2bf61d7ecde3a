"""Symmetric monkey-patching: every ``patch`` is recorded and ``undo`` restores the exact originals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MISSING = object()


@dataclass
class _Patch:
    owner: Any
    name: str
    original: Any  # _MISSING when the attribute did not exist (undo deletes it)
    replacement: Any
    in_dict: bool  # the attribute lived in owner.__dict__ itself (not inherited)


class Patcher:
    """Install attribute replacements and remove them again, in reverse order."""

    def __init__(self) -> None:
        self._patches: list[_Patch] = []

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

    def original(self, owner: Any, name: str) -> Any:
        """The value ``owner.name`` had before the first patch of it."""
        for p in self._patches:
            if p.owner is owner and p.name == name:
                return p.original
        return getattr(owner, name)

    @property
    def patched(self) -> list[tuple[Any, str]]:
        return [(p.owner, p.name) for p in self._patches]

    def undo(self) -> None:
        """Restore every patched attribute, newest first; leaves the owners exactly as found."""
        while self._patches:
            p = self._patches.pop()
            if p.in_dict:
                setattr(p.owner, p.name, p.original)
            else:
                try:
                    delattr(p.owner, p.name)
                except AttributeError:
                    pass

    def __len__(self) -> int:
        return len(self._patches)
