"""``GET /v1/usage``: the caller's tenant's usage, shaped like OpenAI's organization
usage API (``gateway.usage_query``), from the tables ``pipeline analytics`` keeps."""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.dependencies import from_store
from gateway.errors import APIError
from gateway.http import resources, tenant_of
from gateway.usage_query import SNAPSHOT, UsageError, UsageQuery, assemble, statements

_INT = re.compile(r"[0-9]{1,12}")


def _int(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    if not _INT.fullmatch(raw):
        raise APIError(400, f"{name} must be a non-negative integer"
                       f"{' (Unix seconds)' if name.endswith('_time') else ''}.",
                       code="invalid_value", param=name)
    return int(raw)


async def get_usage(request: Request) -> Response:
    res = resources(request)
    params = request.query_params
    if "start_time" not in params:
        raise APIError(400, "start_time is required (Unix seconds, inclusive).",
                       code="missing_required_parameter", param="start_time")
    group_by = [g for value in params.getlist("group_by") for g in value.split(",") if g]
    try:
        query = UsageQuery.build(tenant_of(request), _int(request, "start_time"),
                                 _int(request, "end_time"), params.get("bucket_width", "1d"),
                                 group_by, _int(request, "limit"), params.get("page"))
    except UsageError as exc:
        raise APIError(400, str(exc), code="invalid_value", param=exc.param) from None
    store = res.store
    async with from_store(store.pool, store.timeout_s) as conn, conn.transaction():
        await conn.execute(SNAPSHOT)
        rows = [await (await conn.execute(sql, args)).fetchall()
                for sql, args in statements(query)]
    return JSONResponse(assemble(query, *rows))
