"""The gateway's side of long-term memory: recall a user's memories from the memory
service (``memory.service``) before a turn is written (``/v1/memories``:
``gateway.memories``).

A user is the caller's tenant plus OpenAI's ``user`` field (a query parameter here):
every call names both, and the memory service answers only within them.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from gateway.problems import MemoryUnavailable, RecallsBusy
from schemas import Recalled


class MemoryClient:
    def __init__(self, url: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/") if url else None
        self._http = httpx.AsyncClient(timeout=timeout_s) if url else None

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        if self._http is None:
            raise MemoryUnavailable("memory is not enabled on this service (GATEWAY_MEMORY_URL)")
        try:
            response = await self._http.request(method, f"{self.url}{path}", **kwargs)
        except httpx.HTTPError as exc:
            raise MemoryUnavailable(f"the memory service did not answer ({type(exc).__name__})"
                                    ) from None
        if response.status_code >= 500:
            raise MemoryUnavailable(f"the memory service answered {response.status_code}")
        return response

    async def recall(self, tenant: str, user: str, text: str,
                     session: uuid.UUID | None) -> tuple[Recalled, ...]:
        """The user's memories nearest ``text`` (those of ``session`` aside)."""
        response = await self._call("POST", "/v1/recall", json={
            "tenant": tenant, "user": user, "text": text,
            "exclude_session": None if session is None else str(session)})
        if response.status_code == 429:
            try:
                said = str(response.json()["error"]["message"])
            except (ValueError, KeyError, TypeError):
                said = "Too many recalls of this tenant at once; try again shortly."
            raise RecallsBusy(said)
        if response.status_code != 200:
            raise MemoryUnavailable(f"the memory service refused the recall "
                                    f"({response.status_code})")
        return tuple(Recalled(id=m["id"], text=m["text"])
                     for m in response.json()["memories"])

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
