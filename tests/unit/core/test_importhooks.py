"""Post-import hooks fire once, after the module (and its package) finished importing."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from loongkit_core import importhooks


@pytest.fixture
def pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A fresh package `lkpkg_<n>` whose __init__ imports its submodule `sub` and then sets DONE."""
    name = f"lkpkg_{abs(hash(tmp_path)) % 10**8}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text(textwrap.dedent("""
        from . import sub
        DONE = True
    """))
    (root / "sub.py").write_text("VALUE = 41\n")
    (root / "late.py").write_text("LATE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]
    importhooks.reset()


def test_fires_after_import(pkg: str) -> None:
    seen = []
    importhooks.when_imported(pkg, lambda m: seen.append(getattr(m, "DONE", False)))
    assert seen == []
    __import__(pkg)
    assert seen == [True]


def test_fires_at_once_when_already_imported(pkg: str) -> None:
    __import__(pkg)
    seen = []
    importhooks.when_imported(pkg, lambda m: seen.append(m.__name__))
    assert seen == [pkg]


def test_submodule_waits_for_its_package(pkg: str) -> None:
    seen = []

    def cb(module):  # type: ignore[no-untyped-def]
        seen.append(getattr(sys.modules[pkg], "DONE", False))

    importhooks.when_imported(f"{pkg}.sub", cb)
    __import__(pkg)
    assert seen == [True]  # the package's __init__ had finished


def test_late_submodule(pkg: str) -> None:
    seen = []
    importhooks.when_imported(f"{pkg}.late", lambda m: seen.append(m.LATE))
    __import__(pkg)
    assert seen == []
    __import__(f"{pkg}.late")
    assert seen == [1]


def test_registration_from_inside_a_callback(pkg: str) -> None:
    seen = []

    def outer(module):  # type: ignore[no-untyped-def]
        importhooks.when_imported(f"{pkg}.sub", lambda m: seen.append(m.VALUE))

    importhooks.when_imported(pkg, outer)
    __import__(pkg)
    assert seen == [41]


def test_callback_error_is_reported_not_raised(pkg: str) -> None:
    errors = []
    importhooks.set_error_handler(lambda name, cb, exc: errors.append((name, type(exc))))
    try:
        importhooks.when_imported(pkg, lambda m: 1 / 0)
        module = __import__(pkg)
        assert module.DONE
        assert errors == [(pkg, ZeroDivisionError)]
    finally:
        importhooks.set_error_handler(None)


def test_loader_is_restored(pkg: str) -> None:
    importhooks.when_imported(pkg, lambda m: None)
    module = __import__(pkg)
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    assert module.__spec__.loader is module.__loader__


def test_missing_module_still_raises(pkg: str) -> None:
    importhooks.when_imported(f"{pkg}.nothere", lambda m: None)
    with pytest.raises(ModuleNotFoundError):
        __import__(f"{pkg}.nothere")


def test_submodule_is_bound_to_its_package_when_the_callback_runs(pkg: str) -> None:
    seen = []
    importhooks.when_imported(f"{pkg}.late", lambda m: seen.append(getattr(sys.modules[pkg], "late", None) is m))
    __import__(pkg)
    __import__(f"{pkg}.late")
    assert seen == [True]


def test_registered_while_the_module_is_importing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module that registers a hook on itself mid-import (not under our loader) fires once it is done."""
    name = f"lkself_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(f"""
        from loongkit_core import importhooks
        SEEN = []
        importhooks.when_imported({name!r}, lambda m: SEEN.append(getattr(m, "DONE", False)))
        DONE = True
    """))
    (tmp_path / f"{name}_next.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        module = __import__(name)
        assert module.SEEN == []  # still importing when registered: nothing yet
        __import__(f"{name}_next")  # any later import completes the check
        assert module.SEEN == [True]
    finally:
        sys.modules.pop(name, None)
        sys.modules.pop(f"{name}_next", None)
        importhooks.reset()
