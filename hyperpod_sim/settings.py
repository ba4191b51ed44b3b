"""Settings of the control plane, from flags and ``HPSIM_*`` environment variables.

Nested groups use a double underscore: ``HPSIM_DATABASE__URL``, ``HPSIM_PROVISIONING__NODE_READY_DELAY_S``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class DatabaseSettings(BaseModel):
    url: str | None = Field(
        default=None,
        description="SQLAlchemy URL. Default: a SQLite file in the data dir.",
    )


class ProvisioningSettings(BaseModel):
    node_ready_delay_s: float = Field(
        default=2.0,
        ge=0,
        description="Simulated time from a node's launch to Running. Zero in tests.",
    )


class LimitSettings(BaseModel):
    max_instances_per_cluster: int = Field(
        default=256,
        ge=1,
        description="Account limit on the total instance count of one cluster "
        "(ResourceLimitExceeded past it).",
    )
    max_clusters: int = Field(default=100, ge=1, description="Account limit on clusters.")


class ReconcilerSettings(BaseModel):
    interval_s: float = Field(default=1.0, gt=0, description="Periodic re-sync interval.")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HPSIM_", env_nested_delimiter="__", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8080
    data_dir: Path = Path(".hyperpod-sim")
    account_id: str = Field(default="123456789012", pattern=r"^\d{12}$")
    region: str = "us-east-1"
    database: DatabaseSettings = DatabaseSettings()
    provisioning: ProvisioningSettings = ProvisioningSettings()
    limits: LimitSettings = LimitSettings()
    reconciler: ReconcilerSettings = ReconcilerSettings()

    def database_url(self) -> str:
        if self.database.url:
            return self.database.url
        return f"sqlite:///{(self.data_dir / 'hyperpod-sim.db').resolve()}"


@lru_cache
def get_settings() -> Settings:
    return Settings()
