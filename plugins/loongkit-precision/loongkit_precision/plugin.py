"""Entry point of loongkit-precision: declares its features (cheap; imports no torch)."""

from __future__ import annotations

from loongkit_core.feature import Category
from loongkit_core.kit import PluginSpec

plugin = PluginSpec("precision", distribution="loongkit-precision", category=Category.PRECISION)

plugin.feature(
    "allow_tf32",
    level=1,
    description="Use TF32 for FP32 matrix multiplication and convolution on CUDA devices.",
    requires=("torch>=2.0.0",),
    targets=("torch",),
    impl="loongkit_precision.tf32:AllowTF32",
)
