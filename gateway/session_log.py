"""Sessions as facts in the log (``Sessions``): created and deleted by events on
``chat.control``, read through the store (the routes: ``gateway.sessions``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable

from gateway.conversation_keys import ConversationKeys
from gateway.dependencies import from_log
from gateway.problems import ErasuresCapped, LogUnavailable, SessionNotFound
from gateway.settings import GatewaySettings
from gateway.store import ConversationStore
from gateway.view import ConversationView
from pipeline.codec import key_of
from pipeline.kafka import EventProducer
from pipeline.topics import CONTROL, ERASURES, KEYS
from schemas import SessionCreated, SessionDeleted

log = logging.getLogger(__name__)


class Sessions:
    def __init__(self, settings: GatewaySettings, producer: EventProducer,
                 store: ConversationStore, keys: ConversationKeys,
                 broker_ahead_s: Callable[[], float] = lambda: 0.0) -> None:
        self.settings = settings
        self.producer = producer
        self.store = store
        self.keys = keys
        # The brokers' clock less this host's (read off the prompts' deliveries): a
        # tenant's erasures are counted over a window of the brokers' time, which stamps
        # them, whatever this host's clock says.
        self.broker_ahead_s = broker_ahead_s

    async def visible_view(self, conversation_id: uuid.UUID, tenant: str) -> ConversationView:
        view = await self.store.view(conversation_id)
        if not view.visible_to(tenant):
            raise SessionNotFound(conversation_id)
        return view

    async def create(self, tenant: str, title: str | None, user: str | None = None,
                     memory: bool = False) -> SessionCreated:
        """A new session, once its creation is in the log (with memory on for ``user``
        if ``memory``)."""
        event = SessionCreated(conversation_id=uuid.uuid4(),
                               request_id=f"session-{uuid.uuid4().hex}", tenant=tenant,
                               title=title, memory_user=user if memory else None)
        key = await self.keys.for_content(event.conversation_id, tenant, user, None)
        await from_log(lambda: self.producer.send_raw(CONTROL, key_of(event),
                                                      self.keys.codec.encode(event, key)),
                       self.settings.dependency_timeout_s)
        return event

    async def delete(self, session: uuid.UUID, tenant: str) -> None:
        """Delete a session the tenant sees (``SessionNotFound`` otherwise), once the
        deletion is in the log: its running turns stop, the store drops it, and its data
        keys are destroyed, so its content is unreadable in the log too."""
        view = await self.visible_view(session, tenant)
        cap = self.settings.max_erasures_per_tenant
        if cap:  # counted over every gateway, as the log has them now (read on first)
            erasures = self.keys.keyring.erasures
            with contextlib.suppress(TimeoutError):  # then as this gateway knows them
                await asyncio.wait_for(asyncio.to_thread(erasures.catch_up),
                                       self.settings.dependency_timeout_s)
            made, frees_in = erasures.asked(tenant, time.time() + self.broker_ahead_s())
            if made >= cap:
                raise ErasuresCapped(made, cap, frees_in)
        await from_log(lambda: self.producer.send(CONTROL, SessionDeleted(
            conversation_id=session, request_id=f"delete-{uuid.uuid4().hex}",
            tenant=tenant, reason="deleted")), self.settings.dependency_timeout_s)
        # Its erasure (every keyring refuses its keys from then on), then the tombstones
        # of the keys the store knows: the broker deletes their records within the
        # erasure window. The deletion is durable already: if Kafka fails these, the
        # projector destroys the keys when it reads it (``projections.projector``).
        timeout_s = self.settings.dependency_timeout_s
        keyring = self.keys.keyring
        try:
            await from_log(functools.partial(self.producer.send_raw, ERASURES,
                                             *keyring.erasure(session, tenant)), timeout_s)
            for ref in view.key_refs:
                key, partition = keyring.tombstone(session, ref)
                await from_log(functools.partial(self.producer.send_raw, KEYS, key, None,
                                                 partition=partition), timeout_s)
        except LogUnavailable as exc:
            log.warning("session %s deleted; its keys are left to the projector: %r",
                        session, exc)
