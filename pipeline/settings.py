"""Typed settings, one environment prefix per service, read once by the ``pipeline``
command (``launch``). Each service owns its own (``gateway.settings``,
``workers.settings``, ``projections.settings``); these are what they all share."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent


class CommonSettings(BaseSettings):
    """Where the log and the store are. Prefix ``PIPELINE_``, and ``DATABASE_URL``."""

    model_config = SettingsConfigDict(env_prefix="PIPELINE_", extra="ignore")

    kafka_bootstrap: str = "127.0.0.1:9092"
    database_url: str = Field(
        default="postgresql://postgres@127.0.0.1:55432/pipeline",
        validation_alias="DATABASE_URL",
    )
    partitions: int = Field(default=6, ge=1)
    state_dir: Path = REPO_ROOT / ".state"


def _split_commas(value: Any) -> Any:
    return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) \
        else value


# A list that an environment variable gives as "a,b,c".
CommaList = Annotated[list[str], NoDecode, BeforeValidator(_split_commas)]
