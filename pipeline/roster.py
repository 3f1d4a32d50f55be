"""Which workers are alive, and the model each serves: every worker writes a heartbeat to
``chat.workers`` (compacted, keyed by worker) every ``HEARTBEAT_S`` and a tombstone when
it stops; a gateway reads the topic from ``EXPIRY_S`` ago on and counts a worker alive
while its heartbeats keep coming.

This replaces asking the group coordinator for the workers group's members: librdkafka's
coordinator-bound Admin requests (DescribeConsumerGroups and kin) abort the process
(``rd_kafka_enq_once_del_source_return: Assertion 'eonce->refcnt > 0'``) when the
connection to the coordinator drops mid-request, a known bug (librdkafka #4605, fix
proposed in #5397) that a broker restart set off in the gateway. No Admin API call is
made on a request's path or in a loop any more.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from pipeline.kafka import ProduceError
from pipeline.kafka.clock import BrokerClock
from pipeline.kafka.plain import PlainReader, PlainWriter
from pipeline.retry import QuietLog
from pipeline.topics import WORKERS

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0
EXPIRY_S = 10.0  # a worker not heard from for this long is taken for gone
# A model served within this long is known: a request for it while no worker serves it
# is refused for now (503), not as a model that does not exist (404).
KNOWN_S = 3600.0
# A heartbeat names at most this many tenants, the busiest: a tenant's cap is for tenants
# with much waiting or running, and a heartbeat stays small.
MAX_TENANTS = 500


class Heartbeat:
    """A worker's side: ``beat()`` every ``HEARTBEAT_S``, ``leave()`` when stopping. A
    heartbeat also tells the model's context length and the most bytes of text one of its
    tokens stands for, when the engine knows them (``Roster.limits``), and the tenants
    with turns waiting or running there, what ``load()`` says (``Roster.tenant_load``)."""

    def __init__(self, bootstrap: str, worker: str, model: str,
                 context: int | None = None, token_bytes: int | None = None,
                 load: Callable[[], dict[str, tuple[int, int]]] | None = None,
                 clock: BrokerClock | None = None) -> None:
        self.worker = worker
        self.model = model
        self._limits = {"context": context, "token_bytes": token_bytes}
        self._load = load
        self._last = 0.0
        self._quiet = QuietLog(log)
        self._writer = PlainWriter(bootstrap, "heartbeat", durable=False, linger_ms=0,
                                   timeout_s=EXPIRY_S, clock=clock)

    def beat(self) -> None:
        """Write a heartbeat if one is due; never blocks (a lost one is harmless)."""
        now = time.monotonic()
        if now - self._last >= HEARTBEAT_S:
            self._last = now
            load = self._load() if self._load is not None else {}
            busiest = sorted(load.items(), key=lambda kv: -sum(kv[1]))[:MAX_TENANTS]
            self._send(json.dumps({"model": self.model, "at": time.time(), **self._limits,
                                   "tenants": dict(busiest)}).encode())
        self._writer.poll()
        for failure in self._writer.take_failures():
            self._quiet.warning("heartbeat not delivered: %s", failure)

    def leave(self) -> None:
        self._send(None)
        self._writer.flush(5)

    def _send(self, value: bytes | None) -> None:
        try:
            self._writer.send(WORKERS, self.worker.encode(), value)
        except ProduceError as exc:
            self._quiet.warning("heartbeat not sent: %s", exc)


def heartbeat_of(value: bytes) -> tuple[dict[str, object], str, float] | None:
    """A heartbeat record's fields, its model and when it was sent; None if it is not one
    (whatever its bytes: a record on the topic is anyone's)."""
    try:
        beat = json.loads(value)
        return beat, str(beat["model"]), float(beat["at"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return None


def _sizes(beat: dict[str, object]) -> tuple[int, int] | None:
    context, token_bytes = beat.get("context"), beat.get("token_bytes")
    if type(context) is int and type(token_bytes) is int and context > 0 and token_bytes > 0:
        return context, token_bytes
    return None


def _loads(beat: dict[str, object]) -> dict[str, tuple[int, int]]:
    tenants = beat.get("tenants")
    if not isinstance(tenants, dict):
        return {}
    return {str(t): (pair[0], pair[1]) for t, pair in list(tenants.items())[:MAX_TENANTS]
            if isinstance(pair, list) and len(pair) == 2
            and all(type(n) is int and n >= 0 for n in pair)}


class Roster:
    """A gateway's side: the models live workers serve, from the heartbeats read so far,
    and the models served within ``KNOWN_S`` (``known``). ``refresh()`` reads what
    arrived (call it from one thread)."""

    def __init__(self, bootstrap: str) -> None:
        self._reader = PlainReader(bootstrap, "roster", committed_only=False)
        self._assigned = False
        self._live_from: dict[int, int] = {}  # partition -> the offset heartbeats are live from
        self._seen: dict[str, tuple[str, float]] = {}  # worker -> (model, last heard)
        self._known: dict[str, float] = {}  # model -> last heard (wall clock)
        # worker -> (context, token bytes), as its latest heartbeat said
        self._sizes: dict[str, tuple[int, int]] = {}
        # worker -> tenant -> (waiting, running), as its latest heartbeat said
        self._loads: dict[str, dict[str, tuple[int, int]]] = {}

    @property
    def known(self) -> set[str]:
        horizon = time.time() - KNOWN_S
        return {m for m, at in self._known.items() if at >= horizon}

    def _assign(self, timeout: float) -> None:
        self._reader.start_at_time(WORKERS, int((time.time() - KNOWN_S) * 1000), timeout)
        # A heartbeat from these offsets on is read as it comes, so heard when read,
        # whatever any clock says; one before, read at the start, counts from when the
        # log had it, by this host's clock.
        self._live_from = self._reader.ends(WORKERS, self._reader.partitions(WORKERS, timeout),
                                            timeout)
        self._assigned = True

    def refresh(self, timeout: float = 5.0) -> set[str]:
        if not self._assigned:
            self._assign(timeout)
        for record in self._reader.read(1000):
            worker = (record.key or b"").decode(errors="replace")
            value = record.value
            if value is None:
                self._seen.pop(worker, None)
                self._loads.pop(worker, None)
                continue
            read = heartbeat_of(value)
            if read is None:
                continue
            beat, model, sent = read
            # When the log had it (chat.workers is stamped by its broker), not when the
            # worker's clock says it sent it: a worker 10 s behind read as gone.
            at = record.timestamp_ms / 1000 if record.timestamp_ms > 0 else sent
            self._loads[worker] = _loads(beat)
            sizes = _sizes(beat)
            if sizes is None:
                self._sizes.pop(worker, None)
            else:
                self._sizes[worker] = sizes
            self._known[model] = max(self._known.get(model, 0.0), at)
            # Alive while its heartbeats keep coming: an old one read at start-up counts
            # from when the log had it.
            caught_up = record.position.offset >= self._live_from.get(record.position.partition, 0)
            heard = time.monotonic() - (0.0 if caught_up else max(time.time() - at, 0.0))
            self._seen[worker] = (model, heard)
        now = time.monotonic()
        self._seen = {w: (m, at) for w, (m, at) in self._seen.items() if now - at < EXPIRY_S}
        self._loads = {w: load for w, load in self._loads.items() if w in self._seen}
        return {m for m, _ in self._seen.values()}

    def limits(self, model: str) -> tuple[int, int] | None:
        """The largest context and token the live workers of ``model`` said they have
        (None: none said both)."""
        said = [sizes for w, (m, _) in list(self._seen.items())
                if m == model and (sizes := self._sizes.get(w)) is not None]
        if not said:
            return None
        return max(c for c, _ in said), max(b for _, b in said)

    def tenant_load(self, model: str, tenant: str) -> tuple[int, int]:
        """``tenant``'s turns waiting and running on the live workers of ``model``."""
        waiting = running = 0
        for worker, (served, _) in list(self._seen.items()):
            if served == model:
                w, r = self._loads.get(worker, {}).get(tenant, (0, 0))
                waiting, running = waiting + w, running + r
        return waiting, running

    def close(self) -> None:
        self._reader.close()
