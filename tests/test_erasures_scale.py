"""Many erasures: every process reads ``chat.erasures`` whole at its start, and holds what it
read for two erasure windows.

* One that had to read it within its wait (15 s) failed to start once there were some
  3.5 million (a retention job's, or a tenant's). The wait is now for progress: the start
  reads on while records come, and says how far it got.
* One tenant deleting sessions without end made every process's start and memory
  larger: a tenant may delete ``GATEWAY_MAX_ERASURES_PER_TENANT`` sessions per window
  through the API, counted over every gateway from the erasures themselves (an
  operator's ``pipeline erase`` is not counted).

On a broker of its own, since its erasures would slow every other test's start."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from infra.process import free_port
from pipeline import erasures
from pipeline.erasures import Erasures, erasure_record
from pipeline.kafka import ProduceError
from pipeline.kafka.plain import PlainWriter
from pipeline.topics import ERASURES
from projections.migrate import migrate
from tests.conftest import Stack, new_database, own_broker, start_service, wait_healthy

pytestmark = pytest.mark.integration

# Some 1.5-3.5 s to read here, several times the wait below, which is still long enough
# for a pause of the broker's answers on 2 shared cores (0.15 s failed 2 starts in 3).
MANY = 400_000
WAIT_S = 0.5


@pytest.fixture(scope="module")
def bootstrap(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with own_broker(tmp_path_factory, "erasures") as bootstrap:
        yield bootstrap


def test_a_start_behind_many_erasures_reads_them_all(
        bootstrap: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    erased = [uuid.uuid4() for _ in range(MANY)]
    writer = PlainWriter(bootstrap, "erasures-test", linger_ms=50, compression="lz4")
    for conversation in erased:
        while True:
            try:
                writer.send(ERASURES, *erasure_record(conversation, "tenant-a", "test"))
                break
            except ProduceError:  # the client's queue is full: let it send
                writer.poll(0.1)
    assert writer.flush(120) == []

    monkeypatch.setattr(erasures, "PROGRESS_S", 0.05)
    following = Erasures(bootstrap, "erasures-test", horizon_s=3600, wait_s=WAIT_S)
    began = time.monotonic()
    with caplog.at_level(logging.INFO, "pipeline.erasures"):
        following.start()
    try:
        took = time.monotonic() - began
        assert len(following) == MANY
        assert following.revoked(erased[0]) and following.revoked(erased[-1])
        assert not following.revoked(uuid.uuid4())
        assert took > WAIT_S, f"read in {took:.2f} s: the test no longer outlasts its wait"
        assert any("records read, " in r.message for r in caplog.records), caplog.text
    finally:
        following.close()


def test_only_a_tenants_own_deletions_count_toward_its_cap(bootstrap: str) -> None:
    writer = PlainWriter(bootstrap, "erasures-test")
    for tenant, by, times in (("t1", "gateway-a", 3), ("t2", "gateway-b", 1),
                              ("t1", "erase", 5), ("t1", "projector", 2)):
        for _ in range(times):
            writer.send(ERASURES, *erasure_record(uuid.uuid4(), tenant, by))
    assert writer.flush(30) == []
    following = Erasures(bootstrap, "erasures-test", horizon_s=3600)
    following.start()
    try:
        made, frees_in = following.asked("t1")
        assert made == 3 and 0 < frees_in <= 1800 + 60
        assert following.asked("t2")[0] == 1
        assert following.asked("nobody") == (0, 0.0)
    finally:
        following.close()


def test_a_tenant_past_its_erasures_cap_is_told_when_to_retry(
        bootstrap: str, stack: Stack) -> None:
    own = Stack(bootstrap, new_database(stack.database_url, "erasures_cap"), stack.logs)
    migrate(own.database_url)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gateway = start_service(own, "cap-gateway", "gateway", "--port", str(port),
                            GATEWAY_MODELS="sim", GATEWAY_MAX_ERASURES_PER_TENANT="2")
    try:
        wait_healthy(url, [gateway], timeout=90)
        ids = [httpx.post(f"{url}/v1/sessions", json={}, timeout=30).json()["id"]
               for _ in range(3)]
        for session in ids[:2]:
            assert httpx.delete(f"{url}/v1/sessions/{session}", timeout=30).status_code == 200
        refused = httpx.delete(f"{url}/v1/sessions/{ids[2]}", timeout=30)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "tenant_erasures_cap"
        assert "GATEWAY_MAX_ERASURES_PER_TENANT" in refused.json()["error"]["message"]
        assert 0 < int(refused.headers["Retry-After"]) <= 2 * 86_400
        assert httpx.get(f"{url}/v1/sessions/{ids[2]}", timeout=30).status_code == 200
    finally:
        gateway.stop()
