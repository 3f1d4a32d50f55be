"""Pure parts of the gateway's streams, no broker: a slow reader's bounded, merging queue,
and the cursor that makes a resumed stream continue exactly."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator

import pytest
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.cursor import Cursor, Seqs
from gateway.errors import api_error
from gateway.eventstream import ServerSend, Streams
from gateway.problems import InvalidLastEventId
from gateway.subscription import Delivered, Overflow, Subscription, legacy
from pipeline.codec import Position
from pipeline.kafka import Record
from pipeline.topics import GENERATIONS, LIVE
from schemas import GenerationFinished, TokenDelta, Usage
from schemas.live import Delta, End, Start, StreamItem

IDS = {"conversation_id": uuid.uuid4(), "request_id": "chatcmpl-x"}


def at(offset: int, item: StreamItem, index: int = 0) -> Delivered:
    """An entry of a chat.live record at ``offset``."""
    return Delivered(Position(LIVE, 0, offset), item, index)


def delta(seq: int, text: str) -> Delta:
    return Delta(seq, text, (seq,))


def started(attempt: int = 0) -> Start:
    return Start(attempt, "chatcmpl-x")


def finished(text: str) -> End:
    return End(len(text), "stop", Usage(prompt_tokens=3, completion_tokens=len(text)))


def drain(sub: Subscription) -> list[Delivered]:
    async def take() -> list[Delivered]:
        return [await sub.get() for _ in range(len(sub))]
    return asyncio.run(take())


def test_a_lagging_reader_gets_consecutive_deltas_merged() -> None:
    sub = Subscription("chatcmpl-x", b"k", 0)
    sub.push(at(0, started()))
    for i, text in enumerate("abc"):
        sub.push(at(i + 1, delta(i, text)))
    sub.push(at(4, delta(1, "b")))  # a duplicate seq is dropped
    items = drain(sub)
    assert [type(i.item).__name__ for i in items] == ["Start", "Delta"]
    merged = items[1]
    assert isinstance(merged.item, Delta) and merged.position is not None
    assert (merged.item.seq, merged.span, merged.item.text, merged.position.offset) == (
        0, 3, "abc", 3)
    assert merged.item.token_ids == (0, 1, 2)


def test_tokens_written_again_never_hide_the_new_ones_behind_them() -> None:
    """Found by the outage suite: a worker whose commit's answer was lost sent its
    transaction again, but the commit had happened, so the log held the turn's start and
    first tokens twice, then the rest. Merged with the new tokens behind them, the copies
    made one delta starting at an old seq, which the cursor dropped whole: the client got
    the first four tokens, then the end."""
    sub = Subscription("chatcmpl-x", b"k", 0)
    log = [started(), *(delta(i, f"t{i} ") for i in range(4)),
           started(), *(delta(i, f"t{i} ") for i in range(12)),
           finished("".join(f"t{i} " for i in range(12)))]
    for offset, event in enumerate(log):
        sub.push(at(offset, event))  # the reader is behind: all of it is queued
    text = contents(sent(Cursor("chatcmpl-x", 1, "m", include_usage=False), drain(sub)))
    assert text == "".join(f"t{i} " for i in range(12))


def test_a_reader_past_the_bound_is_dropped() -> None:
    sub = Subscription("chatcmpl-x", b"k", 0, max_items=8, max_bytes=10)
    sub.push(at(0, started()))
    for i in range(20):
        sub.push(at(i + 1, delta(i, "xy")))  # merges, but its text passes 10 bytes
    assert sub.overflowed
    with pytest.raises(Overflow):
        asyncio.run(sub.get())


def fields(message: bytes) -> dict[str, str]:
    """An SSE message's fields (``data``, ``id``): one line each, LF, a blank line after."""
    assert message.endswith(b"\n\n") and b"\r" not in message
    lines = message.decode()[:-2].split("\n")
    assert all(": " in line for line in lines), lines
    return dict(line.split(": ", 1) for line in lines)


def sent(cursor: Cursor, items: list[Delivered]) -> list[dict]:
    return [fields(e) for item in items for e in cursor.feed(item)]


