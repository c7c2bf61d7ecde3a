"""Version gates read distribution metadata and never import the library."""

from __future__ import annotations

import sys

import pytest

from loongkit_core import requirements


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    requirements.installed.cache_clear()


def _fake_versions(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]) -> None:
    import importlib.metadata as md

    def version(dist: str) -> str:
        if dist in versions:
            return versions[dist]
        raise md.PackageNotFoundError(dist)

    monkeypatch.setattr(requirements.importlib.metadata, "version", version)


def test_torch_local_label_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_versions(monkeypatch, {"torch": "2.13.0+cpu"})
    assert requirements.check("torch>=2.0") is None
    assert requirements.check("torch==2.13.*") is None
    assert "outside" in requirements.check("torch>=2.6.0,<2.9")  # type: ignore[operator]


def test_inclusive_upper_bound_with_local_label(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_versions(monkeypatch, {"mmcv-full": "1.8.0+cu118"})
    assert requirements.check("mmcv>=1.7.0,<=1.8.0") is None  # mmcv-full provides mmcv


def test_alias_distribution_order(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_versions(monkeypatch, {"mmsegmentation": "1.2.2"})
    assert requirements.installed("mmseg").distribution == "mmsegmentation"  # type: ignore[union-attr]
    assert requirements.check("mmseg>=0.12.0,<=1.0.0") == "mmseg 1.2.2 outside <=1.0.0,>=0.12.0"


def test_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_versions(monkeypatch, {})
    assert requirements.check("mmdet>=2.12") == "mmdet not installed (needs mmdet>=2.12)"


def test_prerelease_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_versions(monkeypatch, {"torch": "2.10.0a0+git123"})
    assert requirements.check("torch==2.10.*") is None


def test_invalid_requirement_is_a_reason() -> None:
    assert "invalid requirement" in requirements.check("torch >>> 2")  # type: ignore[operator]


def test_check_all_first_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_versions(monkeypatch, {"torch": "2.13.0", "mmdet": "3.3.0"})
    assert requirements.check_all(("torch>=2.6", "mmdet>=2.12.0,<=2.28.3")) == "mmdet 3.3.0 outside <=2.28.3,>=2.12.0"


def test_real_metadata_does_not_import() -> None:
    had = "torch" in sys.modules
    found = requirements.installed("torch")
    assert found is not None and found.version.startswith("2.")
    assert ("torch" in sys.modules) == had
