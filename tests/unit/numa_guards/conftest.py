"""Fixtures for the config guards tests: an in-process activation context with a recording logger."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from loongkit_numa.fake_cgroups import write_cgroup_tree

from loongkit_core.context import ActivationContext, Environment
from loongkit_core.feature import Category, Feature, FeatureRecord
from loongkit_core.hardware import detect
from loongkit_core.process import MAIN, ProcessInfo
from loongkit_core.settings import CoreSettings


class RecordingLog:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def _add(self, level: str, message: str, **kw: Any) -> None:
        self.lines.append((level, message))

    def warning(self, message: str, **kw: Any) -> None:
        self._add("warning", message)

    def info(self, message: str, **kw: Any) -> None:
        self._add("info", message)

    def debug(self, message: str, **kw: Any) -> None:
        self._add("debug", message)

    def at(self, level: str) -> list[str]:
        return [m for lv, m in self.lines if lv == level]


FEATURE = Feature(name="config_guards", env="LOONGKIT_CONFIG_GUARDS", level=1, category=Category.RESOURCE,
                  description="test", requires=("torch>=2.1.0",), targets=("torch",))


@pytest.fixture
def recording_log() -> type[RecordingLog]:
    return RecordingLog


@pytest.fixture
def guard_ctx(tmp_path: Path) -> Callable[..., tuple[Any, ActivationContext, RecordingLog]]:
    """``guard_ctx(environ=..., local_rank=..., lws=..., tree=dict(...))`` -> (impl, ctx, log), configured."""
    counter = iter(range(1000))

    def build(environ: Mapping[str, str] | None = None, local_rank: int | None = None, lws: int | None = None,
              role: str = MAIN, tree: dict[str, Any] | None = None) -> tuple[Any, ActivationContext, RecordingLog]:
        from loongkit_numa.guards import ConfigGuards

        root = tmp_path / f"root{next(counter)}"
        write_cgroup_tree(root, **(tree or {}))
        environ = dict(environ or {})
        settings = CoreSettings.model_validate({"sysfs_root": str(root)})
        process = ProcessInfo(role=role, pid=1, host="h", rank=local_rank, local_rank=local_rank,
                              world_size=lws, local_world_size=lws)
        env = Environment(settings, process, environ, hardware_loader=lambda: detect(str(root)))
        impl = ConfigGuards(FEATURE)
        options, warnings = impl.configure(env, None)
        record = FeatureRecord(FEATURE, config=options)
        log = RecordingLog()
        for w in warnings:
            log.warning(w)
        ctx = ActivationContext(record, env, log, lambda module, cb: None)
        return impl, ctx, log

    return build
