"""LOONGKIT_PYTORCH against mmengine's BaseDataset: its own serialize_data is left alone; without it,
data_list is serialized and the batches are identical."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import pytest
from loongkit_data import pytorch_memory
from loongkit_data.plugin import plugin
from loongkit_data.serialize import SerializedList
from torch.utils.data import DataLoader

from loongkit_core import log, workers
from loongkit_core import process as process_mod
from loongkit_core.context import ActivationContext, Environment
from loongkit_core.feature import FeatureRecord
from loongkit_core.importhooks import when_imported
from loongkit_core.settings import CoreSettings

pytestmark = pytest.mark.integration
mmengine_dataset = pytest.importorskip("mmengine.dataset")
pseudo_collate = pytest.importorskip("mmengine.dataset").pseudo_collate

FEATURE = next(f for f in plugin.loongkit_declare_features() if f.name == "pytorch")


class Boxes(mmengine_dataset.BaseDataset):
    SEED = 0

    def load_data_list(self) -> list[dict[str, Any]]:
        rng = random.Random(self.SEED)
        return [{"img_path": f"{i}.jpg", "instances": [{"bbox": [rng.random() for _ in range(4)],
                                                         "bbox_label": rng.randrange(80)}]} for i in range(1500)]


@pytest.fixture
def feature() -> Iterator[pytorch_memory.PytorchMemory]:
    info = process_mod.detect()
    info.role = "main"
    ctx = ActivationContext(FeatureRecord(FEATURE), Environment(CoreSettings(), info), log.get_logger("test"),
                            when_imported)
    impl = pytorch_memory.PytorchMemory(FEATURE)
    impl.activate(ctx, "torch.utils.data")
    yield impl
    impl.deactivate(ctx)
    workers.uninstall()


def epoch(ds: Any, workers_: int) -> list[Any]:
    return list(DataLoader(ds, batch_size=100, num_workers=workers_, collate_fn=pseudo_collate,
                           multiprocessing_context="fork" if workers_ else None))


def test_serialize_data_true_is_skipped(feature: pytorch_memory.PytorchMemory) -> None:
    ds = Boxes(serialize_data=True, lazy_init=False, pipeline=[])
    epoch(ds, 2)
    assert "serialize_data=True" in feature.skipped["Boxes"]
    assert not feature.serialized


def test_data_list_serialized_with_identical_batches(feature: pytorch_memory.PytorchMemory) -> None:
    Boxes.SEED = int.from_bytes(os.urandom(4), "little")
    expected = epoch(Boxes(serialize_data=False, pipeline=[]), 0)
    ds = Boxes(serialize_data=False, pipeline=[])
    got = epoch(ds, 2)
    assert isinstance(ds.data_list, SerializedList)
    assert got == expected
    assert len(got) == 15 and got[0]["img_path"] == [f"{i}.jpg" for i in range(100)]
