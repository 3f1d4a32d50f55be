"""``pipeline erase``: an operator erases a conversation, or every conversation of a
user, from the store and from the log (``docs/erasure.md``).

The store's index of data keys (``data_keys``, the projector's projection of
``chat.keys``) says whose each conversation is and which keys it has: the command
waits until the projector has read ``chat.keys`` and ``chat.control`` to where they end
now, so no key made before it ran is missed. For each conversation: a
``SessionDeleted`` (reason ``erased``) goes to ``chat.control`` (running turns stop, the
store drops it, the gateway refuses it), then its erasure to ``chat.erasures`` (every
keyring refuses its keys from then on) and its keys' tombstones to ``chat.keys`` (the
broker deletes their records within the erasure window). The ``SessionDeleted`` is the
record that an erasure happened; it names the conversation and its tenant, not what was
erased.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid

import psycopg

from pipeline.codec import bare, conversation_key
from pipeline.digests import Digester
from pipeline.kafka import GroupStatus, ProduceError
from pipeline.kafka.plain import PlainWriter
from pipeline.keystore import Keyring, open_keyring
from pipeline.settings import CommonSettings
from pipeline.topics import CONTROL, KEYS
from schemas import SessionDeleted

# How long the command waits for the projector to reach the log's end.
CATCH_UP_S = 120.0


class EraseError(Exception):
    """The erasure cannot be made now (said in one line)."""


def erase_command(common: CommonSettings, args: argparse.Namespace) -> int:
    try:
        with psycopg.connect(common.database_url, connect_timeout=10) as conn:
            caught_up(conn, common.kafka_bootstrap, args.projector_group)
            with open_keyring(common, "erase") as keyring:
                targets = _targets(conn, args, keyring.digests)
                if targets:
                    keys = erase(keyring, PlainWriter(common.kafka_bootstrap, "erase"),
                                 [(c, tenant, key_ids(conn, c)) for c, tenant in targets])
            if not targets:
                what = (f"conversation {args.conversation}" if args.conversation
                        else f"conversation of user {args.user!r} in tenant "
                             f"{args.tenant or 'default'!r}")
                print(f"no {what} is in the store: nothing to erase", file=sys.stderr)
                return 1
    except EraseError as exc:
        print(f"pipeline erase: {exc}", file=sys.stderr)
        return 1
    print(f"erased {len(targets)} conversation(s): {keys} data key(s) destroyed; the "
          f"broker deletes their records within {common.erasure_window_ms / 3_600_000:g} h "
          "(PIPELINE_ERASURE_WINDOW_MS)")
    return 0


def caught_up(conn: psycopg.Connection, bootstrap: str, group: str,
              wait_s: float = CATCH_UP_S) -> None:
    """Wait until the store holds ``chat.keys`` and ``chat.control`` up to where they end
    now (``EraseError`` past ``wait_s``), saying how far behind it is meanwhile."""
    status = GroupStatus(bootstrap, group)
    try:
        targets = {(t, p): end for t in (KEYS, CONTROL)
                   for p, (_, end) in status.per_partition(t).items()}
    finally:
        status.close()
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        done = {(t, p): o for t, p, o in conn.execute(
            "SELECT topic, partition, next_offset FROM projector_positions"
            " WHERE topic = ANY(%s)", ([KEYS, CONTROL],))}
        behind = sum(max(end - done.get(tp, 0), 0) for tp, end in targets.items())
        if not behind:
            if said:
                print(file=sys.stderr)
            return
        if time.monotonic() > deadline:
            raise EraseError(f"the store is {behind:,} records behind {KEYS} and {CONTROL} "
                             f"after {wait_s:.0f} s: is the projector running? (erasing "
                             "needs the store to know every key)")
        print(f"\rwaiting for the projector: {behind:,} records behind", end="",
              file=sys.stderr, flush=True)
        said = True
        time.sleep(0.2)


def _targets(conn: psycopg.Connection, args: argparse.Namespace, digests: Digester
             ) -> list[tuple[uuid.UUID, str]]:
    """The conversation and its tenant (the store's: ``--tenant`` names a user's), or
    every conversation of the user: any of whose turns named them, whose session has
    memory for them, or whose key's turn named them (by digest: chat.keys names no one)."""
    if args.conversation is not None:
        row = conn.execute("SELECT tenant FROM conversations WHERE id = %s",
                           (args.conversation,)).fetchone()
        if row is None:
            row = conn.execute("SELECT tenant FROM data_keys WHERE conversation_id = %s"
                               " LIMIT 1", (args.conversation,)).fetchone()
        if row is not None and args.tenant is not None and row[0] != args.tenant:
            raise EraseError(f"conversation {args.conversation} is not tenant "
                             f"{args.tenant!r}'s: nothing erased (leave --tenant out, or "
                             "name its own)")
        return [(args.conversation, row[0])] if row is not None else []
    tenant = args.tenant or "default"
    rows = conn.execute(
        "SELECT conversation_id FROM conversation_users WHERE tenant = %(t)s"
        " AND \"user\" = %(u)s"
        " UNION SELECT conversation_id FROM data_keys WHERE tenant = %(t)s"
        " AND user_digest = ANY(%(d)s)"
        " UNION SELECT id FROM conversations WHERE tenant = %(t)s AND memory_user = %(u)s"
        " AND NOT deleted",
        {"t": tenant, "u": args.user,
         "d": digests.every("user", tenant, args.user)}).fetchall()
    return sorted((c, tenant) for c, in rows)


def key_ids(conn: psycopg.Connection, conversation: uuid.UUID) -> list[str]:
    return [k for k, in conn.execute("SELECT key_id FROM data_keys WHERE conversation_id = %s",
                                     (conversation,))]


def erase(keyring: Keyring, writer: PlainWriter,
          targets: list[tuple[uuid.UUID, str, list[str]]], timeout: float = 30.0,
          chunk: int = 500) -> int:
    """Erase these conversations (id, tenant, key ids; see the module), ``chunk`` at a
    time, each chunk's deletions acknowledged before its erasures: the number of data
    keys destroyed."""
    keys = 0
    for start in range(0, len(targets), chunk):
        part = targets[start:start + chunk]
        for conversation, tenant, _ in part:
            writer.send(CONTROL, conversation_key(conversation), bare(SessionDeleted(
                conversation_id=conversation, tenant=tenant, reason="erased",
                request_id=f"erase-{uuid.uuid4().hex}")))
        failed = writer.flush(timeout)
        if failed:
            raise ProduceError(f"deletions not acknowledged: {failed[0]}")
        keys += keyring.destroy(part, timeout=timeout)
        print(f"\r[{start + len(part)}/{len(targets)}] erased", end="", file=sys.stderr,
              flush=True)
    print(file=sys.stderr)
    return keys