def contents(events: list[dict]) -> str:
    text = ""
    for e in events:
        for choice in json.loads(e["data"]).get("choices", []):
            text += choice["delta"].get("content") or ""
    return text


LOG = [at(0, started()), at(1, delta(0, "a")), at(2, delta(1, "b")),
       at(3, started(attempt=1)),  # a worker took the turn over and carries on at seq 2
       at(4, delta(1, "B")),  # the old owner, late: a duplicate
       at(5, delta(2, "c")), at(6, finished("abc"))]


def positions(events: list[dict]) -> list[str | None]:
    return [json.loads(e["data"]).get("event_id") for e in events]


def test_a_stream_sends_each_seq_once_and_one_role_chunk() -> None:
    events = sent(Cursor("chatcmpl-x", 1, "m", include_usage=True), LOG)
    assert contents(events) == "abc"
    roles = [e for e in events if '"role"' in e["data"]]
    assert len(roles) == 1 and json.loads(roles[0]["data"])["event_id"] == "0-0-0"
    assert positions(events) == ["0-0-0", "0-1-0", "0-2-0", "0-5-0", "0-6-0", None]
    assert all("id" not in e for e in events)  # data lines only, as vllm serve sends


def test_an_eventsource_stream_has_id_lines_equal_to_the_positions() -> None:
    events = sent(Cursor("chatcmpl-x", 1, "m", include_usage=True, id_lines=True), LOG)
    assert [e.get("id") for e in events] == positions(events)


def test_a_reader_that_reads_the_log_first_gets_no_delta_it_has_merged_with_one_it_lacks(
) -> None:
    """A client attached to a running turn gets its deltas from the log, then the live
    ones. Live ones that came meanwhile are not merged until it is known which the log
    gave: merged, seq 7 (a copy) and seq 8 (new) would be one item, dropped whole as a
    copy, and the client would never get seq 8 (a race of retries lost deltas so)."""
    sub = Subscription("chatcmpl-x", b"k", 0, held=True)
    for seq, text in ((7, "h"), (8, "i"), (9, "j")):
        sub.push(at(seq, delta(seq, text)))
    sub.hand_off(8)  # the log gave up to seq 7
    assert [(d.item.seq, d.item.text, d.span) for d in drain(sub)] == [(8, "i", 1),
                                                                      (9, "j", 1)]
    for seq, text in ((7, "h"), (10, "k"), (11, "l")):  # a copy is dropped; then merged
        sub.push(at(seq, delta(seq, text)))
    assert [(d.item.seq, d.item.text, d.span) for d in drain(sub)] == [(10, "kl", 2)]


@pytest.mark.parametrize("last", [None, 0, 1, 2, 5])
def test_no_gap_is_seen_in_a_whole_stream_or_after_any_resume_point(last: int | None) -> None:
    """What a stream checks its live items against (``Follow._events``): the log's own
    items, a takeover's and a late duplicate among them, show no gap from any point."""
    seqs = Seqs(None if last is None else (LIVE, last, 0))
    for item in LOG:
        assert not seqs.missed(item), item
        seqs.passed(item)
    assert seqs.next == 3


def test_a_gap_is_seen_at_a_delta_or_an_end_past_what_was_passed() -> None:
    seqs = Seqs(None)
    seqs.passed(at(0, started()))
    seqs.passed(Delivered(Position(LIVE, 0, 2), delta(0, "ab"), 0, span=2))  # merged
    assert not seqs.missed(at(3, delta(2, "c")))
    assert seqs.missed(at(3, delta(3, "d"))) and seqs.missed(at(3, finished("abcd")))
    # Read again from the log at the gap: what the client has is passed over.
    assert [seqs.after_gap(at(o, i)) for o, i in enumerate(
        [started(), delta(1, "b"), delta(2, "c"), finished("abc")])] == [False, False, True,
                                                                        True]


@pytest.mark.parametrize("last", [0, 1, 2, 5, 6])  # the offsets whose chunks carry an id
def test_a_resumed_stream_continues_exactly_after_its_last_event(last: int) -> None:
    whole = sent(Cursor("chatcmpl-x", 1, "m", include_usage=False), LOG)
    received = [e for e, p in zip(whole, positions(whole), strict=True)
                if p and int(p.split("-")[1]) <= last]
    resumed = sent(Cursor("chatcmpl-x", 1, "m", include_usage=False,
                          resume_after=(LIVE, last, 0)), LOG)
    assert received + resumed == whole


