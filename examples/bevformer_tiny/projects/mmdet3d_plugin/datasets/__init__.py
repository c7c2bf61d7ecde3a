from . import pipelines  # noqa: F401  (registration)
from .nuscenes_dataset import SyntheticNuScenesDataset, bev_collate

__all__ = ["SyntheticNuScenesDataset", "bev_collate"]
