"""A tenant's usage from the analytics tables (``projections.analytics``), shaped like
OpenAI's organization usage API (``GET /v1/organization/usage/completions``): pages of
time buckets, each with its results. Read by ``GET /v1/usage`` and ``pipeline usage``.

Beyond OpenAI's fields each result has ``turns`` (started, finished, cancelled,
failed), ``active_sessions`` (distinct sessions with a turn started in the bucket) and
``ttft_ms`` / ``itl_ms`` (p50, p95, p99 from the merged per-minute sketches).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg

from schemas.sketch import quantiles

WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
# Buckets per page: OpenAI's defaults and maxima.
LIMITS = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}
QUANTILES = (0.5, 0.95, 0.99)


class UsageError(ValueError):
    """A query that cannot be answered, with what to change: the message is the client's."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# The last second a datetime holds (9999-12-31T23:59:59Z): a bound on every time asked.
LATEST = 253_402_300_799


@dataclass(frozen=True)
class UsageQuery:
    tenant: str
    start: int  # Unix seconds, the first bucket's start (aligned down to the width)
    end: int  # Unix seconds, exclusive
    width: str
    by_model: bool
    limit: int

    @classmethod
    def build(cls, tenant: str, start_time: int | None, end_time: int | None,
              bucket_width: str = "1d", group_by: list[str] | None = None,
              limit: int | None = None, page: str | None = None,
              now: int | None = None) -> UsageQuery:
        if bucket_width not in WIDTHS:
            raise UsageError(f"bucket_width must be one of {', '.join(WIDTHS)}", "bucket_width")
        width = WIDTHS[bucket_width]
        default_limit, max_limit = LIMITS[bucket_width]
        limit = default_limit if limit is None else limit
        if not 1 <= limit <= max_limit:
            raise UsageError(f"limit must be 1 to {max_limit} for bucket_width "
                             f"{bucket_width}", "limit")
        now = int(datetime.now(UTC).timestamp()) if now is None else now
        end = end_time if end_time is not None else now + 1
        if start_time is None:  # the last ``limit`` buckets, the current one included
            start_time = (end - 1) - (end - 1) % width - (limit - 1) * width
        if page is not None:
            try:
                start_time = int(page)
            except ValueError:
                raise UsageError("page must be a next_page value from an earlier answer",
                                 "page") from None
        for name, value in (("start_time", start_time), ("end_time", end - 1)):
            if not 0 <= value <= LATEST:
                raise UsageError(f"{name} must be a Unix time from 0 to {LATEST} "
                                 "(9999-12-31T23:59:59Z)",
                                 "page" if page is not None and name == "start_time" else name)
        if end <= start_time:
            raise UsageError("start_time must be a Unix time before end_time", "start_time")
        unknown = set(group_by or ()) - {"model"}
        if unknown:
            raise UsageError(f"group_by supports model only (not {', '.join(sorted(unknown))})",
                             "group_by")
        return cls(tenant, start_time - start_time % width, end, bucket_width,
                   "model" in (group_by or ()), limit)

    @property
    def seconds(self) -> int:
        return WIDTHS[self.width]

    @property
    def page_end(self) -> int:
        return min(self.end, self.start + self.limit * self.seconds)


def _stamp(unix: int) -> datetime:
    return datetime.fromtimestamp(unix, UTC)


def statements(query: UsageQuery) -> list[tuple[str, tuple[Any, ...]]]:
    """The three reads behind a page (minutes, sessions, latency bins), to run in one
    snapshot; ``assemble`` makes the page of their rows."""
    width = query.seconds
    bucket = f"floor(extract(epoch FROM minute) / {width})::bigint * {width}"
    model = "model" if query.by_model else "NULL::text"
    args = (query.tenant, _stamp(query.start), _stamp(query.page_end))
    where = "tenant = %s AND minute >= %s AND minute < %s"
    return [
        (f"SELECT {bucket}, {model}, sum(started), sum(finished), sum(cancelled),"
         f" sum(failed), sum(prompt_tokens), sum(completion_tokens)"
         f" FROM analytics_minutes WHERE {where} GROUP BY 1, 2", args),
        (f"SELECT {bucket}, {model}, count(DISTINCT conversation_id)"
         f" FROM analytics_sessions WHERE {where} GROUP BY 1, 2", args),
        (f"SELECT {bucket}, {model}, metric, bin, sum(turns)"
         f" FROM analytics_latency WHERE {where} GROUP BY 1, 2, 3, 4", args),
    ]


