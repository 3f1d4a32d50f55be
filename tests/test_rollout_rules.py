"""Rollouts' pure rules (``schemas.rollout``): routing a share of conversations, the
health check and its fold, which of two rollouts goes on."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from schemas import (
    ChatMessage,
    GenerationFailed,
    GenerationFinished,
    PromptSubmitted,
    Usage,
)
from schemas.rollout import (
    Figures,
    Health,
    HealthPolicy,
    Rollout,
    judge,
    newer_rollout,
    route,
    stale,
)


def _rollout(share: float, status: str = "running") -> Rollout:
    return Rollout(alias="chat", id="r1", stable="chat-v1", candidate="chat-v2",
                   share=share, status=status, started_at=0, updated_at=0)  # type: ignore[arg-type]


def test_a_rollout_sends_its_share_of_conversations_and_each_keeps_its_version() -> None:
    book = {"chat": _rollout(0.25)}
    live = {"chat-v1", "chat-v2"}
    conversations = [uuid.uuid4() for _ in range(4000)]
    picked = [route(book, "chat", c, live)[0] for c in conversations]
    assert 0.22 < picked.count("chat-v2") / len(picked) < 0.28
    assert [route(book, "chat", c, live)[0] for c in conversations] == picked  # sticky
    # No live candidate, or the rollout over: the stable version; no alias: the name itself.
    assert {route(book, "chat", c, {"chat-v1"})[0] for c in conversations} == {"chat-v1"}
    ended = {"chat": _rollout(0.25, "rolled_back")}
    assert {route(ended, "chat", c, live)[0] for c in conversations} == {"chat-v1"}
    assert route(book, "other", conversations[0], live) == ("other", None)


def test_the_health_check_compares_failures_and_ttft_with_the_old_version() -> None:
    policy = HealthPolicy(turns=10)
    old = Figures(turns=100, failures=1, ttft_p99_ms=80.0)
    assert judge(old, Figures(turns=10, failures=0, ttft_p99_ms=150.0), policy)[0]
    slow = judge(old, Figures(turns=10, failures=0, ttft_p99_ms=3000.0), policy)
    assert not slow[0] and "TTFT p99 3000 ms" in slow[1]
    failing = judge(old, Figures(turns=10, failures=1, ttft_p99_ms=80.0), policy)
    assert not failing[0] and "failure rate 10.0%" in failing[1]
    assert judge(Figures(), Figures(turns=10, ttft_p99_ms=80.0), policy)[0]


def test_the_health_fold_counts_each_turn_once_by_the_version_its_prompt_names() -> None:
    health = Health({"chat-v1", "chat-v2"})
    conv = uuid.uuid4()
    ids = {"conversation_id": conv}
    for rid, model in (("a", "chat-v1"), ("b", "chat-v2"), ("c", "chat-v2"), ("d", "x")):
        health.add(PromptSubmitted(**ids, request_id=rid, model=model,
                                   messages=(ChatMessage(role="user", content="hi"),)))
    end = {"reply_seq": 1, "text": "", "usage": Usage(prompt_tokens=1, completion_tokens=0),
           "deltas": 0, "duration_ms": 5.0}
    health.add(GenerationFinished(**ids, request_id="a", model="chat-v1", finish_reason="stop",
                                  ttft_ms=40.0, **end))
    health.add(GenerationFinished(**ids, request_id="b", model="chat-v2", finish_reason="stop",
                                  ttft_ms=90.0, **end))
    health.add(GenerationFailed(**ids, request_id="c", code="engine_dead", message="x"))
    health.add(GenerationFailed(**ids, request_id="d", code="engine_dead", message="x"))
    figures = health.figures()
    assert figures["chat-v1"] == Figures(turns=1, failures=0, ttft_p99_ms=40.0)
    assert figures["chat-v2"] == Figures(turns=2, failures=1, ttft_p99_ms=90.0)


def test_rollout_refuses_a_model_name_it_could_not_store_before_calling_kafka() -> None:
    env = {**os.environ, "PIPELINE_KAFKA_BOOTSTRAP": "127.0.0.1:1"}  # nothing listens there
    for args in (["a" * 201, "--to", "b"], ["chat", "--to", "v\x1b"]):
        done = subprocess.run([sys.executable, "-m", "launch", "rollout", *args],
                              capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 2 and "1 to 200 printable characters" in done.stderr


def test_of_two_rollouts_started_at_once_exactly_one_goes_on() -> None:
    """Each command watching a rollout stands down when it sees a rollout of its alias
    started after its own; progress records it wrote since do not hide that rollout."""
    def record(rid: str, started: float, updated: float) -> Rollout:
        return Rollout(alias="chat", id=rid, stable="v1", candidate="v2", share=0.5,
                       started_at=started, updated_at=updated)

    a, b = record("a", 100.0, 100.0), record("b", 100.0, 100.0)  # the same instant
    a_later = record("a", 100.0, 105.0)  # a's progress, written after b's start
    history = [a, b, a_later]
    assert newer_rollout(history, a) == b and newer_rollout(history, b) is None
    older = record("old", 50.0, 50.0)
    assert newer_rollout([older, a], a) is None
    assert newer_rollout([older, a], older) == a


def test_a_rollouts_end_stands_against_progress_written_after_it() -> None:
    """A watching command's progress record, written just after an operator's abort,
    does not set the rollout running again; a new rollout's records are not stale."""
    running = Rollout(alias="chat", id="a", stable="v1", candidate="v2", share=0.5,
                      started_at=100.0, updated_at=100.0)
    ended = running.model_copy(update={"status": "rolled_back", "updated_at": 104.0})
    progress = running.model_copy(update={"updated_at": 105.0})
    assert stale(ended, progress)
    assert not stale(running, progress) and not stale(running, ended) and not stale(None, running)
    assert not stale(ended, progress.model_copy(update={"id": "b"}))
