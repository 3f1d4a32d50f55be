"""The events without a broker: the codec (to bytes and back, what is refused), event
ids, and the conversation projection's fold (``projections.projection``)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pipeline.codec import CLEAR, DecodeError
from projections.projection import project
from schemas import (
    ChatMessage,
    GenerationFinished,
    PromptSubmitted,
    TokenDelta,
    Usage,
)
from schemas.events import new_event_id

CONV = uuid.uuid4()


def prompt(**kw: object) -> PromptSubmitted:
    fields: dict[str, object] = {
        "conversation_id": CONV, "request_id": "r1", "model": "m",
        "messages": (ChatMessage(role="user", content="hello there"),),
    }
    fields.update(kw)
    return PromptSubmitted(**fields)  # type: ignore[arg-type]


def test_codec_round_trips_every_field() -> None:
    event = prompt(history_len=0)
    assert CLEAR.decode(CLEAR.encode(event)) == event


@pytest.mark.parametrize("data", [None, b"", b"{", b'{"type": "PromptSubmitted"}',
                                  b'{"type": "Nope", "v": 1}', b"\xff\xfe"])
def test_codec_rejects_what_is_not_an_event(data: bytes | None) -> None:
    with pytest.raises(DecodeError):
        CLEAR.decode(data)


def test_event_ids_are_random_version_4_uuids_and_a_forked_child_draws_its_own() -> None:
    ids = [TokenDelta(conversation_id=uuid.uuid4(), request_id="r", seq=0, text="").event_id
           for _ in range(2 * new_event_id.PER_CALL + 1)]
    assert all(i.version == 4 and i.variant == uuid.RFC_4122 for i in ids)
    assert len(set(ids)) == len(ids)
    # The pool a process holds is not its forked child's: the child would repeat its ids.
    script = """if True:
        import os
        from schemas.events import new_event_id
        new_event_id()  # the pool is full now
        read, write = os.pipe()
        if os.fork() == 0:
            os.write(write, new_event_id().bytes)
            os._exit(0)
        os.wait()
        child = os.read(read, 16)
        print(child in {new_event_id().bytes for _ in range(new_event_id.PER_CALL)})
    """
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parent.parent)
    assert run.stdout.strip() == "False"


def test_projection_places_messages_by_history_length() -> None:
    event = prompt(
        history=(ChatMessage(role="user", content="a"), ChatMessage(role="assistant", content="b")),
        messages=(ChatMessage(role="user", content="c"),), history_len=2,
    )
    inserts = [w.params for w in project(event) if "INTO messages" in w.sql]
    assert [(p["seq"], p["role"], p["content"]) for p in inserts] == [(2, "user", "c")]
    assert event.reply_seq == 3


def test_projection_stores_the_reply_at_its_seq_and_ignores_deltas() -> None:
    finished = GenerationFinished(
        conversation_id=CONV, request_id="r1", model="m", reply_seq=1, finish_reason="length",
        text="xyz", usage=Usage(prompt_tokens=3, completion_tokens=2), deltas=2, duration_ms=5)
    writes = project(finished)
    message = next(w.params for w in writes if "INTO messages" in w.sql)
    assert (message["seq"], message["role"], message["content"]) == (1, "assistant", "xyz")
    assert project(TokenDelta(conversation_id=CONV, request_id="r1", seq=0, text="x")) == []


def test_projection_titles_a_new_conversation_from_its_first_user_message() -> None:
    conversation = project(prompt())[0]
    assert conversation.params[2] == "hello there"
    assert project(prompt(history=(ChatMessage(role="user", content="x"),),
                          history_len=1))[0].params[2] is None


def test_projection_stores_nul_as_a_replacement_character() -> None:
    finished = GenerationFinished(
        conversation_id=CONV, request_id="r1", model="m", reply_seq=1, finish_reason="stop",
        text="a\x00b", usage=Usage(prompt_tokens=1, completion_tokens=1), deltas=1,
        duration_ms=1)
    message = next(w.params for w in project(finished) if "INTO messages" in w.sql)
    assert message["content"] == "a\ufffdb"
