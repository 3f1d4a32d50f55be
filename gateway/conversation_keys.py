"""The conversations' data keys as the gateway uses them (``ConversationKeys``): the
key new content of a conversation is sealed with, found or made durable first."""

from __future__ import annotations

import functools
import uuid

from gateway.dependencies import from_log
from gateway.ids import conversation_of
from gateway.problems import LogUnavailable, Problem, SessionNotFound
from gateway.settings import GatewaySettings
from gateway.view import ConversationView
from pipeline.kafka import EventProducer
from pipeline.keylimits import KeyringError
from pipeline.keystore import Keyring
from pipeline.sealing import DataKey, looked_up
from pipeline.topics import KEYS


class ConversationKeys:
    """``keyring``: the process's data keys (``pipeline.keystore``), and ``codec`` seals
    with them; ``producer`` writes a new key to ``chat.keys``."""

    def __init__(self, settings: GatewaySettings, keyring: Keyring,
                 producer: EventProducer) -> None:
        self.settings = settings
        self.keyring = keyring
        self.codec = keyring.codec
        self.producer = producer

    async def for_content(self, conversation: uuid.UUID, tenant: str, user: str | None,
                          view: ConversationView | None) -> DataKey:
        """The conversation's data key: the one this gateway holds, else the one the
        store names (one fetch), else a new one, durable in ``chat.keys`` before
        anything is sealed with it. A deleted conversation takes no more content
        (``SessionNotFound``)."""
        if view is not None and view.deleted:
            raise SessionNotFound(conversation)
        held = self.keyring.for_writing(conversation)
        if held == "erased":
            raise SessionNotFound(conversation)
        if isinstance(held, DataKey):
            return held
        for ref in view.key_refs if view is not None else ():
            try:
                found = await from_log(functools.partial(looked_up, self.keyring.fetch, ref),
                                       self.settings.dependency_timeout_s)
            except KeyringError as exc:
                raise LogUnavailable() from exc
            if found is not None:
                return found
        new = self.keyring.new_key(conversation, tenant, user)
        written = await from_log(lambda: self.producer.send_raw(
            KEYS, new.record_key, new.value, partition=new.partition),
            self.settings.dependency_timeout_s)
        return self.keyring.placed(new, written.offset)

    def erased(self, completion: str) -> bool:
        """Whether the conversation of turn ``completion`` was erased."""
        try:
            return self.keyring.revoked(conversation_of(completion))
        except Problem:
            return False

    def idempotency_digest(self, tenant: str, key: str) -> bytes:
        """An idempotency key as kept: its keyed digest only (``pipeline.digests``)."""
        return self.keyring.digests.raw("idempotency", tenant, key)
