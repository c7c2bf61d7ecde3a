"""Entry point of loongkit-numa (resource control): declares its features; imports no torch."""

from __future__ import annotations

from typing import Any

from loongkit_core.feature import Category
from loongkit_core.kit import PluginSpec
from loongkit_numa.policy import vendor_policy

plugin = PluginSpec("numa", distribution="loongkit-numa", category=Category.RESOURCE)
plugin.policy(vendor_policy)  # AMD/Hygon: PARTITION_PER_LLC on by default; Intel: node binding only


@plugin.cli
def _add_cli(subparsers: Any) -> None:
    """``loongkit numa plan`` (argparse is imported only when the CLI runs)."""
    from loongkit_numa.cli import add_cli

    add_cli(subparsers)


_NUMA_OPTIONS = tuple(
    f"LOONGKIT_NUMA_AFFINITY_{o}"
    for o in (
        "ALLOW_INDEX",
        "ALLOW_ASYMMETRIC",
        "TRAIN_ON_GPULESS",
        "DATA_WORKER_ON_GPULESS",
        "DATA_WORKER_GPULESS_ONLY",
        "PARTITION_PER_LLC",
        "SEPARATE_BY_ROLES",
    )
)

plugin.feature(
    "numa_affinity",
    level=1,
    description="Bind each training process (and its data workers) to its GPU's NUMA node.",
    options=_NUMA_OPTIONS,
    impl="loongkit_numa.affinity:NumaAffinity",
)
plugin.feature(
    "subcgroups",
    level=2,
    description="Put training and data processes into per-rank child cgroups following the NUMA plan.",
    options=(*_NUMA_OPTIONS, "LOONGKIT_SUBCGROUPS_CGROUP_ROOT"),
    disables=("numa_affinity",),
    impl="loongkit_numa.subcgroups:Subcgroups",
)
plugin.feature(
    "config_guards",
    level=1,
    description="Warn when threads, data workers or compile threads exceed the node's CPU budget.",
    requires=("torch>=2.1.0",),
    targets=("torch", "torch._inductor.config"),
    options=("LOONGKIT_CONFIG_GUARDS_APPLY_FIX",),
    impl="loongkit_numa.guards:ConfigGuards",
)
plugin.feature(
    "page_cache_limit",
    level=2,
    description="Limit page cache on the container's root memcg to curb fragmentation jitter.",
    options=("LOONGKIT_PAGE_CACHE_LIMIT_SIZE", "LOONGKIT_PAGE_CACHE_LIMIT_SYNC"),
    category=Category.DATA,
    impl="loongkit_numa.pagecache:PageCacheLimit",
)
