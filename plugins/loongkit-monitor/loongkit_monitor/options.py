"""LOONGKIT_MONITOR's options model, imported only when one of its variables is set (pydantic-settings
costs tens of milliseconds to import, in every process the monitor boots in)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from loongkit_core.settings import LoongkitSettings


class MonitorOptions(LoongkitSettings):
    model_config = SettingsConfigDict(env_prefix="LOONGKIT_MONITOR_", extra="ignore", case_sensitive=False)

    interval: float = Field(0.0, ge=0, allow_inf_nan=False,
                            description="Seconds between one-line progress records (0: none).")
    max_steps: int = Field(0, ge=0, description="End the job cleanly after this many steps (0: never).")