@pytest.mark.parametrize(("last", "log"), [(7, [*LOG, at(8, delta(3, "d"))]), (3, LOG)])
def test_a_resume_point_that_is_not_in_the_stream_is_refused(
    last: int, log: list[Delivered]
) -> None:
    cursor = Cursor("chatcmpl-x", 1, "m", include_usage=False, resume_after=(LIVE, last, 0))
    with pytest.raises(InvalidLastEventId) as err:
        sent(cursor, log)
    assert api_error(err.value).status == 400


@pytest.mark.parametrize("text", ["a", 'he said "hi"\n', "\u2603 \\ \t </script>", "\x00\ud7ff"])
def test_a_content_chunk_from_the_template_is_the_chunk_itself(text: str) -> None:
    """Content chunks are built from a per-turn template around the text: the JSON a
    client parses is the one ``openai_api.chunk`` describes, whatever the text and the
    model's name hold."""
    cursor = Cursor("chatcmpl-x", 7, 'a "model" \u00e9', include_usage=False)
    cursor.feed(at(0, started()))
    (message,) = sent(cursor, [at(9, delta(0, text))])
    assert json.loads(message["data"]) == {
        **cursor._chunk({"content": text}), "event_id": "0-9-0"}


def test_a_quiet_reader_is_nudged_with_nothing_then_reads_on() -> None:
    async def scenario() -> list[Delivered | None]:
        sub = Subscription("chatcmpl-x", b"k", 0)
        waiting = asyncio.create_task(sub.get())
        await asyncio.sleep(0)
        sub.nudge()  # the fan-out's sweep: a keep-alive is due
        got = [await waiting]
        sub.push(at(0, started()))
        got.append(await sub.get())
        return got

    nothing, item = asyncio.run(scenario())
    assert nothing is None and item is not None and isinstance(item.item, Start)


def _asgi_stream(messages: int, send_blocks_after: int | None, disconnect_after_s: float | None,
                 method: str = "POST") -> tuple[list[dict], list[str]]:
    """Run an ``EventStream`` of ``messages`` messages (one each 10 ms) against an ASGI
    server's side played here: its sends, and what its iterator's cleanup saw."""
    sent: list[dict] = []
    seen: list[str] = []

    async def messages_() -> AsyncGenerator[bytes, None]:
        try:
            for i in range(messages):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.01)
        finally:
            seen.append("closed")

    async def scenario() -> None:
        streams = Streams(send_timeout_s=0.2, sweep_s=0.05)
        streams.start()
        stuck = asyncio.Event()

        async def send(message: dict) -> None:
            sent.append(message)
            if send_blocks_after is not None and len(sent) > send_blocks_after:
                await stuck.wait()  # a client that reads nothing more

        async def receive() -> dict:
            if disconnect_after_s is None:
                await asyncio.Event().wait()
            await asyncio.sleep(disconnect_after_s or 0)
            return {"type": "http.disconnect"}

        response = streams.response(messages_(), {"X-Test": "1"})
        await asyncio.wait_for(response({"type": "http", "method": method}, receive, send), 5)
        assert len(streams) == 0
        await streams.stop()

    asyncio.run(scenario())
    return sent, seen


def test_an_event_stream_sends_each_message_whole_and_ends() -> None:
    sent, seen = _asgi_stream(5, None, None)
    assert sent[0]["type"] == "http.response.start"
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:-1]] == [f"data: {i}\n\n".encode() for i in range(5)]
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert seen == ["closed"]


def test_an_event_stream_stops_when_its_client_leaves() -> None:
    sent, seen = _asgi_stream(1000, None, 0.1)
    assert 2 < len(sent) < 100 and sent[-1].get("more_body") is True and seen == ["closed"]


def test_an_event_stream_whose_client_reads_nothing_is_dropped() -> None:
    sent, seen = _asgi_stream(1000, 3, None)
    assert len(sent) == 4 and seen == ["closed"]


