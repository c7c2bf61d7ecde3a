"""The kernels under loongkit's runtime in the mm venv: Summary rows, DataLoader workers (fork, spawn)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

pytest.importorskip("mmcv")
PYTHON = str(Path(sys.executable))

WORKERS = r"""
import sys
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

class Images(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        import mmcv
        from loongkit_data import kernels
        from mmdet.datasets.transforms import PhotoMetricDistortion
        img = np.random.default_rng(i).integers(0, 256, (9, 21, 3), dtype=np.uint8)
        out = mmcv.imnormalize(img, np.array([1., 2., 3.]), np.array([4., 5., 6.]))
        PhotoMetricDistortion().transform({"img": img})
        patched = hasattr(mmcv.imnormalize, "__loongkit_original__")
        distortion = hasattr(PhotoMetricDistortion.transform, "__loongkit_original__")
        return torch.tensor([patched, distortion, kernels.load() is not None, out.dtype == np.float32])

if __name__ == "__main__":
    import mmcv  # the pipeline is imported in the main process too
    method = sys.argv[1]
    loader = DataLoader(Images(), batch_size=None, num_workers=2, multiprocessing_context=method)
    flags = torch.stack(list(loader))
    print("WORKERS", method, flags.all().item())
"""


def test_summary_row_starred_under_run_loongkit(run_loongkit) -> None:
    code = ("import numpy as np, mmcv\n"
            "img = np.random.randint(0, 256, (8, 17, 3), dtype=np.uint8)\n"
            "mmcv.imnormalize(img, np.array([1., 2., 3.]), np.array([4., 5., 6.]))\n")
    result = run_loongkit(argv=[PYTHON, "-c", code], env={"LOONGKIT_IMNORMALIZE": "1"})
    assert result.returncode == 0, result.stderr
    row = result.feature("imnormalize")
    assert row["active"] and row["calls"] == 1, row
    # where the binary came from: "prebuilt, avx512" from a wheel, "built ..." from a checkout
    assert row["config"]["kernel"].startswith(("prebuilt, ", "built ")), row
    assert "imnormalize                    *" in result.stdout


def test_bad_value_keeps_feature_off(run_loongkit) -> None:
    result = run_loongkit(argv=[PYTHON, "-c", "import mmcv"], env={"LOONGKIT_IMNORMALIZE": "maybe",
                                                                   "LOONGKIT_DISTORTION": "1"})
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in result.summary["features"]}
    assert not rows.get("imnormalize", {}).get("enabled", False)  # an undefined value means the default: off
    assert result.feature("distortion")["enabled"] is True


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_get_the_kernels(run_loongkit, tmp_path: Path, method: str) -> None:
    pytest.importorskip("mmdet")
    script = tmp_path / "workers.py"
    script.write_text(WORKERS)
    result = run_loongkit(argv=[PYTHON, str(script), method],
                          env={"LOONGKIT_IMNORMALIZE": "1", "LOONGKIT_DISTORTION": "1"}, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"WORKERS {method} True" in result.stdout, result.stdout + result.stderr
