"""Entry point of loongkit-monitor: declares LOONGKIT_MONITOR (cheap; imports no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loongkit_core.feature import Category
from loongkit_core.kit import PluginSpec
from loongkit_monitor import __version__

plugin = PluginSpec("monitor", distribution="loongkit-monitor", category=Category.RESOURCE)

plugin.feature(
    "monitor",
    level=1,
    description="Observe the training job: step time, data wait, GPU idle, workers' CPU and memory, "
                "stragglers; evidence-backed recommendations.",
    requires=("torch>=2.0.0",),
    targets=("torch.optim.optimizer", "torch.utils.data.dataloader", "torch.autograd", "torch.distributed",
             "torch.nn.parallel.distributed", "mmengine.runner", "mmcv.runner", "transformers.trainer"),
    options=("LOONGKIT_MONITOR_INTERVAL", "LOONGKIT_MONITOR_MAX_STEPS"),
    impl="loongkit_monitor.feature:MonitorFeature",
)


# Other plugins' features the monitor reads or recommends, and tune's knobs: checked handles (a name
# the plugin does not declare is a boot fault and a conformance failure, not a silent no-op).
DISTORTION = plugin.refer("data", "distortion")
IMNORMALIZE = plugin.refer("data", "imnormalize")
PYTORCH = plugin.refer("data", "pytorch")
MALLOC = plugin.refer("data", "malloc")
NUMA_AFFINITY = plugin.refer("numa", "numa_affinity")
CONFIG_GUARDS = plugin.refer("numa", "config_guards")
DATALOADER_WORKERS = plugin.refer("monitor", "dataloader_workers")
RECOMMENDABLE = (DISTORTION, IMNORMALIZE, PYTORCH, NUMA_AFFINITY, CONFIG_GUARDS, DATALOADER_WORKERS)


@plugin.summary
def training_monitor(records: Sequence[Any]) -> list[str]:
    """The "Training monitor" section under the Feature Summary table (when the feature ran here)."""
    record = next((r for r in records if r.feature.name == "monitor" and r.enabled), None)
    if record is None or record.state.value not in ("applied", "active"):
        return []
    from loongkit_monitor import report

    details = record.details.get("monitor")
    return report.render(details if isinstance(details, dict) else None)


# `loongkit tune` and LOONGKIT_DATALOADER_WORKERS, the worker-count knob it turns (loongkit_monitor/tune/).
from loongkit_monitor.tune.registration import register as _register_tune  # noqa: E402

_register_tune(plugin, __version__)