def test_an_event_stream_answers_head_with_its_headers_only() -> None:
    sent, seen = _asgi_stream(5, None, None, method="HEAD")
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1]["body"] == b"" and seen == []  # never started


def test_an_event_streams_body_skips_the_middleware_which_still_sees_its_start() -> None:
    """Under ``ServerSend`` a stream's start passes every middleware (headers they add
    arrive) and its body goes to the server's own send, whole and in order."""
    seen_by_middleware: list[str] = []
    server: list[Message] = []
    streams = Streams(send_timeout_s=5)

    class Tagging:
        def __init__(self, app: ASGIApp) -> None:
            self.app = app

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            async def tagging_send(message: Message) -> None:
                seen_by_middleware.append(message["type"])
                if message["type"] == "http.response.start":
                    message["headers"] = [*message["headers"], (b"x-tag", b"1")]
                await send(message)

            await self.app(scope, receive, tagging_send)

    async def messages() -> AsyncGenerator[bytes, None]:
        for i in range(3):
            yield f"data: {i}\n\n".encode()

    async def endpoint(request: Request) -> Response:
        return streams.response(messages(), {})

    app = ServerSend(routes=[Route("/s", endpoint, methods=["GET"])],
                     middleware=[Middleware(Tagging)])

    async def send(message: Message) -> None:
        server.append(message)

    async def receive() -> Message:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "GET", "path": "/s", "root_path": "", "headers": [],
             "query_string": b"", "scheme": "http", "server": ("testserver", 80)}
    asyncio.run(app(scope, receive, send))

    assert seen_by_middleware == ["http.response.start"]
    assert (b"x-tag", b"1") in server[0]["headers"]
    assert [m["body"] for m in server[1:]] == [b"data: 0\n\n", b"data: 1\n\n",
                                                b"data: 2\n\n", b""]
    assert server[-1]["more_body"] is False


def test_entries_of_one_record_resume_by_their_index() -> None:
    """A live record holds many entries of a turn (its start, a delta and its end, for a
    short turn): each chunk names its entry, and a stream resumed from any of them
    continues after exactly that one."""
    log = [at(3, started(), 0), at(3, delta(0, "a"), 1), at(4, delta(1, "b"), 0),
           at(4, finished("ab"), 2)]
    whole = sent(Cursor("chatcmpl-x", 1, "m", include_usage=False), log)
    assert positions(whole) == ["0-3-0", "0-3-1", "0-4-0", "0-4-2"]
    for cut, (offset, index) in enumerate([(3, 0), (3, 1), (4, 0), (4, 2)], start=1):
        resumed = sent(Cursor("chatcmpl-x", 1, "m", include_usage=False,
                              resume_after=(LIVE, offset, index)), log)
        assert whole[:cut] + resumed == whole


def test_a_turn_from_before_the_live_stream_is_read_from_its_events() -> None:
    """A turn written by the code before the live stream has its deltas as TokenDelta
    events in chat.generations: they stream with that topic's positions (two-part ids),
    and a start or end of today's (naming the live stream) is not taken twice."""
    def record(offset: int) -> Record:
        return Record(Position(GENERATIONS, 0, offset), b"k", b"", 0)

    old = [TokenDelta(**IDS, seq=i, text=t) for i, t in enumerate("ab")]
    log = [d for offset, event in enumerate(old, start=4) if (d := legacy(record(offset), event))]
    done = GenerationFinished(**IDS, model="m", reply_seq=1, finish_reason="stop", text="ab",
                              usage=Usage(prompt_tokens=1, completion_tokens=2), deltas=2,
                              duration_ms=1)
    log.append(legacy(record(6), done))  # type: ignore[arg-type]  # v1: no reference
    assert legacy(record(7), done.model_copy(update={"ref": 12})) is None
    whole = sent(Cursor("chatcmpl-x", 1, "m", include_usage=False), log)
    assert contents(whole) == "ab" and positions(whole) == ["0-4", "0-5", "0-6"]
    resumed = sent(Cursor("chatcmpl-x", 1, "m", include_usage=False,
                          resume_after=(GENERATIONS, 4, 0)), log)
    assert whole[:1] + resumed == whole
