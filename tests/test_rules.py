"""Pure rules, no broker: which prompts count (the turn ledger), what control events mean
for turns that have not started, delta coalescing, the gateway's edge checks, and
event versions."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from gateway.edge import check_text, host_allowed, host_name, idempotency_key, load_json
from gateway.errors import APIError
from gateway.view import ConversationView
from pipeline.codec import CLEAR, DecodeError, Position, names_model, parse, parse_live, sealed_key
from pipeline.kafka import Record
from pipeline.kek import key_info
from pipeline.layout import layout_count
from pipeline.roster import heartbeat_of
from pipeline.rotations import Rotation
from projections.projection import project
from schemas import (
    ChatMessage,
    ClientAttached,
    ClientDetached,
    GenerationCancelled,
    GenerationStarted,
    PromptSubmitted,
    SessionDeleted,
)
from schemas.conversation import TurnLedger, Verdict, storable, title
from schemas.rollout import Rollout
from workers.control import ControlBook
from workers.flights import Flights, InFlight
from workers.plan import stop_at

CONV = uuid.uuid4()
NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


def prompt(rid: str, history_end: int | None, history: int = 0, **kw: object) -> PromptSubmitted:
    earlier = tuple(ChatMessage(role="user", content=f"m{i}") for i in range(history))
    return PromptSubmitted(conversation_id=CONV, request_id=rid, model="m",
                           messages=(ChatMessage(role="user", content=f"m{history}"),),
                           history=earlier or None, history_len=history,
                           history_end=history_end, **kw)  # type: ignore[arg-type]


# -- one turn at a time, decided by the log -----------------------------------------
def test_of_racing_turns_built_on_one_history_the_first_in_the_log_counts() -> None:
    ledger = TurnLedger()
    assert ledger.decide(CONV, "a", 10, 12).verdict is Verdict.ACCEPTED
    void = ledger.decide(CONV, "b", 10, 15)  # read the same history, appended later
    assert (void.verdict, void.rival) == (Verdict.VOID, "a")
    assert ledger.decide(CONV, "c", 10, 16).rival == "a"  # a void prompt never counts
    # A turn built after "a" was in the log (its history includes it) counts.
    assert ledger.decide(CONV, "d", 13, 20).verdict is Verdict.ACCEPTED


def test_an_idempotent_retry_racing_its_original_is_a_duplicate_not_a_rival() -> None:
    ledger = TurnLedger()
    assert ledger.decide(CONV, "a", 5, 6).verdict is Verdict.ACCEPTED
    assert ledger.decide(CONV, "a", 5, 7).verdict is Verdict.DUPLICATE
    assert ledger.decide(CONV, "b", 7, 9).verdict is Verdict.ACCEPTED  # dups are no rivals


def test_a_void_turn_retried_with_its_key_counts_once_its_rival_is_in_its_history() -> None:
    ledger = TurnLedger()
    ledger.decide(CONV, "a", 0, 1)
    assert ledger.decide(CONV, "b", 0, 2).verdict is Verdict.VOID
    assert ledger.decide(CONV, "b", 3, 4).verdict is Verdict.ACCEPTED


def test_verdicts_do_not_depend_on_other_conversations_or_on_asking_twice() -> None:
    ledger = TurnLedger()
    other = uuid.uuid4()
    ledger.decide(other, "x", 0, 1)
    assert ledger.decide(CONV, "a", 0, 2).verdict is Verdict.ACCEPTED
    assert ledger.decide(CONV, "b", 0, 3).verdict is Verdict.VOID
    assert ledger.decide(CONV, "b", 0, 3).verdict is Verdict.VOID  # same record again
    known = TurnLedger()  # one that learns "a" from the store gets the same answer
    known.know(CONV, 2, "a")
    assert known.decide(CONV, "b", 0, 3).rival == "a"


def test_the_gateway_view_and_the_projection_agree_on_void_prompts() -> None:
    view = ConversationView(CONV)
    first, racing = prompt("a", 4), prompt("b", 4)
    view.apply(first, 4)
    view.apply(racing, 6)
    assert list(view.turns) == ["a"] and view.void == {"b": "a"}
    assert [m.content for m in view.messages.values()] == ["m0"]
    assert project(racing, 6, Verdict.VOID) == []
    assert any("INTO messages" in w.sql for w in project(first, 4, Verdict.ACCEPTED))


def test_titles_and_storable_text_are_one_rule() -> None:
    assert storable("a\x00b") == "a\ufffdb"
    assert storable("a\ud800b") == "a\ufffdb"
    assert title("  many   words\nhere ") == "many words here"
    assert title("x" * 200) == "x" * 80 and title("   ") is None
    view = ConversationView(CONV)
    from schemas import SessionCreated
    view.apply(SessionCreated(conversation_id=CONV, request_id="s", title="  a\x00  b "), 0)
    conversation_row = project(SessionCreated(conversation_id=CONV, request_id="s",
                                              title="  a\x00  b "))[0]
    assert view.title == conversation_row.params[2] == "a\ufffd b"


# -- control events for turns that have not started ---------------------------------
def test_a_cancelled_or_abandoned_turn_never_starts() -> None:
    book = ControlBook()
    p = prompt("r", None)
    assert book.decide(p, NOW).start
    book.apply(GenerationCancelled(conversation_id=CONV, request_id="r"))
    assert not book.decide(p, NOW).start

    book = ControlBook()
    book.apply(ClientDetached(conversation_id=CONV, request_id="r", attachment="r",
                              grace_s=10, occurred_at=NOW))
    within = book.decide(p, NOW + timedelta(seconds=3))
    assert within.start and within.stop_at == NOW + timedelta(seconds=10)
    assert not book.decide(p, NOW + timedelta(seconds=11)).start
    assert book.decide(prompt("r", None, background=True), NOW + timedelta(hours=1)).start
    book.apply(ClientAttached(conversation_id=CONV, request_id="r", attachment="x"))
    assert book.decide(p, NOW + timedelta(seconds=11)) .start  # a client came back
    book.apply(SessionDeleted(conversation_id=CONV, request_id="d"))
    assert not book.decide(p, NOW).start


def test_the_grace_counts_from_when_the_log_had_the_departure() -> None:
    """Found by the outage suite: a client's departure written while every broker was
    down reached the log 30 s later, and its worker stopped the turn at once ("no client
    came back"), though no client could have come back before the log did."""
    p = prompt("r", None)
    book = ControlBook()
    book.apply(ClientDetached(conversation_id=CONV, request_id="r", attachment="r",
                              grace_s=10, occurred_at=NOW),
               logged_at=NOW + timedelta(seconds=30))
    later = book.decide(p, NOW + timedelta(seconds=31))
    assert later.start and later.stop_at == NOW + timedelta(seconds=40)
    assert stop_at(book, p) == NOW + timedelta(seconds=40)
    assert not book.decide(p, NOW + timedelta(seconds=41)).start
    book = ControlBook()  # a broker clock behind the gateway's never shortens the grace
    book.apply(ClientDetached(conversation_id=CONV, request_id="r", attachment="r",
                              grace_s=10, occurred_at=NOW), logged_at=NOW - timedelta(seconds=5))
    assert stop_at(book, p) == NOW + timedelta(seconds=10)


@pytest.mark.parametrize("host_ahead_s", [0, 30])
def test_a_grace_counts_in_the_brokers_time_whatever_the_workers_clock(
        host_ahead_s: int) -> None:
    """A grace is 10 s by default: a worker's clock 30 s ahead of the brokers that stamp
    a departure (``pipeline.kafka.clock`` reads how far) would stop a turn at once."""
    aborted: list[str] = []

    async def abort(request_id: str) -> None:
        aborted.append(request_id)

    async def run() -> None:
        flights = Flights(abort, lambda: -host_ahead_s)
        stamped = datetime.now(UTC) - timedelta(seconds=host_ahead_s)  # by the broker, now
        flights.book.apply(ClientDetached(conversation_id=CONV, request_id="r",
                                          attachment="r", grace_s=0.5, occurred_at=stamped),
                           logged_at=stamped)
        assert abs((flights.log_now() - stamped).total_seconds()) < 0.1
        flight = InFlight(("chat.prompts", 0), asyncio.create_task(asyncio.sleep(5)),
                          prompt("r", None))
        flights.add(flight, run=True)
        await asyncio.sleep(0.3)
        assert not flight.cancelled and aborted == []
        await asyncio.sleep(0.4)
        assert flight.cancelled and aborted == ["r"]
        flight.task.cancel()

    asyncio.run(run())


# -- a topic's records ---------------------------------------------------------------------
DEEP = b"[" * 100_000 + b"]" * 100_000
# Bytes anyone with a producer can put on a topic, where each reader below meets them.
RECORDS = [b"", b"\x00", b"\xff\xfe{}", b"null", b"[]", b"{}", b'"text"', b"1e999", DEEP,
           b'{"a": ' * 40 + b"1" + b"}" * 40,
           b'{"model": ' + DEEP + b"}", b'{"sealed": {"key": ' + DEEP + b"}}",
           b'{"orig": ' + DEEP + b"}", b'{"model": "m", "at": ' + DEEP + b"}",
           b'{"type": "PromptSubmitted", "messages": ' + DEEP + b"}",
           b'{"at": 1, "deltas": ' + DEEP + b"}"]


def _record(value: bytes, key: bytes | None = None) -> Record:
    return Record(Position("chat.any", 0, 7), key, value, 0)


# Each reader of a topic's records, and what it answers for a record that holds none.
READERS: dict[str, tuple[Callable[[bytes], object], object]] = {
    "parse": (parse, DecodeError),
    "parse_live": (parse_live, DecodeError),
    "decode_keyed": (CLEAR.decode_keyed, DecodeError),
    "decode_live": (CLEAR.decode_live, DecodeError),
    "sealed_key": (sealed_key, None),
    "sealed_key of a model": (lambda v: sealed_key(v, "m"), None),
    "names_model": (lambda v: names_model(v, "m"), False),
    "key_info": (lambda v: key_info(f"{uuid.uuid4()}/abc".encode(), v), ValueError),
    "heartbeat": (heartbeat_of, None),
    "rollout": (Rollout.model_validate_json, ValidationError),
    "rotation": (lambda v: Rotation.parse(_record(v)), None),
    "layout": (lambda v: layout_count(_record(v)), None),
}


@pytest.mark.parametrize("reader", READERS)
def test_every_reader_of_a_topic_refuses_what_no_record_of_it_holds(reader: str) -> None:
    """A record is anyone's bytes: each reader answers its own refusal (the consumer
    dead-letters or passes over the record), never another error. One that raised
    RecursionError for deep nesting (``sealed_key``) stopped a worker at each start."""
    read, refusal = READERS[reader]
    for value in RECORDS:
        if isinstance(refusal, type):
            with pytest.raises(refusal):
                read(value)
        else:
            assert read(value) == refusal, value[:60]


# -- the gateway's edge -------------------------------------------------------------------
@pytest.mark.parametrize(("body", "fragment"), [
    (b'{"seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested"),
    (b'{"a": ' * 40 + b"1" + b"}" * 40, "nested"),
    (b'{"stop": ["a\\u0000"]}', "NUL"),
    (b'{"messages": [{"content": "\\ud800"}]}', "surrogate"),
    (b'{"a\\u0000": 1}', "NUL"),
    (b"\xff\xfe{}", "not valid JSON"),
])
def test_hostile_json_is_a_400(body: bytes, fragment: str) -> None:
    with pytest.raises(APIError) as err:
        load_json(body)
    assert err.value.status == 400 and fragment in err.value.message


def test_text_rule_names_the_field() -> None:
    with pytest.raises(APIError) as err:
        check_text({"messages": [{"role": "user", "content": "x"}, {"content": "a\x00"}]})
    assert err.value.param == "messages[1].content"


@pytest.mark.parametrize("key", ["", " padded", "x" * 256, "é", "tab\tkey"])
def test_idempotency_keys_are_bounded(key: str) -> None:
    with pytest.raises(APIError):
        idempotency_key(key)
    assert idempotency_key("x" * 255) == "x" * 255 and idempotency_key(None) is None


def test_host_allow_list() -> None:
    loopback = ["localhost", "127.0.0.1", "::1"]
    assert host_allowed(host_name("127.0.0.1:8000"), loopback)
    assert host_allowed(host_name("[::1]:8000"), loopback)
    assert host_allowed(host_name("LOCALHOST"), loopback)
    assert not host_allowed(host_name("evil.example"), loopback)
    assert not host_allowed(host_name("127.0.0.1.evil.example:80"), loopback)
    assert host_allowed("api.example.com", ["*.example.com"])
    assert not host_allowed("example.com.evil", ["*.example.com"])


# -- event versions -------------------------------------------------------------------------
def test_unknown_fields_are_kept_and_old_versions_are_upcast() -> None:
    newer = (b'{"type":"PromptSubmitted","v":7,"conversation_id":"%s","request_id":"r",'
             b'"model":"m","messages":[{"role":"user","content":"x","lang":"en"}],'
             b'"priority":"high"}' % str(CONV).encode())
    event = CLEAR.decode(newer)
    assert isinstance(event, PromptSubmitted) and event.v == 7
    assert event.model_extra == {"priority": "high"}
    assert b'"priority":"high"' in CLEAR.encode(event) and b'"lang":"en"' in CLEAR.encode(event)
    older = (b'{"type":"PromptSubmitted","v":1,"conversation_id":"%s","request_id":"r",'
             b'"model":"m","messages":[{"role":"user","content":"x"}]}' % str(CONV).encode())
    upcast = CLEAR.decode(older)
    assert isinstance(upcast, PromptSubmitted)
    assert (upcast.v, upcast.history_end, upcast.alias, upcast.rollout) == (4, None, None, None)
    v2 = (b'{"type":"PromptSubmitted","v":2,"conversation_id":"%s","request_id":"r",'
          b'"model":"m","history_end":4,"messages":[{"role":"user","content":"x"}]}'
          % str(CONV).encode())
    routed = CLEAR.decode(v2)
    assert isinstance(routed, PromptSubmitted)
    assert (routed.v, routed.history_end, routed.model, routed.alias) == (4, 4, "m", None)
    # v3 repeats the session: its first history_len messages become the inline history.
    v3 = (b'{"type":"PromptSubmitted","v":3,"conversation_id":"%s","request_id":"r",'
          b'"model":"m","history_len":2,"messages":[{"role":"user","content":"a"},'
          b'{"role":"assistant","content":"b"},{"role":"user","content":"c"}]}'
          % str(CONV).encode())
    session = CLEAR.decode(v3)
    assert isinstance(session, PromptSubmitted)
    assert [m.content for m in session.history or ()] == ["a", "b"]
    assert [m.content for m in session.messages] == ["c"]
    assert (session.history_len, session.reply_seq, session.previous) == (2, 3, None)
    # A v3 prompt whose history_len leaves no new message is no prompt.
    with pytest.raises(DecodeError):
        CLEAR.decode(v3.replace(b'"history_len":2', b'"history_len":3'))
    # v1 starts and ends: their deltas are TokenDelta events beside them (no reference).
    start = (b'{"type":"GenerationStarted","v":1,"conversation_id":"%s","request_id":"r",'
             b'"model":"m","worker":"w","reply_seq":1,"prompt_tokens":3}' % str(CONV).encode())
    started = CLEAR.decode(start)
    assert isinstance(started, GenerationStarted) and (started.v, started.ref) == (2, None)
    with pytest.raises(DecodeError):
        CLEAR.decode(b'{"type":"PromptSubmitted","v":1}')


# -- what a worker does with a prompt -------------------------------------------------------
def test_a_prompt_is_skipped_ended_or_run_and_a_resumed_turn_carries_on() -> None:
    from schemas.live import Delta
    from workers.plan import Action, plan_start
    from workers.recovery import Recovered

    p = prompt("r", None)
    book = ControlBook()
    assert plan_start(p, None, True, book, NOW).action is Action.SKIP  # runs here already
    assert plan_start(p, Recovered(ended=True), False, book, NOW).action is Action.SKIP
    fresh = plan_start(p, None, False, book, NOW)
    assert fresh.action is Action.RUN and fresh.progress.attempt == 0
    earlier = Recovered(attempt=1, deltas={
        i: Delta(i, t, (i,)) for i, t in enumerate(["a", "b"])})
    resumed = plan_start(p, earlier, False, book, NOW)
    assert (resumed.action, resumed.progress.attempt, resumed.progress.parts,
            resumed.progress.token_ids) == (Action.RUN, 2, ["a", "b"], [0, 1])
    book.apply(GenerationCancelled(conversation_id=CONV, request_id="r"))
    ended = plan_start(p, earlier, False, book, NOW)
    assert (ended.action, ended.progress.parts) == (Action.END, ["a", "b"])

    book = ControlBook()
    assert stop_at(book, p) is None
    book.apply(ClientDetached(conversation_id=CONV, request_id="r", attachment="r",
                              grace_s=5, occurred_at=NOW))
    assert stop_at(book, p) == NOW + timedelta(seconds=5)
    assert stop_at(book, prompt("r", None, background=True)) is None


# -- a session's history, by reference ------------------------------------------------------
def test_the_history_a_prompt_names_is_what_the_gateway_read_and_an_auditor_rebuilds() -> None:
    """Turns that finish, fail, are cancelled with a partial reply (holding a NUL), and a
    void prompt between them: at each turn, the history the gateway read (its view,
    which the store's rows feed) and the one rebuilt from the durable record alone
    (``schemas.history``, as a worker and an auditor rebuild it) are the same messages,
    and the prompt's digest says so."""
    from pydantic import ValidationError

    from schemas import GenerationFailed, GenerationFinished, TurnRef, Usage
    from schemas.history import digest, session_inputs

    view = ConversationView(CONV)
    prompts: list[tuple[int, PromptSubmitted]] = []
    ends: dict[str, GenerationFinished | GenerationFailed] = {}
    replies = {"t1": ("stop", "first reply"), "t2": None, "t3": ("abort", "cut\x00 short")}
    prompt_offset, end_offset = 10, 40
    for rid, outcome in [*replies.items(), ("t4", None)]:
        history = view.history()
        previous = view.last_turn()
        prompt = PromptSubmitted(
            conversation_id=CONV, request_id=rid, model="m", history_end=prompt_offset,
            messages=(ChatMessage(role="user", content=f"asks {rid}"),),
            history_len=len(history), previous=previous if history else None,
            history_digest=digest(history) if history else None)
        assert (previous is None) == (not history)
        view.apply(prompt, prompt_offset)
        prompts.append((prompt_offset, prompt))
        # A racing prompt built on the same history is void: no turn, in no reading.
        racing = prompt.model_copy(update={"request_id": f"{rid}-racing"})
        view.apply(racing, prompt_offset + 1)
        prompts.append((prompt_offset + 1, racing))
        if rid == "t4":
            break
        end: GenerationFinished | GenerationFailed = GenerationFailed(
            conversation_id=CONV, request_id=rid, code="engine_dead", message="x") \
            if outcome is None else GenerationFinished(
                conversation_id=CONV, request_id=rid, model="m", reply_seq=prompt.reply_seq,
                finish_reason=outcome[0], text=outcome[1],  # type: ignore[arg-type]
                usage=Usage(prompt_tokens=1, completion_tokens=1), deltas=1, duration_ms=1)
        view.apply(end, end_offset)
        ends[rid] = end
        assert view.last_turn() == TurnRef(prompt=prompt_offset, end=end_offset)
        prompt_offset, end_offset = prompt_offset + 5, end_offset + 5
    inputs = session_inputs(prompts, ends)
    assert set(inputs) == {"t1", "t2", "t3", "t4"}  # the racing prompts are no turns
    given = inputs["t4"]
    assert given is not None and [(m.role, m.content) for m in given] == [
        ("user", "asks t1"), ("assistant", "first reply"), ("user", "asks t2"),
        ("user", "asks t3"), ("assistant", "cut\ufffd short"), ("user", "asks t4")]
    for _, prompt in prompts:
        rebuilt = inputs.get(prompt.request_id)
        if rebuilt is not None and prompt.history_len:
            assert digest(rebuilt[:prompt.history_len]) == prompt.history_digest
    # A prompt names its history once: inline or by its previous turn, never neither.
    for wrong in ({"history_len": 2},
                  {"history_len": 1, "previous": TurnRef(prompt=1, end=2),
                   "history": (ChatMessage(role="user", content="a"),)},
                  {"history_len": 2, "history": (ChatMessage(role="user", content="a"),)},
                  {"history_len": 0, "previous": TurnRef(prompt=1, end=2)}):
        with pytest.raises(ValidationError):
            PromptSubmitted(conversation_id=CONV, request_id="x", model="m",
                            messages=(ChatMessage(role="user", content="b"),),
                            **wrong)  # type: ignore[arg-type]


def test_a_session_whose_last_turn_cannot_be_placed_gives_its_history_inline() -> None:
    """A turn stored before its end's offset was (the store's rows of an earlier
    version) cannot be named: the next prompt carries the history inline, once."""
    from gateway.view import TurnState

    view = ConversationView(CONV)
    view.stored_turn(TurnState("old", "finished", "m", NOW, prompt_offset=3, end_offset=None))
    assert view.last_turn() is None
    view.stored_turn(TurnState("old", "finished", "m", NOW, prompt_offset=3, end_offset=9))
    assert view.last_turn() is not None and view.last_turn().prompt == 3  # type: ignore[union-attr]
