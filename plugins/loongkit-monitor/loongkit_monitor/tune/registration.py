"""What ``loongkit tune`` adds to the monitor plugin's PluginSpec: the ``tune`` subcommand and the
worker-count feature it turns. Declaring is cheap (no torch, no argparse until the CLI runs).

The plugin module calls :func:`register` once: ``register(plugin)``.
"""

from __future__ import annotations

from typing import Any

from loongkit_core.feature import Category, Feature
from loongkit_core.kit import PluginSpec

WORKERS_FEATURE = Feature(
    name="dataloader_workers",
    env="LOONGKIT_DATALOADER_WORKERS",
    level=2,
    category=Category.DATA,
    description="Every DataLoader uses LOONGKIT_DATALOADER_WORKERS_COUNT workers (what loongkit tune tries).",
    requires=("torch>=1.10",),
    targets=("torch.utils.data",),
    options=("LOONGKIT_DATALOADER_WORKERS_COUNT",),
)


def _add_cli(subparsers: Any) -> None:
    """``loongkit tune`` (argparse and the tune modules are imported only when the CLI runs)."""
    from loongkit_monitor.tune.cli import add_cli

    add_cli(subparsers)


def register(plugin: PluginSpec, version: str = "") -> None:
    feature = WORKERS_FEATURE
    if version:
        feature = feature.replace(plugin_version=version)
    plugin.add(feature, impl="loongkit_monitor.tune.workers:DataLoaderWorkers")
    plugin.cli(_add_cli)
