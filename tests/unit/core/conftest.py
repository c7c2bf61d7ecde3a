"""Fixtures for the runtime's parts (resolution, replay, lifecycle, activity_gather): ``booted``, a
:class:`~loongkit_core.runtime.Runtime` booted with no installed plugin loaded, then given features of a
planted plugin whose hooks the manager's calls stand in for; ``feature``, one such declaration."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest

from loongkit_core.feature import Category, Feature, FeatureRecord
from loongkit_core.runtime import Runtime

PLUGINS_OFF = {"LOONGKIT_DISABLE_PLUGINS": "data,monitor,numa,ops,precision"}


def feature(name: str, level: int = 1, **kwargs: Any) -> Feature:
    return Feature(name=name, env=f"LOONGKIT_{name.upper()}", level=level, category=Category.OTHER,
                   description=f"planted {name}", plugin="planted", **kwargs)


def booted(settings: Mapping[str, str] | None = None, variables: Mapping[str, str] | None = None,
           features: tuple[Feature, ...] = (), owner: Callable[..., Any] | None = None) -> Runtime:
    """Booted under ``settings`` (core variables), then ``features`` declared (records) with their own
    ``variables`` set; the planted plugin's ``detect``/``configure`` answer through ``owner(hook, **kwargs)``
    (default: applicable, configured with nothing)."""
    rt = Runtime(environ={**PLUGINS_OFF, **(settings or {})}, arm=False)
    rt.boot(configure_logging=False)
    rt.environ = {**rt.environ, **(variables or {})}
    for f in features:
        rt.records[f.name] = FeatureRecord(f)
    calls: list[tuple[str, str]] = []

    def call_owner(plugin: str, hook: str, **kwargs: Any) -> Any:
        assert plugin == "planted"
        calls.append((hook, kwargs["feature"].name))
        return owner(hook, **kwargs) if owner is not None else None

    rt.manager.call_owner = call_owner  # type: ignore[method-assign]
    rt.owner_calls = calls  # type: ignore[attr-defined]
    return rt


@pytest.fixture(name="feature")
def feature_fixture() -> Callable[..., Feature]:
    return feature


@pytest.fixture(name="booted")
def booted_fixture() -> Callable[..., Runtime]:
    return booted
