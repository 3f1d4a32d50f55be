"""Administration: reaching the cluster (``check_access``, ``wait_for_broker``),
creating topics and raising their limits, SCRAM users."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from confluent_kafka import (
    KafkaError,
    KafkaException,
)

# NewTopic's documented home is confluent_kafka.admin, which re-exports it from the private
# cimpl module without marking the re-export (strict mypy wants that marked).
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
)

from pipeline.kafka.client import client_config, client_logging, unreachable
from pipeline.kafka.config import AccessRefused, describe_listener
from pipeline.topics import TopicSpec

log = logging.getLogger(__name__)

ACCESS_ERRORS = {KafkaError._AUTHENTICATION, KafkaError._SSL,
                 KafkaError.SASL_AUTHENTICATION_FAILED, KafkaError.ILLEGAL_SASL_STATE,
                 KafkaError.UNSUPPORTED_SASL_MECHANISM,
                 KafkaError.CLUSTER_AUTHORIZATION_FAILED,
                 KafkaError.TOPIC_AUTHORIZATION_FAILED,
                 KafkaError.GROUP_AUTHORIZATION_FAILED}


def _refusal(err: KafkaError) -> bool:
    """An error that says the cluster will not take this client as configured: refused
    credentials or certificates, a TLS alert (no client certificate where one is
    required), or a listener of another protocol."""
    text = err.str()
    return err.code() in ACCESS_ERRORS or (err.code() == KafkaError._TRANSPORT and any(
        sign in text for sign in ("SSL handshake failed", "SSL routines", "security.protocol")))


def check_access(bootstrap: str, timeout: float = 15.0) -> bool:
    """Whether the cluster answers this process's clients, as configured: True once it
    answered, False if no broker answered (not this check's business: services wait for
    the cluster). Raises ``AccessRefused`` if the client properties cannot be used or the
    cluster refused the client (a wrong password, an untrusted certificate): a service
    that would otherwise retry forever stops at once with one line."""
    where = describe_listener(bootstrap)
    errors: list[KafkaError] = []
    try:
        # Its own log lines say what the one line raised says: kept quiet.
        quiet = logging.getLogger("librdkafka.access-check")
        quiet.setLevel(logging.CRITICAL + 1)
        config: dict[str, Any] = {**client_config(bootstrap, "admin"), "logger": quiet,
                                  "log.connection.close": False, "error_cb": errors.append}
        admin = AdminClient(config)
    except KafkaException as exc:
        raise AccessRefused(f"the Kafka client settings for {where} cannot be used: "
                            f"{exc.args[0].str() if exc.args else exc}") from None
    deadline = time.monotonic() + timeout
    while True:
        admin.poll(0)
        refused = [e for e in errors if _refusal(e)]
        if refused:
            reason = refused[0].str().splitlines()[0]
            raise AccessRefused(f"Kafka refused this client at {where}: {reason}")
        if any(e.code() == KafkaError._ALL_BROKERS_DOWN for e in errors):
            return False
        try:
            admin.list_topics(timeout=0.5)
            return True
        except KafkaException:
            if time.monotonic() > deadline:
                return False


def wait_for_broker(bootstrap: str, timeout: float = 60.0) -> None:
    admin = AdminClient({**client_config(bootstrap, "admin"), **client_logging("admin")})
    deadline = time.monotonic() + timeout
    while True:
        try:
            admin.list_topics(timeout=2)
            return
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def set_scram_password(bootstrap: str, user: str, password: str,
                       mechanism: str = "SCRAM-SHA-512") -> None:
    """Creates or changes a SASL/SCRAM user's password (the cluster's credentials)."""
    # Re-exported by confluent_kafka.admin without being marked so (as NewTopic above).
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        ScramCredentialInfo,
        ScramMechanism,
        UserScramCredentialUpsertion,
    )

    admin = AdminClient({**client_config(bootstrap, "admin"), **client_logging("admin")})
    info = ScramCredentialInfo(ScramMechanism[mechanism.replace("-", "_")], 8192)
    upsert = UserScramCredentialUpsertion(user, info, password.encode())
    for future in admin.alter_user_scram_credentials([upsert], request_timeout=30).values():
        future.result()


def delete_topics(bootstrap: str, names: list[str]) -> None:
    admin = AdminClient({**client_config(bootstrap, "admin"), **client_logging("admin")})
    for fut in admin.delete_topics(names, operation_timeout=30).values():
        fut.result()


def broker_count(bootstrap: str, timeout: float = 10.0) -> int:
    admin = AdminClient({**client_config(bootstrap, "admin"), **client_logging("admin")})
    return len(admin.list_topics(timeout=timeout).brokers)


def topic_names(bootstrap: str, timeout: float = 10.0) -> set[str]:
    admin = AdminClient({**client_config(bootstrap, "admin"), **client_logging("admin")})
    return set(admin.list_topics(timeout=timeout).topics)


def topic_limits(bootstrap: str, topics: Sequence[str], default: int,
                 timeout: float = 10.0) -> dict[str, int]:
    """Each topic's largest record (its ``max.message.bytes`` as the cluster has it): what
    a producer may send there. ``default`` for a topic the cluster does not say (a
    DescribeConfigs refused, say)."""
    admin = AdminClient({**client_config(bootstrap, "admin"), **client_logging("admin")})
    out = dict.fromkeys(topics, default)
    futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, t)
                                      for t in topics], request_timeout=timeout)
    for resource, future in futures.items():
        try:
            entry = future.result().get("max.message.bytes")
        except (KafkaException, ValueError) as exc:
            log.warning("could not read %s's record limit (taking %d bytes): %s",
                        resource.name, default, exc)
            continue
        if entry is not None and entry.value is not None:
            out[resource.name] = int(entry.value)
    return out


def topic_configs(bootstrap: str, topics: Sequence[str],
                  timeout: float = 10.0) -> dict[str, dict[str, str]]:
    """Each topic's settings as the cluster has them (its own, else the broker's
    defaults). A topic the cluster does not describe (refused, or missing) is left out,
    and said; a cluster that does not answer raises ``KafkaException``."""
    admin = AdminClient({**client_config(bootstrap, "admin"), **client_logging("admin")})
    out: dict[str, dict[str, str]] = {}
    futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, t)
                                      for t in topics], request_timeout=timeout)
    for resource, future in futures.items():
        try:
            entries = future.result()
        except KafkaException as exc:
            if unreachable(exc):
                raise
            log.warning("could not read the settings of %s: %s", resource.name, exc)
            continue
        out[resource.name] = {name: entry.value for name, entry in entries.items()
                              if entry.value is not None}
    return out


def broker_setting(bootstrap: str, name: str, timeout: float = 10.0) -> str | None:
    """A setting of one of the cluster's brokers (they are meant to agree); None if the
    cluster does not say (a DescribeConfigs refused). Raises ``KafkaException`` if it
    does not answer."""
    admin = AdminClient({**client_config(bootstrap, "admin"), **client_logging("admin")})
    brokers = admin.list_topics(timeout=timeout).brokers
    if not brokers:
        return None
    resource = ConfigResource(ConfigResource.Type.BROKER, str(min(brokers)))
    try:
        entry = admin.describe_configs([resource], request_timeout=timeout)[resource].result()
    except KafkaException as exc:
        if unreachable(exc):
            raise
        log.info("could not read the broker's %s (not checked): %s", name, exc)
        return None
    found = entry.get(name)
    return None if found is None else found.value


def set_topic_configs(bootstrap: str, changes: dict[str, dict[str, str]]) -> None:
    """Set these settings of these topics, leaving their others as they are."""
    admin = AdminClient({**client_config(bootstrap, "admin"), **client_logging("admin")})
    resources = []
    for topic, settings in changes.items():
        resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
        for name, value in settings.items():
            resource.add_incremental_config(ConfigEntry(
                name, value, incremental_operation=AlterConfigOpType.SET))
        resources.append(resource)
    for future in admin.incremental_alter_configs(resources).values():
        future.result()


def _raise_limits(bootstrap: str, admin: AdminClient, specs: list[TopicSpec],
                  existing: set[str]) -> None:
    """Bring an existing topic's ``max.message.bytes`` up to its spec's (a topic made by an
    earlier version, at the broker's default): never lowered."""
    wanted = {s.name: int(s.config["max.message.bytes"]) for s in specs
              if s.name in existing and "max.message.bytes" in s.config}
    if not wanted:
        return
    limits = topic_limits(bootstrap, list(wanted), default=0)
    low = [name for name, limit in wanted.items() if limits.get(name, 0) < limit]
    if not low:
        return
    resources = []
    for name in low:
        resource = ConfigResource(ConfigResource.Type.TOPIC, name)
        resource.add_incremental_config(ConfigEntry(
            "max.message.bytes", str(wanted[name]),
            incremental_operation=AlterConfigOpType.SET))
        resources.append(resource)
    for future in admin.incremental_alter_configs(resources).values():
        future.result()
    log.info("raised max.message.bytes of %s", ", ".join(low))


def ensure_topics(bootstrap: str, specs: list[TopicSpec]) -> list[str]:
    """Create missing topics; return the names created. Existing ones are left as they are,
    but for their record limit, which is raised to the spec's."""
    admin = AdminClient({**client_config(bootstrap, "admin"), **client_logging("admin")})
    existing = set(admin.list_topics(timeout=10).topics)
    _raise_limits(bootstrap, admin, specs, existing)
    new = [
        NewTopic(s.name, num_partitions=s.partitions,
                 replication_factor=s.replication if s.replication is not None else -1,
                 config=s.config)
        for s in specs
        if s.name not in existing
    ]
    if not new:
        return []
    for fut in admin.create_topics(new, operation_timeout=30).values():
        try:
            fut.result()
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    # Wait until the new topics' metadata is visible, so producers don't race it.
    deadline = time.monotonic() + 30
    names = [t.topic for t in new]
    while time.monotonic() < deadline:
        topics = admin.list_topics(timeout=5).topics
        if all(n in topics and not topics[n].error and topics[n].partitions for n in names):
            break
        time.sleep(0.1)
    return names
