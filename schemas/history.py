"""What the model is given for a turn, from the durable record alone. Pure functions, no
I/O: the gateway, the workers and an auditor apply the same rule.

A prompt carries its turn's new messages; the session before them is its history.
The history of a turn is the history of the session's previous accepted turn, then
that turn's new messages, then its reply: the text of its ``GenerationFinished``
(whatever its ``finish_reason``; a cancelled turn's partial text, possibly empty), or
nothing if it ended in ``GenerationFailed``. Each text as the store keeps it
(``schemas.conversation.storable``). The first turn has none. A prompt names its
previous turn (``PromptSubmitted.previous``) or carries its history inline (prompts
of v3, upcast; or one whose previous turn the gateway could not place), so the chain
back from any turn ends at a first turn or an inline history.

``digest`` is how the gateway tells what it read the history to be
(``history_digest``), so that a worker that rebuilt it, or kept it, and an auditor can
check theirs is the same.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

from schemas.conversation import storable
from schemas.events import (
    ChatMessage,
    GenerationFailed,
    GenerationFinished,
    PromptSubmitted,
    Recalled,
)

History = tuple[ChatMessage, ...]


def message(role: str, content: str) -> ChatMessage:
    """A message as a history holds it: its text as the store keeps it."""
    return ChatMessage(role=role, content=storable(content))  # type: ignore[arg-type]


def canonical(messages: Iterable[ChatMessage]) -> bytes:
    """The bytes a history's digest is taken of: ``[[role, content], ...]`` as JSON."""
    return json.dumps([[m.role, storable(m.content)] for m in messages], ensure_ascii=False,
                      separators=(",", ":")).encode()


def digest(messages: Iterable[ChatMessage]) -> str:
    return hashlib.sha256(canonical(messages)).hexdigest()


def turn_messages(prompt: PromptSubmitted,
                  end: GenerationFinished | GenerationFailed) -> History:
    """What one turn adds to its session: its new messages and its reply, if any."""
    added = tuple(message(m.role, m.content) for m in prompt.messages)
    if isinstance(end, GenerationFinished):
        added += (message("assistant", end.text),)
    return added


RECALL_PREAMBLE = "What you remember about this user from earlier sessions:"


def recall(recalled: Sequence[Recalled]) -> History:
    """What the model is given before the session for the memories a prompt recalled
    (``PromptSubmitted.recalled``): one system message listing them, or nothing. Not
    part of the session: the next turn's history does not hold it."""
    if not recalled:
        return ()
    lines = "\n".join(f"- {r.text}" for r in recalled)
    return (ChatMessage(role="system", content=f"{RECALL_PREAMBLE}\n{lines}"),)


def base(prompt: PromptSubmitted) -> History | None:
    """The history ``prompt`` gives without reference (none, or inline); None if it names
    its previous turn instead."""
    if not prompt.history_len:
        return ()
    if prompt.history is not None:
        return tuple(message(m.role, m.content) for m in prompt.history)
    return None


class BrokenChain(ValueError):
    """The records a prompt's history names are not a turn of its conversation."""


def check_link(prompt: PromptSubmitted, previous: PromptSubmitted,
               end: GenerationFinished | GenerationFailed) -> None:
    """That ``previous`` and ``end`` are a turn of ``prompt``'s conversation and end where
    ``prompt``'s history begins (``BrokenChain`` otherwise)."""
    if previous.conversation_id != prompt.conversation_id:
        raise BrokenChain("the previous prompt is another conversation's")
    if end.request_id != previous.request_id or end.conversation_id != prompt.conversation_id:
        raise BrokenChain("the previous turn's end is another turn's")


def rebuild(start: History, turns: Sequence[tuple[PromptSubmitted,
                                                  GenerationFinished | GenerationFailed]]
            ) -> History:
    """``start``, then each turn's messages, oldest first."""
    history = start
    for prompt, end in turns:
        history += turn_messages(prompt, end)
    return history


def session_inputs(prompts: Sequence[tuple[int, PromptSubmitted]],
                   ends: dict[str, GenerationFinished | GenerationFailed]
                   ) -> dict[str, History | None]:
    """What the model was given for each turn of one conversation, from its durable record
    alone: its prompts with their offsets in ``chat.prompts`` (in any order) and each
    turn's first end. Void prompts and duplicates are no turns (``TurnLedger``); a turn
    whose history names a turn these records do not hold maps to None."""
    from schemas.conversation import TurnLedger

    ledger = TurnLedger()
    after: dict[int, History] = {}  # prompt offset -> the session after that turn
    inputs: dict[str, History | None] = {}
    for offset, prompt in sorted(prompts, key=lambda p: p[0]):
        verdict = ledger.decide(prompt.conversation_id, prompt.request_id, prompt.history_end,
                                offset).verdict
        if not verdict.counts:
            continue
        history = base(prompt)
        if history is None and prompt.previous is not None:
            history = after.get(prompt.previous.prompt)
        if history is None:
            inputs[prompt.request_id] = None
            continue
        inputs[prompt.request_id] = history + prompt.messages
        end = ends.get(prompt.request_id)
        if end is not None:
            after[offset] = history + turn_messages(prompt, end)
    return inputs
