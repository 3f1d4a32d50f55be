"""API keys, tenant isolation and rate limits, on real Kafka and Postgres.

This module's gateway and projector use a database of their own (keys turn auth on
for every gateway of a store), fed from the simulated stack's log by a projector in
a group of its own; the worker is the SIMULATED engine.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
import pytest

from gateway.edge import forwarded_client, networks
from infra.process import free_port
from pipeline.topics import PROMPTS
from projections.migrate import migrate
from tests.conftest import Service, Stack, new_database, start_service, wait_healthy
from tests.logread import end_offsets
from tests.sse import resume_chat, scrape, stream_chat

pytestmark = pytest.mark.integration

# Prompts carry this, so the logs can be searched for prompt text afterwards.
MARKER = "confidential-prompt-" + uuid.uuid4().hex[:8]


@dataclass
class Secured:
    stack: Stack
    url: str
    services: dict[str, Service]
    keys: list[str] = field(default_factory=list)  # every key made, to search logs for

    def env(self) -> dict[str, str]:
        return self.stack.env()

    def key(self, tenant: str, *limits: str) -> str:
        made = subprocess.run([sys.executable, "-m", "launch", "keys", "create",
                               "--tenant", tenant, *limits], env=self.env(),
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        secret = made.stdout.strip()
        assert secret.startswith("sk-") and "\n" not in secret
        self.keys.append(secret)
        return secret


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(content: str, tokens: int, **extra: object) -> dict:
    return {"model": "sim", "max_tokens": tokens,
            "messages": [{"role": "user", "content": f"{MARKER} {content}"}], **extra}


@pytest.fixture(scope="module")
def secured(sim_stack: Stack) -> Iterator[Secured]:
    database_url = new_database(sim_stack.database_url, "secure")
    migrate(database_url)
    stack = Stack(sim_stack.bootstrap, database_url, sim_stack.logs)
    port = free_port()
    services = {
        "projector": start_service(stack, "secure-projector", "projector",
                                   PROJECTOR_GROUP="projector-secure"),
        "worker": start_service(stack, "secure-worker", "worker", "--engine", "sim",
                                "--max-num-seqs", "16", WORKER_SIM_TOKENS_PER_S="20"),
        # The fuzz pass presents thousands of wrong keys from this address: the bound
        # on failed lookups has a test and a gateway of its own.
        "gateway": start_service(stack, "secure-gateway", "gateway", "--port", str(port),
                                 GATEWAY_MODELS="sim", GATEWAY_CANCEL_GRACE_S="2",
                                 GATEWAY_FAILED_KEY_LOOKUPS="1000000"),
    }
    s = Secured(stack, f"http://127.0.0.1:{port}", services)
    try:
        wait_healthy(s.url, list(services.values()), timeout=60)
        yield s
    finally:
        for service in services.values():
            service.stop()


def test_requests_without_a_valid_key_are_refused(secured: Secured) -> None:
    alice = secured.key("alice", "--name", "alice's laptop")
    key_id = alice[3:].split(".")[0]
    # The gateway notices within its cache period that a key exists.
    deadline = time.monotonic() + 10
    while httpx.get(f"{secured.url}/v1/models", timeout=30).status_code != 401:
        assert time.monotonic() < deadline, "the gateway never required the key"
        time.sleep(0.1)
    before = end_offsets(secured.stack.bootstrap, PROMPTS)
    wrong_secret = alice[:-4] + ("AAAA" if not alice.endswith("AAAA") else "BBBB")
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Basic YWxpY2U6eA=="},
                    {"Authorization": "Bearer sk-nothing"}, bearer(wrong_secret),
                    bearer(f"sk-{'0' * 12}.{alice.split('.')[1]}"), {"Authorization": alice}):
        for method, path in (("GET", "/v1/sessions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/models")):
            r = httpx.request(method, f"{secured.url}{path}", headers=headers, timeout=30,
                              json=chat("x", 2) if method == "POST" else None)
            assert r.status_code == 401, (headers, path, r.text)
            error = r.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"
    assert end_offsets(secured.stack.bootstrap, PROMPTS) == before  # nothing was written
    assert httpx.get(f"{secured.url}/health").status_code == 200
    ok = httpx.get(f"{secured.url}/v1/models", headers=bearer(alice), timeout=30)
    assert ok.status_code == 200
    listed = subprocess.run([sys.executable, "-m", "launch", "keys", "list"],
                            env=secured.env(), capture_output=True, text=True, timeout=60)
    assert key_id in listed.stdout and alice.split(".")[1] not in listed.stdout


def test_a_tenant_cannot_touch_another_tenants_conversations(secured: Secured) -> None:
    alice, bob = bearer(secured.key("alice")), bearer(secured.key("bob"))
    url = secured.url
    session = httpx.post(f"{url}/v1/sessions", json={"title": "alice's"}, headers=alice,
                         timeout=30).json()["id"]
    done = stream_chat(url, chat("hello", 3), headers={**alice, "X-Session-Id": session})
    assert done.done, done.error
    running = stream_chat(url, chat("long", 2000, background=True), headers=alice,
                          stop_after=1)
    key = {"Idempotency-Key": "same-key"}
    alices_keyed = httpx.post(f"{url}/v1/chat/completions", json=chat("k", 2),
                              headers={**alice, **key}, timeout=60).json()["id"]

    def answer(method: str, path: str, headers: dict[str, str], **kw: object) -> httpx.Response:
        return httpx.request(method, f"{url}{path}", headers={**bob, **headers}, timeout=30,
                             **kw)  # type: ignore[arg-type]

    def refused(method: str, template: str, real: str, headers: dict[str, str] | None = None,
                **kw: object) -> None:
        """Bob's answer for Alice's id is the answer for an id that does not exist."""
        fake = (str(uuid.uuid4()) if "-" in real[:9] and not real.startswith("chatcmpl")
                else f"chatcmpl-{uuid.uuid4().hex}{'0' * 16}")
        got = answer(method, template.format(real), dict(headers or {}, **{
            k: v.format(real) for k, v in (headers or {}).items()}), **kw)
        none = answer(method, template.format(fake), dict(headers or {}, **{
            k: v.format(fake) for k, v in (headers or {}).items()}), **kw)
        assert got.status_code == 404, (method, template, got.status_code, got.text)
        assert got.text.replace(real, "ID") == none.text.replace(fake, "ID")
        assert MARKER not in got.text

    refused("GET", "/v1/sessions/{}", session)
    refused("GET", "/v1/sessions/{}/messages", session)
    refused("POST", "/v1/sessions/{}/messages", session, json={"content": "mine now"})
    refused("POST", "/v1/chat/completions", session, headers={"X-Session-Id": "{}"},
            json=chat("x", 2))
    refused("GET", "/v1/chat/completions/{}", done.request_id)
    refused("GET", "/v1/chat/completions/{}/stream", done.request_id)
    refused("GET", "/v1/chat/completions/{}/stream", done.request_id,
            headers={"Last-Event-ID": done.ids[0]})
    refused("POST", "/v1/chat/completions/{}/cancel", running.request_id)
    refused("DELETE", "/v1/sessions/{}", session)
    listed = httpx.get(f"{url}/v1/sessions", params={"limit": 100}, headers=bob, timeout=30)
    assert listed.status_code == 200 and session not in listed.text
    bobs_keyed = httpx.post(f"{url}/v1/chat/completions", json=chat("k", 2),
                            headers={**bob, **key}, timeout=60).json()["id"]
    assert bobs_keyed != alices_keyed  # the same key names a different turn per tenant

    # Alice still has everything, and her turn was not cancelled by Bob.
    history = httpx.get(f"{url}/v1/sessions/{session}/messages", headers=alice, timeout=30)
    assert [m["role"] for m in history.json()["data"]] == ["user", "assistant"]
    status = httpx.get(f"{url}/v1/chat/completions/{running.request_id}", headers=alice,
                       timeout=30).json()["status"]
    assert status == "running"
    again = resume_chat(url, done.request_id, done.ids[0], headers=alice)
    assert again.done and again.error is None
    assert httpx.post(f"{url}/v1/chat/completions/{running.request_id}/cancel", headers=alice,
                      timeout=30).json()["cancelling"] is True


def test_a_revoked_key_is_refused(secured: Secured) -> None:
    carol = secured.key("carol")
    assert httpx.get(f"{secured.url}/v1/sessions", headers=bearer(carol),
                     timeout=30).status_code == 200
    key_id = carol[3:].split(".")[0]
    revoked = subprocess.run([sys.executable, "-m", "launch", "keys", "revoke", key_id],
                             env=secured.env(), capture_output=True, text=True, timeout=60)
    assert revoked.returncode == 0, revoked.stderr
    deadline = time.monotonic() + 10
    while (r := httpx.get(f"{secured.url}/v1/sessions", headers=bearer(carol),
                          timeout=30)).status_code != 401:
        assert time.monotonic() < deadline, "the revoked key still works"
        time.sleep(0.2)
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_keys_made_up_at_random_are_refused_without_a_lookup_past_a_bound(
        secured: Secured) -> None:
    """Each well-formed key cost the store a query, without a limit before
    authentication. A key that failed is remembered, and an address that failed 20
    lookups in 10 s gets 429 for the rest of the window, before any query, whatever key
    it presents; a key known good still passes."""
    erin = secured.key("erin")
    port = free_port()
    gateway = start_service(secured.stack, "secure-gateway-made-up-keys", "gateway",
                            "--port", str(port), GATEWAY_MODELS="sim")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [gateway], timeout=60)

        def made_up() -> str:
            return f"sk-{uuid.uuid4().hex[:12]}.{uuid.uuid4().hex}{uuid.uuid4().hex}"

        def spoofed(key: str) -> dict[str, str]:
            # Not a trusted proxy: what it says of its address counts for nothing.
            return {**bearer(key), "X-Forwarded-For": f"203.0.113.{uuid.uuid4().int % 250}"}

        first = made_up()
        codes = [httpx.get(f"{url}/v1/models", headers=spoofed(key), timeout=30)
                 for key in [first] + [made_up() for _ in range(18)]]
        # Looked up (19 failures so far), so remembered good for the next 2 s.
        assert httpx.get(f"{url}/v1/models", headers=bearer(erin), timeout=30).status_code == 200
        codes.append(httpx.get(f"{url}/v1/models", headers=bearer(made_up()), timeout=30))
        assert [r.status_code for r in codes] == [401] * 20, [r.text for r in codes]
        again = httpx.get(f"{url}/v1/models", headers=bearer(first), timeout=30)
        assert again.status_code == 401  # remembered as failed: no lookup, no count
        started = time.monotonic()
        refused = httpx.get(f"{url}/v1/models", headers=bearer(made_up()), timeout=30)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "too_many_failed_keys"
        assert 1 <= int(refused.headers["retry-after"]) <= 10
        assert time.monotonic() - started < 1
        known = httpx.get(f"{url}/v1/models", headers=bearer(erin), timeout=30)
        assert known.status_code == 200  # cached good: the bound is on unknown keys
        time.sleep(2.2)  # past the cache: a key once valid is looked up, never locked out
        looked_up = httpx.get(f"{url}/v1/models", headers=bearer(erin), timeout=30)
        assert looked_up.status_code == 200, looked_up.text
        still = httpx.get(f"{url}/v1/models", headers=spoofed(made_up()), timeout=30)
        assert still.status_code == 429, still.text  # the address is still locked out
        time.sleep(int(refused.headers["retry-after"]) + 0.5)
        later = httpx.get(f"{url}/v1/models", headers=bearer(made_up()), timeout=30)
        assert later.status_code == 401, later.text  # a new window
    finally:
        gateway.stop()


def test_behind_a_trusted_proxy_wrong_keys_lock_out_their_client_alone(
        secured: Secured) -> None:
    """Behind an ingress every request came from the ingress's address: one client's
    made-up keys locked out every user. A proxy in GATEWAY_TRUSTED_PROXIES names the
    client (Forwarded, or X-Forwarded-For), and the lockout holds for that client."""
    port = free_port()
    gateway = start_service(secured.stack, "secure-gateway-proxied", "gateway",
                            "--port", str(port), GATEWAY_MODELS="sim",
                            GATEWAY_TRUSTED_PROXIES="127.0.0.1,10.0.0.0/8")
    url = f"http://127.0.0.1:{port}"

    def made_up() -> dict[str, str]:
        return bearer(f"sk-{uuid.uuid4().hex[:12]}.{uuid.uuid4().hex}{uuid.uuid4().hex}")

    def models(**via: str) -> int:
        headers = {**made_up(), **{k.replace("_", "-"): v for k, v in via.items()}}
        return httpx.get(f"{url}/v1/models", headers=headers, timeout=30).status_code

    try:
        wait_healthy(url, [gateway], timeout=60)
        # One client, through two proxy hops and both headers' forms.
        codes = [models(X_Forwarded_For="203.0.113.5, 10.1.2.3") for _ in range(10)]
        codes += [models(Forwarded='for="203.0.113.5:4711";proto=https, for=10.1.2.3')
                  for _ in range(10)]
        assert codes == [401] * 20
        assert models(X_Forwarded_For="203.0.113.5") == 429
        # Another client behind the same proxy is not locked out.
        assert models(X_Forwarded_For="203.0.113.6") == 401
        assert models(Forwarded='for="[2001:db8::6]"') == 401
        # A hop the client wrote itself, left of the one the proxy added, changes nothing.
        assert models(X_Forwarded_For="198.51.100.1, 203.0.113.5") == 429
    finally:
        gateway.stop()


def test_slow_and_piled_up_connections_are_closed_and_others_are_served(
        secured: Secured) -> None:
    """Connections that never finish their headers, bodies sent a byte a second, more
    connections from one address than its cap, and requests that are not HTTP: each gets
    its 408, 429 or 400 (JSON) in time,
    a client with a key is served meanwhile, and clients that leave mid-request or
    mid-stream leave no traceback in the log."""
    port = free_port()
    gateway = start_service(secured.stack, "secure-gateway-connections", "gateway",
                            "--port", str(port), GATEWAY_MODELS="sim",
                            GATEWAY_HEADER_TIMEOUT_S="2", GATEWAY_BODY_TIMEOUT_S="3",
                            GATEWAY_MAX_CONNECTIONS_PER_ADDRESS="100")
    url = f"http://127.0.0.1:{port}"
    key = bearer(secured.key("connections"))
    socks: list[socket.socket] = []

    def opened(head: bytes) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        socks.append(sock)
        sock.sendall(head)
        return sock

    def answer(sock: socket.socket) -> tuple[int, dict]:
        data = b""
        while b"\r\n\r\n" not in data or not data.endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(body)

    try:
        wait_healthy(url, [gateway], timeout=60)
        began = time.monotonic()
        slow_heads = [opened(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n")
                      for _ in range(40)]
        slow_bodies = [opened(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                              b"Content-Type: application/json\r\nContent-Length: 1000\r\n"
                              b"Authorization: " + key["Authorization"].encode()
                              + b"\r\n\r\n{") for _ in range(20)]
        piled = [opened(b"") for _ in range(100 - 60)]  # the address's cap: 100
        refused = opened(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        status, error = answer(refused)
        assert (status, error["error"]["code"]) == (429, "too_many_connections"), error
        assert "GATEWAY_MAX_CONNECTIONS_PER_ADDRESS" in error["error"]["message"]
        for sock in piled:
            sock.close()
        # A client with a key is served while the slow ones are held.
        served = stream_chat(url, chat("beside slow clients", 4), headers=key)
        assert (served.status, served.finish_reason) == (200, "length"), served
        for sock in slow_bodies[:5]:
            sock.sendall(b" ")
        statuses = [answer(sock) for sock in slow_heads + slow_bodies]
        assert {(s, e["error"]["code"]) for s, e in statuses} == {(408, "request_timeout")}
        # Requests uvicorn cannot parse: a 400 in JSON too, said once a minute.
        malformed = [opened(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"
                            b"X-Session-Id: \x7f\r\n\r\n"),
                     opened(b"GET /v1/mo dels HTTP/1.1\r\n\r\n"),
                     opened(b"\x00\x01\x02\r\n\r\n")]
        statuses = [answer(sock) for sock in malformed]
        assert {(s, e["error"]["code"]) for s, e in statuses} == {(400, "invalid_http")}
        assert time.monotonic() - began < 15, "the slow clients were held too long"
        # Clients that leave: in the middle of a body, and in the middle of a stream.
        cut = opened(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n"
                     b"Authorization: " + key["Authorization"].encode() + b"\r\n\r\n{")
        time.sleep(0.5)
        cut.close()
        left = stream_chat(url, chat("left mid-stream", 200), headers=key, stop_after=2)
        assert left.status == 200 and left.text
        time.sleep(1.0)
        metrics = scrape(f"{url}/metrics")
        refusals = {reason: metrics.get(f'gateway_connections_refused_total{{reason="{reason}"}}')
                    for reason in ("header_timeout", "body_timeout", "per_address",
                                   "malformed")}
        assert refusals == {"header_timeout": 40, "body_timeout": 20, "per_address": 1,
                            "malformed": 3}
        log = gateway.tail(200_000)
        assert "Traceback" not in log and "ClientDisconnect" not in log, log[-3000:]
        assert log.count("said once a minute") <= 4, log[-3000:]
        assert "Invalid HTTP request received" not in log, log[-3000:]
    finally:
        for sock in socks:
            sock.close()
        gateway.stop()


@pytest.mark.parametrize(("peer", "headers", "client"), [
    ("10.0.0.9", [(b"x-forwarded-for", b"203.0.113.5")], "203.0.113.5"),
    ("192.0.2.1", [(b"x-forwarded-for", b"203.0.113.5")], "192.0.2.1"),  # not trusted
    ("10.0.0.9", [(b"x-forwarded-for", b"1.1.1.1, 203.0.113.5, 10.0.0.8")], "203.0.113.5"),
    ("10.0.0.9", [(b"forwarded", b'for="[2001:db8::1]:80", for=10.0.0.8')], "2001:db8::1"),
    ("10.0.0.9", [(b"forwarded", b"for=_hidden")], "10.0.0.9"),  # obfuscated: the peer
    ("10.0.0.9", [(b"x-forwarded-for", b"not an address")], "10.0.0.9"),
    ("10.0.0.9", [(b"x-forwarded-for", b"10.0.0.7")], "10.0.0.9"),  # only proxies named
    ("10.0.0.9", [], "10.0.0.9"),
])
def test_the_client_address_is_the_nearest_hop_no_trusted_proxy_wrote(
        peer: str, headers: list[tuple[bytes, bytes]], client: str) -> None:
    assert forwarded_client(peer, headers, networks(["10.0.0.0/8"])) == client


def test_revoking_a_key_stops_its_running_turns_and_their_streams(secured: Secured) -> None:
    """A revoked key was refused from then on, but its background turns ran on to their
    end and its open streams kept streaming. Revoking it now cancels its turns that
    have not ended (``pipeline keys revoke``), and their streams end with them."""
    ivan_key = secured.key("ivan")
    ivan = bearer(ivan_key)
    with httpx.stream("POST", f"{secured.url}/v1/chat/completions", headers=ivan, timeout=60,
                      json=chat("background", 2000, stream=True, background=True)) as resp:
        assert resp.status_code == 200
        background = resp.headers["x-request-id"]
    ended = threading.Event()
    streamed: list[str] = []

    def follow() -> None:
        with httpx.stream("POST", f"{secured.url}/v1/chat/completions", headers=ivan,
                          timeout=120, json=chat("followed", 2000, stream=True)) as resp:
            streamed.append(resp.headers["x-request-id"])
            for _ in resp.iter_lines():
                pass
        ended.set()

    threading.Thread(target=follow, daemon=True).start()

    def statuses() -> list[str]:
        with psycopg.connect(secured.stack.database_url) as conn:
            return [r[0] for r in conn.execute(
                "SELECT status FROM generations WHERE request_id = ANY(%s)",
                ([background, *streamed],)).fetchall()]

    deadline = time.monotonic() + 30
    while len(streamed) != 1 or statuses() != ["running", "running"]:
        assert time.monotonic() < deadline, statuses()
        time.sleep(0.2)
    revoked = subprocess.run([sys.executable, "-m", "launch", "keys", "revoke",
                              ivan_key[3:].split(".")[0]], env=secured.env(),
                             capture_output=True, text=True, timeout=60)
    assert revoked.returncode == 0, revoked.stderr
    assert "stopped 2 of its turns" in revoked.stdout, revoked.stdout
    assert ended.wait(15), "the stream went on after its key was revoked"
    deadline = time.monotonic() + 15
    while any(s in ("pending", "running") for s in statuses()):
        assert time.monotonic() < deadline, statuses()
        time.sleep(0.2)


def test_rate_limits_answer_429_with_openai_headers(secured: Secured) -> None:
    dave = bearer(secured.key("dave", "--rpm", "3"))
    answers = [httpx.get(f"{secured.url}/v1/models", headers=dave, timeout=30)
               for _ in range(4)]
    assert [r.status_code for r in answers] == [200, 200, 200, 429]
    assert [r.headers["x-ratelimit-limit-requests"] for r in answers] == ["3"] * 4
    assert [r.headers["x-ratelimit-remaining-requests"] for r in answers] == ["2", "1", "0", "0"]
    limited = answers[-1]
    assert 1 <= int(limited.headers["retry-after"]) <= 20  # a request back every 20 s
    assert limited.headers["x-ratelimit-reset-requests"].endswith("s")
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"

    erin = bearer(secured.key("erin", "--tpm", "700"))
    first = httpx.post(f"{secured.url}/v1/chat/completions", json=chat("a", 500), headers=erin,
                       timeout=60)
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-tokens"] == "700"
    second = httpx.post(f"{secured.url}/v1/chat/completions", json=chat("b", 500),
                        headers=erin, timeout=60)
    assert second.status_code == 429 and "tokens per minute" in second.json()["error"]["message"]
    assert int(second.headers["retry-after"]) >= 1
    too_big = httpx.post(f"{secured.url}/v1/chat/completions", json=chat("c", 5000),
                         headers=bearer(secured.key("frank", "--tpm", "700")), timeout=60)
    assert too_big.status_code == 429 and "more than this key's limit" in too_big.text


def test_a_flood_of_refused_requests_costs_the_store_nothing_and_slows_no_one(
        secured: Secured) -> None:
    """300 clients at once on a key allowed 3 requests a minute, for 8 s: every one is
    answered (200 or 429), nearly all refused without a store query, and another
    tenant's limited key, charged at the store each request, is served meanwhile as
    fast as alone. (Each refusal took one of the gateway's 10 PostgreSQL connections,
    row-locked on one bucket: the other tenant waited 4 to 6 s.)"""
    flooder = bearer(secured.key("flooder", "--rpm", "3"))
    other = bearer(secured.key("bystander", "--rpm", "1000000"))
    before = scrape(f"{secured.url}/metrics")

    def timed() -> float:
        began = time.monotonic()
        answer = httpx.get(f"{secured.url}/v1/models", headers=other, timeout=30)
        assert answer.status_code == 200, answer.text
        return time.monotonic() - began

    alone = [timed() for _ in range(20)]

    async def flood(stop: float) -> tuple[list[int], list[str]]:
        statuses: list[int] = []
        failed: list[str] = []  # requests the gateway never answered
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(
                max_connections=300, max_keepalive_connections=300)) as client:
            async def one() -> None:
                while time.monotonic() < stop:
                    try:
                        answer = await client.get(f"{secured.url}/v1/models", headers=flooder)
                    except httpx.TransportError as exc:
                        failed.append(repr(exc))
                        continue
                    statuses.append(answer.status_code)
            await asyncio.gather(*(one() for _ in range(300)))
        return statuses, failed

    stop = time.monotonic() + 8
    with ThreadPoolExecutor(1) as pool:
        flooding = pool.submit(asyncio.run, flood(stop))
        time.sleep(1)
        beside = [timed() for _ in range(20)]
        statuses, failed = flooding.result()
    assert not failed, (len(failed), failed[:5])
    assert set(statuses) == {200, 429} and statuses.count(200) == 3, set(statuses)
    after = scrape(f"{secured.url}/metrics")

    def grew(by: str) -> float:
        name = f'gateway_rate_limit_refusals_total{{by="{by}"}}'
        return after.get(name, 0.0) - before.get(name, 0.0)

    # The store is asked again about a refused key once a second (FRESH_S) at most.
    assert grew("here") >= len(statuses) - 12 and grew("store") <= 10, (grew("here"),
                                                                          grew("store"))
    print({"alone_s": statistics.median(alone), "beside_s": statistics.median(beside),
           "requests": len(statuses)})
    assert statistics.median(beside) < max(3 * statistics.median(alone), 0.25), (alone, beside)


def test_a_kept_alive_connection_left_idle_is_not_closed_under_its_client(
        secured: Secured) -> None:
    """A connection left idle 6 s, longer than uvicorn's own keep-alive (5 s), still
    answers the next request: the gateway keeps idle connections GATEWAY_KEEP_ALIVE_S
    (75 s), longer than clients and proxies keep theirs, so it never closes one as its
    client sends on it (a flood's client, slow to reuse its connections, got resets)."""
    host, port = secured.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        assert first.status == 200 and conn.sock is not None
        kept = conn.sock
        time.sleep(6)
        conn.request("GET", "/health")  # on the same connection, or failing on its close
        again = conn.getresponse()
        again.read()
        assert again.status == 200 and conn.sock is kept
    finally:
        conn.close()


def test_a_turn_is_charged_what_it_used_once_it_ends(secured: Secured) -> None:
    """A turn is charged its prompt and max_tokens when accepted, or a default of 512
    without max_tokens, which it may pass (up to the context length) or fall short of.
    When it ends, the projector trues the key's bucket up to its real usage, once: here
    a turn without max_tokens used 64 of the 512 it was charged, and the next turn,
    which the leftover of a 600-token minute could not take before, is accepted."""
    grace = bearer(secured.key("grace", "--tpm", "600"))
    body = {"model": "sim", "messages": [{"role": "user", "content": f"{MARKER} no limit"}]}
    first = httpx.post(f"{secured.url}/v1/chat/completions", json=body, headers=grace,
                       timeout=60)
    assert first.status_code == 200, first.text
    request_id = first.headers["x-request-id"]
    used = first.json()["usage"]["total_tokens"]
    assert used < 200  # the simulated engine's default reply is 64 tokens
    with psycopg.connect(secured.stack.database_url) as conn:
        deadline = time.monotonic() + 30
        while (row := conn.execute(
                "SELECT charge_key, charge_tokens, finished_at FROM generations"
                " WHERE request_id = %s", (request_id,)).fetchone()) is None or row[1] is not None:
            assert time.monotonic() < deadline, f"never trued up: {row}"
            time.sleep(0.2)
            conn.commit()
    assert row[0] == grace["Authorization"].split()[1][3:].split(".")[0]
    # 600 - 515 + a few seconds' refill could not take ~455; 600 - 70 can.
    with httpx.stream("POST", f"{secured.url}/v1/chat/completions",
                      json=chat("then", 450, stream=True), headers=grace, timeout=60) as second:
        assert second.status_code == 200, second.read()
        request_id = second.headers["x-request-id"]
    httpx.post(f"{secured.url}/v1/chat/completions/{request_id}/cancel", headers=grace,
               timeout=30)


def test_fuzzed_headers_and_tokens_find_no_server_error(secured: Secured, tmp_path: Path) -> None:
    rng = random.Random(7)
    alice = secured.key("alice")
    alphabet = [chr(c) for c in range(0x20, 0x7F)] + [chr(c) for c in range(0xA0, 0x100)]

    def noise(n: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(n))

    values = [lambda: noise(rng.randint(0, 300)), lambda: "Bearer " + noise(rng.randint(0, 80)),
              lambda: f"Bearer sk-{noise(12)}.{noise(43)}",
              lambda: f"Bearer sk-{rng.randbytes(6).hex()}.{noise(43)}",
              lambda: "Bearer " + alice[: rng.randint(0, len(alice))],
              lambda: "bEaReR " + alice + noise(rng.randint(0, 3))]
    paths = [("GET", "/v1/sessions"), ("GET", f"/v1/sessions/{uuid.uuid4()}"),
             ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
             ("GET", f"/v1/chat/completions/chatcmpl-{uuid.uuid4().hex}{'0' * 16}/stream")]
    statuses = set()
    with httpx.Client(timeout=30) as client:
        for _ in range(300):
            method, path = rng.choice(paths)
            # (HTTP clients refuse header values with surrounding whitespace.)
            headers = {"Authorization": rng.choice(values)().strip().encode("latin-1")}
            if rng.random() < 0.3:
                headers["Last-Event-ID"] = noise(rng.randint(0, 30)).strip().encode("latin-1")
            r = client.request(method, f"{secured.url}{path}", headers=headers,
                               json=chat("fuzz", 1) if method == "POST" else None)
            statuses.add(r.status_code)
            assert r.status_code < 500, (method, path, headers, r.text)
    assert 401 in statuses
    st = os.path.join(os.path.dirname(sys.executable), "st")
    run = subprocess.run(  # the whole API, authenticated as a tenant
        [st, "run", f"{secured.url}/openapi.json", "--checks", "not_a_server_error",
         "--max-examples", "15", "--workers", "1", "--seed", "3",  # see test_gateway
         "--header", f"Authorization: Bearer {alice}"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_metrics_can_live_on_an_address_of_their_own(secured: Secured) -> None:
    port, metrics_port = free_port(), free_port()
    gateway = start_service(secured.stack, "secure-gateway-metrics", "gateway", "--port",
                            str(port), "--metrics-port", str(metrics_port), GATEWAY_MODELS="sim")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [gateway], timeout=60)
        assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 404
        scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert scraped.status_code == 200 and "gateway_backlog" in scraped.text
    finally:
        gateway.stop()


def test_logs_hold_no_key_and_no_prompt(secured: Secured) -> None:
    """Runs last in this module: every log written so far, by every process of the run."""
    assert secured.keys
    for log in secured.stack.logs.iterdir():
        text = log.read_text(errors="replace")
        assert MARKER not in text, f"prompt text in {log.name}"
        for key in secured.keys:
            assert key.split(".")[1] not in text, f"a key in {log.name}"
