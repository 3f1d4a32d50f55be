"""A gateway's call to Kafka (``gateway.dependencies.from_log``): refused by a partition's
former leader (a broker paused or restarted, so the client's idea of the leader is out
of date), it is asked again and answered, not turned into a 503 for the client. Found by
SIGSTOPping the demo's broker for 25 s under load: a retrieve 10 s after it resumed got
``FENCED_LEADER_EPOCH`` from a ListOffsets, and its client a 503 ``log_unavailable``."""

from __future__ import annotations

import asyncio

import pytest
from confluent_kafka import KafkaError

from gateway.dependencies import KAFKA, from_log
from gateway.problems import LogUnavailable
from pipeline.kafka import KafkaException


def refusal(code: int) -> KafkaException:
    return KafkaException(KafkaError(code, "Failed to get offsets"))


def test_a_call_a_former_leader_refused_is_asked_again() -> None:
    calls: list[int] = []

    async def ends() -> dict[int, int]:
        calls.append(len(calls))
        if len(calls) < 3:
            raise refusal(KafkaError.FENCED_LEADER_EPOCH)
        return {0: 42}

    assert asyncio.run(from_log(ends, 5.0)) == {0: 42}
    assert len(calls) == 3 and not KAFKA.open


@pytest.mark.parametrize("code", [KafkaError.TOPIC_AUTHORIZATION_FAILED,
                                  KafkaError.UNKNOWN_TOPIC_OR_PART])
def test_any_other_refusal_is_answered_at_once(code: int) -> None:
    calls: list[int] = []

    async def ends() -> dict[int, int]:
        calls.append(len(calls))
        raise refusal(code)

    with pytest.raises(LogUnavailable):
        asyncio.run(from_log(ends, 5.0))
    assert len(calls) == 1 and not KAFKA.open


def test_a_leader_that_never_comes_is_a_refusal_within_the_timeout() -> None:
    async def ends() -> dict[int, int]:
        raise refusal(KafkaError.LEADER_NOT_AVAILABLE)

    async def timed() -> float:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(LogUnavailable):
            await from_log(ends, 0.5)
        return loop.time() - began

    try:
        assert 0.5 <= asyncio.run(timed()) < 1.5
        assert KAFKA.open  # a leader gone that long: later calls are refused at once
    finally:
        KAFKA.close()
