"""Session history from the Postgres projection, read consistently with the log.

Before reading a conversation, the gateway notes the end of the log in the two
partitions that hold it and waits until the projector's stored positions reach
that point. Whatever any client saw acknowledged before the request is then in
the rows read: read-your-writes across gateways, through the log.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from psycopg_pool import AsyncConnectionPool

from gateway.errors import APIError
from pipeline.kafka import AsyncConsumer
from pipeline.partitioning import partition_for
from pipeline.topics import GENERATIONS, PROMPTS
from schemas import ChatMessage


def parse_session_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise APIError(404, f"No session found with id '{raw[:100]}'.",
                       code="session_not_found", param="session_id") from None


async def _require_session(conn: Any, conversation_id: uuid.UUID, tenant: str) -> None:
    row = await (await conn.execute(
        "SELECT deleted FROM conversations WHERE id = %s AND tenant = %s",
        (conversation_id, tenant),
    )).fetchone()
    if row is None or row[0]:
        raise APIError(404, f"No session found with id '{conversation_id}'.",
                       code="session_not_found", param="session_id")


class SessionStore:
    def __init__(
        self, pool: AsyncConnectionPool, meta: AsyncConsumer, partitions: int, wait_s: float
    ) -> None:
        self.pool = pool
        self.meta = meta
        self.partitions = partitions
        self.wait_s = wait_s

    async def _log_end(self, conversation_id: uuid.UUID) -> dict[tuple[str, int], int]:
        p = partition_for(str(conversation_id).encode(), self.partitions)

        def ends() -> dict[tuple[str, int], int]:
            return {(t, p): self.meta.watermarks_sync(t, p)[1] for t in (PROMPTS, GENERATIONS)}

        return await self.meta.call(ends)

    async def catch_up(self, conversation_id: uuid.UUID) -> None:
        """Wait until the projection holds everything the log held when we were called."""
        targets = await self._log_end(conversation_id)
        deadline = time.monotonic() + self.wait_s
        delay = 0.005
        while True:
            async with self.pool.connection() as conn:
                rows = await conn.execute(
                    "SELECT topic, partition, next_offset FROM projector_positions"
                    " WHERE (topic, partition) IN ((%s, %s), (%s, %s))",
                    [x for tp in targets for x in tp],
                )
                done = {(t, p): o for t, p, o in await rows.fetchall()}
            if all(done.get(tp, 0) >= end for tp, end in targets.items()):
                return
            if time.monotonic() > deadline:
                raise APIError(503, "The conversation store is behind the log; retry shortly.",
                               code="projection_lagging", headers={"Retry-After": "1"})
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def history(self, conversation_id: uuid.UUID, tenant: str) -> list[ChatMessage]:
        """The messages of a session, for its next turn."""
        await self.catch_up(conversation_id)
        async with self.pool.connection() as conn:
            await _require_session(conn, conversation_id, tenant)
            busy = await (await conn.execute(
                "SELECT request_id FROM generations"
                " WHERE conversation_id = %s AND status IN ('pending', 'running') LIMIT 1",
                (conversation_id,),
            )).fetchone()
            if busy is not None:
                raise APIError(409, f"The session's previous turn ({busy[0]}) is still "
                               "generating; wait for it to finish.", code="turn_in_progress")
            rows = await (await conn.execute(
                "SELECT role, content FROM messages WHERE conversation_id = %s ORDER BY seq",
                (conversation_id,),
            )).fetchall()
        return [ChatMessage(role=role, content=content) for role, content in rows]

    async def messages(self, conversation_id: uuid.UUID, tenant: str) -> list[dict[str, Any]]:
        await self.catch_up(conversation_id)
        async with self.pool.connection() as conn:
            await _require_session(conn, conversation_id, tenant)
            rows = await (await conn.execute(
                "SELECT seq, role, content, request_id, created_at FROM messages"
                " WHERE conversation_id = %s ORDER BY seq",
                (conversation_id,),
            )).fetchall()
        return [
            {"seq": seq, "role": role, "content": content, "request_id": request_id,
             "created_at": created_at.isoformat()}
            for seq, role, content, request_id, created_at in rows
        ]
