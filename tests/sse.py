"""A raw SSE client for tests: what a browser or curl would see."""

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
    chunks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.headers.get("x-request-id", "")


def stream_chat(url: str, body: dict[str, Any], *, stop_after: int | None = None,
                headers: dict[str, str] | None = None, timeout: float = 120) -> Streamed:
    """POST a streaming chat request and read its SSE events; with ``stop_after``,
    hang up after that many content chunks, as a client that goes away."""
    with httpx.Client(timeout=timeout) as client, client.stream(
        "POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
        headers=headers or {},
    ) as resp:
        out = Streamed(resp.status_code, dict(resp.headers))
        if resp.status_code != 200:
            resp.read()
            out.error = resp.json().get("error")
            return out
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                out.done = True
                break
            payload = json.loads(data)
            if "error" in payload:
                out.error = payload["error"]
                continue
            out.chunks.append(payload)
            for choice in payload.get("choices", []):
                out.text += choice["delta"].get("content") or ""
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            if stop_after is not None and sum(
                    1 for c in out.chunks if c["choices"] and
                    c["choices"][0]["delta"].get("content")) >= stop_after:
                break
    return out


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {sample name with labels: value}."""
    values = {}
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
