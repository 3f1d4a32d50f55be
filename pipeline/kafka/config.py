"""The operator's Kafka client settings: librdkafka properties read from the file that
``PIPELINE_KAFKA_CONFIG`` names, as Kafka's own tools take ``--command-config``.

Every client of every service starts from them (``pipeline.kafka.client_config``), so
TLS, SASL (PLAIN, SCRAM, OAUTHBEARER) and mutual TLS reach a secured cluster. The file
is read and checked once per process; a file that cannot be used stops the command with
one line naming the file, its line and the property. Paths (``*.location``) relative to
the file are taken from its folder. The pipeline sets some properties itself, for its
guarantees (idempotence, transactions, isolation, groups, compression, record sizes):
the file may not set those. A value may name an environment variable, as
``${env:KAFKA_PASSWORD}``, so that secrets stay out of the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ENV = "PIPELINE_KAFKA_CONFIG"

# What the pipeline sets per client, for its guarantees or from its own settings.
OWNED = {
    "bootstrap.servers": "PIPELINE_KAFKA_BOOTSTRAP sets it",
    "group.id": "each service names its own consumer groups",
    "transactional.id": "workers and gateways name their transactions",
    "enable.idempotence": "producers are idempotent, always",
    "acks": "producers wait for every in-sync replica, always",
    "isolation.level": "readers see committed records only",
    "enable.auto.commit": "consumers commit what they have handled",
    "enable.auto.offset.store": "consumers commit what they have handled",
    "auto.offset.reset": "each consumer chooses where it starts",
    "transaction.timeout.ms": "workers and gateways set their own",
    "compression.type": "PIPELINE_COMPRESSION sets it",
    "message.max.bytes": "PIPELINE_MAX_RECORD_BYTES sets it",
    "partitioner": "every client agrees where a key lives (murmur2_random)",
}


class ClientConfigError(ValueError):
    """The client properties file cannot be used; the message is one line."""


class AccessRefused(RuntimeError):
    """The cluster refused this process's clients (credentials, certificates), or their
    settings cannot be used; the message is one line naming the listener."""


def read_properties(path: Path) -> dict[str, str]:
    """A Java properties file's ``key=value`` (or ``key: value``) lines; ``#`` and ``!``
    start comments; a line ending in a backslash goes on on the next one."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ClientConfigError(f"{ENV}={path}: cannot be read ({exc})") from None
    out: dict[str, str] = {}
    pending = ""
    for number, raw in enumerate(text.splitlines(), start=1):
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1]
            continue
        if not line or line[0] in "#!":
            continue
        cut = min((i for i in (line.find("="), line.find(":")) if i > 0), default=-1)
        if cut < 0:
            raise ClientConfigError(f"{path}:{number}: expected key=value, got {line[:80]!r}")
        key, value = line[:cut].strip(), line[cut + 1:].strip()
        if key in OWNED:
            raise ClientConfigError(f"{path}:{number}: {key} is not the file's to set "
                                    f"({OWNED[key]})")
        value = _expand(value, path, number)
        if key.endswith(".location") and value and not os.path.isabs(value):
            value = str((path.parent / value).resolve())
        out[key] = value
    return out


_ENV_REFERENCE = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")


def _expand(value: str, path: Path, number: int) -> str:
    """``${env:NAME}`` is the variable's value (Kafka's EnvVarConfigProvider syntax), so a
    password can come from a Secret's environment while the file is a ConfigMap."""
    def variable(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise ClientConfigError(f"{path}:{number}: ${{env:{name}}} names a variable "
                                    "that is not set")
        return os.environ[name]

    return _ENV_REFERENCE.sub(variable, value)


_cache: dict[str, dict[str, str]] = {}


def client_properties() -> dict[str, str]:
    """The properties of the file ``PIPELINE_KAFKA_CONFIG`` names (none if unset)."""
    name = os.environ.get(ENV, "")
    if not name:
        return {}
    if name not in _cache:
        _cache[name] = read_properties(Path(name))
    return dict(_cache[name])


def describe_listener(bootstrap: str, properties: dict[str, str] | None = None) -> str:
    """How a client reaches the cluster, for messages: the address and the protocol
    (``127.0.0.1:9094 (SASL_SSL, SCRAM-SHA-512 as user pipeline)``)."""
    props = client_properties() if properties is None else properties
    protocol = props.get("security.protocol", "PLAINTEXT").upper()
    detail = [protocol]
    mechanism = props.get("sasl.mechanism") or props.get("sasl.mechanisms")
    if protocol.startswith("SASL"):
        detail.append(f"{mechanism or 'GSSAPI'}"
                      + (f" as user {props['sasl.username']}" if "sasl.username" in props
                         else ""))
    return f"{bootstrap} ({', '.join(detail)})"
