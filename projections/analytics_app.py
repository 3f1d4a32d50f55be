"""The faust-streaming application behind ``pipeline analytics`` (the tables and their
exactness: ``projections.analytics``).

Faust runs in at-least-once mode (its exactly-once mode has open duplicate and crash
bugs), reading committed records only: a worker's aborted transactions (a turn taken
over, a stuck producer replaced) are never counted. Faust turns ``read_committed`` on
only with exactly-once, so the consumer it makes is told here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
import threading
from typing import Any

import faust
from faust.transport.drivers import aiokafka as faust_aiokafka
from prometheus_client import CollectorRegistry

from pipeline import topicconfig
from pipeline.codec import DecodeError, Position, parse
from pipeline.deadletter import dead_letter
from pipeline.kafka import EventProducer, KafkaException, Record, wait_for_broker
from pipeline.kafka.config import ENV, ClientConfigError, client_properties
from pipeline.topics import TopicPolicy
from projections.analytics import AnalyticsMetrics, AnalyticsStore
from projections.settings import AnalyticsSettings
from schemas import Event

log = logging.getLogger(__name__)
CONSUMER_NAME = "analytics"


class _CommittedConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # aiokafka reads this when it starts its fetcher, after construction.
        consumer._isolation_level = "read_committed"
        return consumer


class _CommittedConsumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
        return _CommittedConsumerThread(self, loop=self.loop, beacon=self.beacon)


class _Transport(faust_aiokafka.Transport):
    Consumer = _CommittedConsumer


class _App(faust.App):
    def _new_transport(self) -> Any:
        return _Transport(self.conf.broker_consumer, self)


def broker_credentials(props: dict[str, str]) -> Any:
    """The operator's librdkafka client properties (``PIPELINE_KAFKA_CONFIG``) as faust's
    credentials for aiokafka: TLS (with a client certificate for mutual TLS), SASL PLAIN
    and SCRAM. None for plaintext. OAUTHBEARER and GSSAPI are refused: aiokafka takes
    them only with code (a token provider, Kerberos) the file cannot carry."""
    protocol = props.get("security.protocol", "PLAINTEXT").upper()
    if protocol == "PLAINTEXT":
        return None
    context = None
    if protocol in ("SSL", "SASL_SSL"):
        ca = props.get("ssl.ca.location")
        context = ssl.create_default_context(cafile=None if ca in (None, "probe") else ca)
        if "ssl.certificate.location" in props:
            context.load_cert_chain(props["ssl.certificate.location"],
                                    props.get("ssl.key.location"),
                                    props.get("ssl.key.password"))
        if props.get("ssl.endpoint.identification.algorithm", "https").lower() == "none":
            context.check_hostname = False
    if protocol == "SSL":
        return faust.SSLCredentials(context)
    mechanism = (props.get("sasl.mechanism") or props.get("sasl.mechanisms") or "GSSAPI")
    if mechanism.upper() not in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
        raise ClientConfigError(f"{ENV}: sasl.mechanism {mechanism} is not one the analytics "
                                "consumer (faust-streaming on aiokafka) can take from a "
                                "file: use PLAIN or SCRAM for it")
    return faust.SASLCredentials(username=props.get("sasl.username", ""),
                                 password=props.get("sasl.password", ""),
                                 ssl_context=context, mechanism=mechanism.upper())


def build_app(settings: AnalyticsSettings, bootstrap: str, store: AnalyticsStore,
              deadletters: EventProducer) -> faust.App:
    """The application: one agent folding both topics, batch by batch, into ``store``."""
    app = _App(
        settings.group,
        broker=[f"kafka://{host}" for host in bootstrap.split(",")],
        broker_credentials=broker_credentials(client_properties()),
        processing_guarantee="at_least_once",
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=settings.session_timeout_s,
        broker_commit_interval=settings.commit_interval_s,
        broker_heartbeat_interval=max(settings.session_timeout_s / 5, 1.0),
        web_enabled=False,
        topic_disable_leader=True,
        # Nothing is kept on disk: the state is in PostgreSQL.
        datadir=f"/tmp/faust-{settings.group}",
    )
    metrics = store.metrics
    topic = app.topic(*settings.topics, key_serializer="raw", value_serializer="raw")
    within_s = settings.batch_max_ms / 1000

    @app.agent(topic)
    async def fold(stream: faust.StreamT[Any]) -> None:
        assert isinstance(stream, faust.Stream)  # for its take_events
        async for batch in stream.take_events(settings.batch_max_events, within=within_s):
            items: list[tuple[Record, Event]] = []
            lag: dict[Any, int] = {}
            for item in batch:
                message = item.message
                metrics.events.labels(message.topic).inc()
                record = Record(Position(message.topic, message.partition, message.offset),
                                message.key, message.value, int(message.timestamp * 1000))
                lag[message.tp] = message.offset
                try:
                    items.append((record, parse(message.value)))  # content left sealed
                except DecodeError as exc:
                    await park(record, str(exc))
            for record, reason in await store.apply(items):
                await park(record, reason)
            # Acknowledged to faust (so committed) only after this returns.
            metrics.lag_events.set(sum(
                max((app.consumer.highwater(tp) or 0) - offset - 1, 0)
                for tp, offset in lag.items()))

    async def park(record: Record, reason: str) -> None:
        """To the dead-letter topic, durably, before the batch's offsets are committed."""
        metrics.dead_letters.inc()
        await dead_letter(deadletters, record, reason, CONSUMER_NAME)

    async def active_sessions() -> None:
        try:
            await store.refresh_active_sessions()
        except Exception as exc:  # the gauge waits for the next turn of the timer
            log.warning("could not count active sessions: %s", exc)

    app.timer(15.0)(active_sessions)

    return app


