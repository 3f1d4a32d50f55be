"""The projector's settings (prefix ``PROJECTOR_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ProjectorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PROJECTOR_", extra="ignore")

    # The consumer group, one per store: a second store fed from the same log (a
    # reporting copy, say) runs its projectors in a group of its own.
    group: str = "projector"

    batch_max_events: int = Field(default=500, ge=1)
    batch_max_ms: float = Field(default=50.0, gt=0)
    # How soon the group notices a dead projector and hands its partitions on.
    session_timeout_ms: int = Field(default=10_000, ge=6_000)
    metrics_port: int = 0
