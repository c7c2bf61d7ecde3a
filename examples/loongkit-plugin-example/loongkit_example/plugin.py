"""Declares the plugin's one feature. Imported at boot: keep it free of torch and other heavy imports."""

from loongkit_core.feature import Category
from loongkit_core.kit import PluginSpec

plugin = PluginSpec("example", distribution="loongkit-plugin-example", category=Category.OTHER)

plugin.feature(
    "example_anomaly",  # its switch: LOONGKIT_EXAMPLE_ANOMALY
    level=3,  # changes speed noticeably: only under LOONGKIT_ALL=3 or explicitly
    description="Run autograd with anomaly detection (finds the op that produced NaN/Inf gradients).",
    requires=("torch>=2.0",),
    targets=("torch",),
    options=("LOONGKIT_EXAMPLE_ANOMALY_CHECK_NAN",),
    impl="loongkit_example.anomaly:Anomaly",
)