SNAPSHOT = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"


def usage(conn: psycopg.Connection[Any], query: UsageQuery) -> dict[str, Any]:
    """The page of buckets ``query`` asks for."""
    with conn.transaction():
        conn.execute(SNAPSHOT)
        rows = [conn.execute(sql, args).fetchall() for sql, args in statements(query)]
    return assemble(query, *rows)


def assemble(query: UsageQuery, minutes: list[Any], sessions: list[Any],
             latency: list[Any]) -> dict[str, Any]:
    width, start, end = query.seconds, query.start, query.page_end
    results: dict[tuple[int, str | None], dict[str, Any]] = defaultdict(_empty_result)
    for b, m, started, finished, cancelled, failed, prompt, completion in minutes:
        r = results[(b, m)]
        r.update(input_tokens=int(prompt), output_tokens=int(completion),
                 num_model_requests=int(finished + cancelled + failed), model=m)
        r["turns"] = {"started": int(started), "finished": int(finished),
                      "cancelled": int(cancelled), "failed": int(failed)}
    for b, m, count in sessions:
        results[(b, m)].update(active_sessions=int(count), model=m)
    sketches: dict[tuple[int, str | None, str], dict[int, int]] = defaultdict(dict)
    for b, m, metric, bin_, turns in latency:
        sketches[(b, m, metric)][bin_] = int(turns)
    for (b, m, metric), bins in sketches.items():
        found = quantiles(bins, QUANTILES)
        results[(b, m)][f"{metric}_ms"] = {
            f"p{round(q * 100)}": None if v is None else round(v, 3) for q, v in found.items()}
    data = []
    for b in range(start, end, width):
        rows = sorted(((m, r) for (rb, m), r in results.items() if rb == b),
                      key=lambda item: item[0] or "")
        data.append({"object": "bucket", "start_time": b, "end_time": min(b + width, query.end),
                     "results": [r for _, r in rows]})
    more = end < query.end
    return {"object": "page", "data": data, "has_more": more,
            "next_page": str(end) if more else None}


def _empty_result() -> dict[str, Any]:
    return {"object": "organization.usage.completions.result", "input_tokens": 0,
            "output_tokens": 0, "input_cached_tokens": 0, "input_audio_tokens": 0,
            "output_audio_tokens": 0, "num_model_requests": 0, "project_id": None,
            "user_id": None, "api_key_id": None, "model": None, "batch": None,
            "turns": {"started": 0, "finished": 0, "cancelled": 0, "failed": 0},
            "active_sessions": 0, "ttft_ms": None, "itl_ms": None}


def format_table(page: dict[str, Any], query: UsageQuery) -> str:
    """The page as a table, one line per bucket (and model)."""
    head = (f"{'bucket (UTC)':<17} {'model':<20} {'requests':>8} {'input':>9} {'output':>9} "
            f"{'fin':>5} {'canc':>5} {'fail':>5} {'sess':>5} {'ttft p50/p95/p99 ms':>22} "
            f"{'itl p50/p95/p99 ms':>20}")
    lines = [f"usage of tenant '{query.tenant}', {query.width} buckets", head]
    fmt = "%Y-%m-%d %H:%M"
    for bucket in page["data"]:
        when = _stamp(bucket["start_time"]).strftime(fmt)
        for r in bucket["results"] or [None]:
            if r is None:
                lines.append(f"{when:<17} {'-':<20} {0:>8}")
                continue
            t = r["turns"]
            lines.append(
                f"{when:<17} {(r['model'] or 'all'):<20} {r['num_model_requests']:>8} "
                f"{r['input_tokens']:>9} {r['output_tokens']:>9} {t['finished']:>5} "
                f"{t['cancelled']:>5} {t['failed']:>5} {r['active_sessions']:>5} "
                f"{_q(r['ttft_ms']):>22} {_q(r['itl_ms']):>20}")
    if page["has_more"]:
        lines.append(f"(more: --start {_stamp(int(page['next_page'])).isoformat()})")
    return "\n".join(lines)


def _q(found: dict[str, float | None] | None) -> str:
    if not found:
        return "-"
    return "/".join("-" if v is None else f"{v:.1f}" for v in found.values())
