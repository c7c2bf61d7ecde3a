"""The seed's CPU-vendor policy for NUMA_AFFINITY ("Hardware-aware default optimization policies").

Intel: basic NUMA node binding only. AMD / Hygon: PARTITION_PER_LLC on by default, because their
segmented L3 caches make core-to-cache latency uneven. Only defaults change: an explicit
LOONGKIT_NUMA_AFFINITY_PARTITION_PER_LLC always wins (the core's load_settings enforces that).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from loongkit_core.feature import Feature, PolicyDecision

if TYPE_CHECKING:
    from loongkit_core.hardware import Hardware

FEATURE = "numa_affinity"


def vendor_policy(hardware: Hardware, features: Sequence[Feature]) -> dict[str, PolicyDecision]:
    if not any(f.name == FEATURE for f in features):
        return {}
    vendor = hardware.cpu_vendor
    if vendor in ("amd", "hygon"):
        label = "AMD" if vendor == "amd" else "Hygon"
        return {FEATURE: PolicyDecision(
            reason=f"{label} CPU: PARTITION_PER_LLC on by default (segmented L3 caches)",
            option_defaults={"partition_per_llc": True},
        )}
    if vendor == "intel":
        return {FEATURE: PolicyDecision(
            reason="Intel CPU: basic NUMA node binding only (PARTITION_PER_LLC off by default)",
            option_defaults={"partition_per_llc": False},
        )}
    return {}
