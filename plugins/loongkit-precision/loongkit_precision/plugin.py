"""Entry point of loongkit-precision: declares its features (cheap; imports no torch)."""

from __future__ import annotations

from loongkit_core.feature import Category, Feature
from loongkit_core.kit import PluginSpec
from loongkit_precision import __version__

plugin = PluginSpec("precision", distribution="loongkit-precision")

plugin.add(
    Feature(
        name="allow_tf32",
        env="LOONGKIT_ALLOW_TF32",
        level=1,
        category=Category.PRECISION,
        description="Use TF32 for FP32 matrix multiplication and convolution on CUDA devices.",
        requires=("torch>=2.0.0",),
        targets=("torch",),
        plugin_version=__version__,
    ),
    impl="loongkit_precision.tf32:AllowTF32",
)
