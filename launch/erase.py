"""``pipeline erase``: an operator erases a conversation, or every conversation of a
user, from the store and from the log (``docs/erasure.md``).

For each conversation: a ``SessionDeleted`` (reason ``erased``) goes to ``chat.control``
(running turns stop, the store drops it, the gateway refuses it), then its data keys'
tombstones go to ``chat.keys``. That event is the record that an erasure happened; it
names the conversation and its tenant, not what was erased. The content in every copy
of the log is unreadable from then on (the broker deletes the keys' records within the
erasure window).
"""

from __future__ import annotations

import argparse
import sys
import uuid

from pipeline.codec import conversation_key, encode
from pipeline.kafka import ProduceError
from pipeline.kafka.plain import PlainWriter
from pipeline.keystore import Keyring, open_keyring
from pipeline.settings import CommonSettings
from pipeline.topics import CONTROL
from schemas import SessionDeleted


def erase_command(common: CommonSettings, args: argparse.Namespace) -> int:
    with open_keyring(common, "erase") as keyring:
        if args.conversation is not None:
            owner = keyring.owner(args.conversation)
            targets = [(args.conversation, owner.tenant if owner else args.tenant)]
        else:
            targets = [(c, args.tenant) for c in keyring.conversations_of(args.tenant,
                                                                          args.user)]
        if not targets:
            print(f"no conversation of user {args.user!r} in tenant {args.tenant!r} has "
                  "a data key: nothing to erase", file=sys.stderr)
            return 1
        writer = PlainWriter(common.kafka_bootstrap, "erase")
        keys = 0
        for n, (conversation, tenant) in enumerate(targets, 1):
            keys += erase(keyring, writer, conversation, tenant)
            print(f"\r[{n}/{len(targets)}] erased {conversation}", end="", file=sys.stderr,
                  flush=True)
        print(file=sys.stderr)
    print(f"erased {len(targets)} conversation(s): {keys} data key(s) destroyed; the "
          f"broker deletes their records within {common.erasure_window_ms / 3_600_000:g} h "
          "(PIPELINE_ERASURE_WINDOW_MS)")
    return 0


def erase(keyring: Keyring, writer: PlainWriter, conversation: uuid.UUID, tenant: str,
          timeout: float = 30.0) -> int:
    """Erase one conversation (see the module): the number of data keys destroyed."""
    deleted = SessionDeleted(conversation_id=conversation, tenant=tenant, reason="erased",
                             request_id=f"erase-{uuid.uuid4().hex}")
    writer.send(CONTROL, conversation_key(conversation), encode(deleted))
    failed = writer.flush(timeout)
    if failed:
        raise ProduceError(f"the erasure of {conversation} was not acknowledged: {failed[0]}")
    return keyring.destroy(conversation, timeout=timeout)
