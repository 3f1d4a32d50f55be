"""A raw SSE client for tests: what a browser or curl would see, event ids included
(from ``id:`` lines on a re-attached stream, from each chunk's ``event_id`` on a POST)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Streamed:
    status: int
    headers: dict[str, str]
    text: str = ""
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    done: bool = False
    broken: bool = False  # the connection died under the client
    chunks: list[dict[str, Any]] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)  # the events' positions, in order
    id_lines: list[str] = field(default_factory=list)  # the SSE ``id:`` lines

    @property
    def request_id(self) -> str:
        return self.headers.get("x-request-id", "")

    @property
    def last_id(self) -> str:
        return self.ids[-1]

    def content_chunks(self) -> int:
        return sum(1 for c in self.chunks
                   if c["choices"] and c["choices"][0]["delta"].get("content"))


def _read(resp: httpx.Response, out: Streamed, stop_after: int | None) -> None:
    event_id: str | None = None
    for line in resp.iter_lines():
        if line.startswith("id: "):
            event_id = line[len("id: "):]
            out.id_lines.append(event_id)
            continue
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            out.done = True
            return
        payload = json.loads(data)
        if "event_id" in payload:
            assert event_id in (None, payload["event_id"]), "id line and event_id differ"
            out.ids.append(payload["event_id"])
        event_id = None
        if "error" in payload:
            out.error = payload["error"]
            continue
        out.chunks.append(payload)
        for choice in payload.get("choices", []):
            out.text += choice["delta"].get("content") or ""
            out.finish_reason = choice.get("finish_reason") or out.finish_reason
        if stop_after is not None and out.content_chunks() >= stop_after:
            return


def sse_request(method: str, url: str, *, body: dict[str, Any] | None = None,
                stop_after: int | None = None, headers: dict[str, str] | None = None,
                timeout: float = 120) -> Streamed:
    """Read an SSE response; with ``stop_after``, hang up after that many content chunks,
    as a client that goes away."""
    with httpx.Client(timeout=timeout) as client, client.stream(
        method, url, json=body, headers=headers or {},
    ) as resp:
        out = Streamed(resp.status_code, dict(resp.headers))
        if resp.status_code != 200:
            resp.read()
            out.error = resp.json().get("error")
            return out
        try:
            _read(resp, out, stop_after)
        except (httpx.RemoteProtocolError, httpx.ReadError):
            out.broken = True
    return out


def stream_chat(url: str, body: dict[str, Any], *, stop_after: int | None = None,
                headers: dict[str, str] | None = None, timeout: float = 120) -> Streamed:
    """POST a streaming chat request and read its SSE events."""
    return sse_request("POST", f"{url}/v1/chat/completions", body={**body, "stream": True},
                       stop_after=stop_after, headers=headers, timeout=timeout)


def resume_chat(url: str, completion_id: str, last_event_id: str | None = None,
                stop_after: int | None = None, timeout: float = 120,
                headers: dict[str, str] | None = None) -> Streamed:
    """Re-attach to a turn's stream, as an EventSource reconnecting with Last-Event-ID."""
    sent = {**(headers or {}), **({"Last-Event-ID": last_event_id} if last_event_id else {})}
    return sse_request("GET", f"{url}/v1/chat/completions/{completion_id}/stream",
                       headers=sent, stop_after=stop_after, timeout=timeout)


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {sample name with labels: value}."""
    values = {}
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
