"""LOONGKIT_NUMA_AFFINITY_* options (seed: "Advanced settings for NUMA affinity")."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from loongkit_core.settings import LkBool, LoongkitSettings


class NumaAffinityOptions(LoongkitSettings):
    """Every option is a seed bool; an undefined value reverts to its default with one warning.

    ``partition_per_llc``'s default comes from the hardware policy (AMD/Hygon: on; Intel: off).
    """

    model_config = SettingsConfigDict(env_prefix="LOONGKIT_NUMA_AFFINITY_", extra="ignore", case_sensitive=False)

    allow_index: LkBool = Field(
        False, description="torch <= 2.4: map local rank N to the N-th GPU in PCI order "
                           "(do not set CUDA_VISIBLE_DEVICES then).")
    allow_asymmetric: LkBool = Field(
        False, description="Bind even when GPUs are not spread evenly over the NUMA nodes.")
    train_on_gpuless: LkBool = Field(
        False, description="Asymmetric only: training processes may also use the GPU-less nodes next to "
                           "their GPU's node.")
    data_worker_on_gpuless: LkBool = Field(
        False, description="Asymmetric only: data processes may also use those GPU-less nodes.")
    data_worker_gpuless_only: LkBool = Field(
        False, description="Asymmetric only, with DATA_WORKER_ON_GPULESS: data processes use the GPU-less "
                           "nodes only.")
    partition_per_llc: LkBool = Field(
        False, description="Give the training processes of a node disjoint whole L3 caches (AMD/Hygon).")
    separate_by_roles: LkBool = Field(
        False, description="Training and data processes use different L3 caches.")

    def consistency_warnings(self) -> list[str]:
        """Combinations the seed defines as ignored; said once so nobody wonders why nothing changed."""
        out: list[str] = []
        prefix = "LOONGKIT_NUMA_AFFINITY_"
        if self.data_worker_gpuless_only and not self.data_worker_on_gpuless:
            out.append(f"{prefix}DATA_WORKER_GPULESS_ONLY=1 is ignored without {prefix}DATA_WORKER_ON_GPULESS=1")
        gpuless = [n for n in ("train_on_gpuless", "data_worker_on_gpuless") if getattr(self, n)]
        if gpuless and not self.allow_asymmetric:
            names = ", ".join(prefix + n.upper() for n in gpuless)
            out.append(f"{names} only apply with {prefix}ALLOW_ASYMMETRIC=1 on an asymmetric topology")
        return out
