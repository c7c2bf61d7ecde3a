"""Entry point of loongkit-data (data pipeline): declares its features; imports no torch or mmcv."""

from __future__ import annotations

from loongkit_core.feature import Category, Feature
from loongkit_core.kit import PluginSpec

from loongkit_data import __version__

plugin = PluginSpec("data", distribution="loongkit-data")

_MMCV1 = "mmcv>=1.7.0,<=1.8.0"

for _feature in (
    Feature(
        name="data_container",
        env="LOONGKIT_DATA_CONTAINER",
        level=1,
        category=Category.DATA,
        description="pin_memory support for mmcv DataContainer; turns on DataLoader pin_memory.",
        requires=(_MMCV1,),
        targets=("mmcv.parallel",),
        implemented=False,
        plugin_version=__version__,
    ),
    Feature(
        name="data_prefetch",
        env="LOONGKIT_DATA_PREFETCH",
        level=1,
        category=Category.DATA,
        description="Prefetch the next batch to the GPU on a side stream (mmcv 1.x runners).",
        requires=(_MMCV1,),
        depends_on=("data_container",),
        targets=("mmcv.parallel",),
        implemented=False,
        plugin_version=__version__,
    ),
    Feature(
        name="mmengine_data_prefetch",
        env="LOONGKIT_MMENGINE_DATA_PREFETCH",
        level=1,
        category=Category.DATA,
        description="Prefetch the next batch to the GPU in mmengine's loops (mmcv 2.x).",
        requires=("mmcv>=2.0.0", "mmengine>=0.8.0"),
        targets=("mmengine.runner",),
        implemented=False,
        plugin_version=__version__,
    ),
    Feature(
        name="imnormalize",
        env="LOONGKIT_IMNORMALIZE",
        level=3,
        category=Category.DATA,
        description="Bit-exact compiled CPU kernel for mmcv imnormalize.",
        targets=("mmcv.image.photometric",),
        implemented=False,
        plugin_version=__version__,
    ),
    Feature(
        name="distortion",
        env="LOONGKIT_DISTORTION",
        level=3,
        category=Category.DATA,
        description="Bit-exact compiled CPU kernel for mmdet PhotoMetricDistortion.",
        targets=("mmdet.datasets.pipelines.transforms", "mmdet.datasets.transforms.transforms"),
        implemented=False,
        plugin_version=__version__,
    ),
    Feature(
        name="pytorch",
        env="LOONGKIT_PYTORCH",
        level=1,
        category=Category.DATA,
        description="DataLoader memory: serialized dataset lists, worker allocator tuning, open-files limit.",
        targets=("torch.utils.data",),
        implemented=False,
        plugin_version=__version__,
    ),
    Feature(
        name="malloc",
        env="LOONGKIT_MALLOC",
        level=2,
        category=Category.DATA,
        description="Allocator tuning (or jemalloc/tcmalloc preload) in the training process.",
        options=("LOONGKIT_MALLOC_ALLOCATOR",),
        implemented=False,
        plugin_version=__version__,
    ),
):
    plugin.add(_feature)