# How long a stop may take once signalled, before the process exits without finishing it.
STOP_GRACE_S = 15.0


class _BoundedStop(faust.Worker):
    """faust's worker, whose stop is bounded. One signalled while it joined its group,
    as it starts, was seen to stop no further, still running when SIGKILLed 40 s later;
    past ``STOP_GRACE_S`` after the signal this process exits as a SIGKILL would leave
    it: its folds are in the store, and what it read since its last commit is read
    again by the group's next member (``AnalyticsStore`` counts an event once)."""

    def _schedule_shutdown(self, signal: signal.Signals) -> None:
        if not self._signal_stop_time:
            timer = threading.Timer(STOP_GRACE_S, _exit_unstopped)
            timer.daemon = True
            timer.start()
        super()._schedule_shutdown(signal)


def _exit_unstopped() -> None:
    log.error("analytics did not stop within %.0f s of the signal: exiting", STOP_GRACE_S)
    logging.shutdown()
    os._exit(1)


def run(settings: AnalyticsSettings, bootstrap: str, database_url: str,
        registry: CollectorRegistry, policy: TopicPolicy) -> None:
    """Run until SIGTERM or SIGINT (faust's worker handles both, stopping cleanly).
    ``TopicsRefused`` if a topic it reads does not exist (faust's consumer would have the
    broker make it, with the broker's settings) or the topics would lose records
    (``pipeline.topicconfig``, with this process's ``policy``)."""
    while True:  # faust gives up at once on a broker it cannot reach when starting
        try:
            wait_for_broker(bootstrap, timeout=30)
            break
        except KafkaException as exc:
            log.warning("Kafka does not answer at %s (%s); waiting for it", bootstrap, exc)
    topicconfig.require(bootstrap, settings.topics)
    topicconfig.check(bootstrap, policy)
    store = AnalyticsStore(database_url,
                           AnalyticsMetrics(registry, settings.series_per_label))
    deadletters = EventProducer(bootstrap)
    app = build_app(settings, bootstrap, store, deadletters)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    worker = _BoundedStop(app, loop=loop, loglevel=logging.getLogger().level,
                          override_logging=False, quiet=True)
    # Its terminal spinner wrote cursor codes into the service's log (a JSON line began
    # with one): a service has no terminal.
    worker.spinner = None
    try:
        worker.execute_from_commandline()
    finally:
        deadletters.close()
