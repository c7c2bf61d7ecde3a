"""DAG and BEVFUSION through the runtime when a class that differs is registered before the feature
activates: the registry watch tells the feature of it while ``activate`` runs, the feature says
``ctx.not_applicable(...)``, and the row ends NOT APPLICABLE with that reason (not applied). The watch
stays in force: the feature's other registry target still activates.

The registries are the mmcv 1.x Registry double (no OpenMMLab); the classes differ from upstream's
interface, so no kernel is needed."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from loongkit_ops.patches import registry

from loongkit_core.feature import State
from loongkit_core.runtime import Runtime

HERE = Path(__file__).parent
TARGETS = ("mmcv.utils.registry", "mmengine.registry.registry")


def _load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


double = _load(HERE / "mmcv1_registry_double.py", "lk_registry_double_states")


class DeformableFeatureAggregation:  # Sparse4D's name, another forward
    def forward(self, query: Any) -> Any:
        return query


class BaseTransform:  # BEVFusion's base, another bev_pool
    def bev_pool(self, feats: Any) -> Any:
        return feats

    def get_geometry(self) -> None:
        return None


class LSSTransform(BaseTransform):
    pass


@pytest.fixture
def registries(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Both registry targets, fresh Registry classes; a project module holding a MODELS registry in which
    the two classes above are registered already (before any feature activates)."""
    modules = {}
    for target in TARGETS:
        parts = target.split(".")
        for i in range(1, len(parts)):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        module = types.ModuleType(target)
        module.Registry = type("Registry", (double.Registry,), {})  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, target, module)
        modules[target] = module
    project = types.ModuleType("lk_states_project")
    project.MODELS = modules[TARGETS[0]].Registry("models")  # type: ignore[attr-defined]
    project.MODELS.register_module(module=DeformableFeatureAggregation)
    project.MODELS.register_module(module=LSSTransform)
    monkeypatch.setitem(sys.modules, project.__name__, project)
    yield modules
    assert not registry.hooked()  # every watch ended with the features' undo (the fixture's teardown)


@pytest.mark.parametrize("name, reason", [
    ("dag", "interface differs: DeformableFeatureAggregation.forward('self', 'query')"),
    ("bevfusion", "interface differs: BaseTransform.get_geometry('self',)"),
])
def test_a_class_registered_before_activation_that_differs_ends_not_applicable(
        registries: dict[str, Any], loongkit_runtime: Callable[..., Runtime], name: str, reason: str) -> None:
    rt = loongkit_runtime({f"LOONGKIT_{name.upper()}": "1"})
    record = rt.records[name]
    assert record.state == State.ARMED, record.reason
    rt.activate(record, TARGETS[0])
    assert record.state == State.NOT_APPLICABLE, (record.state, record.reason)
    assert record.reason.startswith(reason), record.reason
    assert record.to_json()["state"] == "not applicable"
    skipped = record.details["skipped"]
    assert isinstance(skipped, dict) and any(v.startswith(reason) for v in skipped.values()), skipped
    # The watch stays in force, and the feature's other registry target activates too.
    rt.activate(record, TARGETS[1])
    assert record.applied_targets == list(TARGETS)
    assert set(registry.hooked()) == {m.Registry for m in registries.values()}
    assert record.state == State.NOT_APPLICABLE and record.reason.startswith(reason)
