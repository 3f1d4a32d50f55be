"""The projector's settings (prefix ``PROJECTOR_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.settings import CommaList
from pipeline.topics import GENERATIONS, PROMPTS


class ProjectorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PROJECTOR_", extra="ignore")

    # The consumer group, one per store: a second store fed from the same log (a
    # reporting copy, say) runs its projectors in a group of its own.
    group: str = "projector"

    # A batch (one transaction) gathers records for at most ``batch_max_ms`` after its
    # first, and at most ``batch_max_events`` of them.
    batch_max_events: int = Field(default=500, ge=1)
    batch_max_ms: float = Field(default=50.0, gt=0)
    # How soon the group notices a dead projector and hands its partitions on.
    session_timeout_ms: int = Field(default=10_000, ge=6_000)
    metrics_port: int = 0


class AnalyticsSettings(BaseSettings):
    """``pipeline analytics`` (prefix ``ANALYTICS_``)."""

    model_config = SettingsConfigDict(env_prefix="ANALYTICS_", extra="ignore")

    # Its consumer group; a second set of tables (a rebuild, say) reads in a group of its own.
    group: str = "analytics"
    # The prompts topic and the generations topic it reads (a mirror's, a benchmark's).
    topics: CommaList = Field(default_factory=lambda: [PROMPTS, GENERATIONS], min_length=2,
                              max_length=2)
    # The tables' schema in DATABASE_URL (None: the search path's, beside the store).
    schema_name: str | None = None
    batch_max_events: int = Field(default=1000, ge=1)
    batch_max_ms: float = Field(default=200.0, gt=0)
    # How soon the group notices a dead consumer and hands its partitions on.
    session_timeout_s: float = Field(default=10.0, ge=6.0)
    # How often faust commits the offsets of applied records: what a restart reads again
    # (and adds nothing for).
    commit_interval_s: float = Field(default=2.8, gt=0)
    metrics_port: int = 0
    # The tenants (and models, and failure codes) with Prometheus series of their own;
    # the rest share one labelled "(other)". The tables keep them all.
    series_per_label: int = Field(default=100, ge=0)
