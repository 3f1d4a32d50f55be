"""The benchmarks' own parts: the pair bench's order and medians, the load
generator's reading of SSE, the paired serving bench's reports."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import pytest

from infra.process import free_port


def test_a_pair_bench_alternates_its_sides_and_gives_the_median_of_each_pairs_ratio() -> None:
    from bench import pair

    assert pair.order(3) == ["A", "B", "B", "A", "A", "B"]

    def point(broker: float, gateway: float, p99: float) -> dict[str, object]:
        return {"cpu_us_per_token": {"kafka broker": broker, "gateway": gateway,
                                     "load generator": 50.0},
                "ms": {"p50": p99 / 2, "p99": p99}, "kafka_hop_ms": {"p99": p99 / 3},
                "transactions_per_s": broker / 2, "gateway_transactions_per_s": gateway / 2,
                "live_records_per_s": broker * 3,
                "ttft_ms": {"p50": p99 + 50}}

    # Side B halves the broker in the first pair, costs it a quarter less in the second
    # and a third less in the third; the gateway is the same on both sides.
    brokers = [(100.0, 50.0), (80.0, 60.0), (90.0, 60.0)]
    runs = [{"side": side, "pair": i // 2,
             "figures": pair.figures(point(brokers[i // 2][side == "B"], 70.0, 40.0))}
            for i, side in enumerate(pair.order(3))]
    runs.append({"side": "A", "pair": 3, "figures": pair.figures(point(1.0, 1.0, 1.0))})
    summary = pair.summarise(runs)  # the unpaired last run counts in nothing
    assert summary["kafka broker"] == pytest.approx(
        {"A": 90.0, "B": 60.0, "ratio": 2 / 3, "least": 0.5, "most": 0.75})
    assert summary["gateway"]["ratio"] == summary["load generator"]["ratio"] == 1.0
    assert summary["total"]["A"] == 160.0 and summary["total"]["B"] == 130.0
    assert summary["p99 ms"]["ratio"] == 1.0
    assert "| kafka broker µs/token | 90.0 | 60.0 | 0.67x (0.50 - 0.75) |" in pair.table(summary)
    assert "| transactions/s | 45.0 | 30.0 | 0.67x (0.50 - 0.75) |" in pair.table(summary)
    assert "| gateway transactions/s | 35.0 | 35.0 | 1.00x (1.00 - 1.00) |" in pair.table(summary)
    assert "| ttft p50 ms | 90.0 | 90.0 | 1.00x (1.00 - 1.00) |" in pair.table(summary)


@pytest.mark.parametrize(("argv", "code", "said"), [
    (["pair"], 1, "the sides are the same"),
    (["capacity", "--b-env", "WORKER_TRANSACTION_INTERVAL_MS=10"], 1,
     "are for pipeline bench pair"),
    (["pair", "--b-env", "WORKER_TRANSACTION_INTERVAL_MS"], 2, "expected NAME=VALUE"),
    (["pair", "--b-env", "A=1", "--rate", "0"], 2, "above 0 and at most 1000"),
    (["pair", "--b-env", "A=1", "--label", "../elsewhere"], 2, "letters, digits"),
    (["pair", "--b-tree", "/"], 2, "not a checkout of this project"),
    (["pair", "--b-python", "/nonexistent/python"], 2, "not an executable file"),
    (["pair", "--b-python", "/bin/true"], 2, "cannot run this project (it is not a Python)"),
    (["capacity", "--a-python", sys.executable], 1, "are for pipeline bench pair"),
    (["capacity", "--streams", "64"], 1, "are for pipeline bench pair"),
    (["pair", "--b-env", "A=1", "--streams", "0"], 2, "--streams"),
    (["capacity", "--rate", "50"], 1, "are for pipeline bench pair"),
    (["worker", "--b-env", "A=1"], 1, "compares checkouts only"),
    (["worker", "capacity", "--streams", "8"], 1, "are for pipeline bench pair"),
])
def test_a_pair_bench_given_what_it_cannot_run_says_why_and_runs_nothing(
        argv: list[str], code: int, said: str) -> None:
    done = subprocess.run([sys.executable, "-m", "launch", "bench", *argv], timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == code and said in done.stderr, done.stderr


def test_the_worker_bench_pairs_its_sides_and_reports_each_figures_median_ratio() -> None:
    from bench import worker

    def figures(worker_us: float, live: float) -> dict[str, float]:
        return {"tokens_per_s": 25_000.0, "worker_us_per_token": worker_us,
                "worker_cores": worker_us * 0.025, "broker_us_per_token": 20.0,
                "transactions_per_s": 40.0, "live_records_per_s": live}

    runs = [("A", 0, figures(34.0, 600.0)), ("B", 0, figures(20.0, 300.0)),
            ("B", 1, figures(21.0, 300.0)), ("A", 1, figures(30.0, 0.0)),
            ("A", 2, figures(1.0, 1.0))]  # an unpaired last run counts in no ratio
    summary = worker.summarise(runs)
    assert summary["worker_us_per_token"] == pytest.approx(
        {"A": 30.0, "B": 20.5, "ratio": (20 / 34 + 21 / 30) / 2, "least": 20 / 34,
         "most": 21 / 30})
    assert summary["live_records_per_s"]["ratio"] == 0.5  # a side without the counter: no ratio
    table = worker.table({"summary": summary})
    assert "| worker µs/token | 30.0 | 20.5 | 0.64x (0.59 - 0.70) |" in table
    assert "| 256 x 100 | 25,000 | 34.0 |" in worker.table(
        {"streams": 256, "rate": 100.0, **figures(34.0, 600.0)})


def test_the_load_generator_reads_sse_messages_split_anyhow_and_times_each_by_its_last_read(
) -> None:
    """The bench's client keeps each socket read with its time and parses after the run:
    a message is timed by the read that completed it, whatever the split (CRLF too)."""
    from aiohttp import web

    from bench.loadgen import http_client, run_load, stream_once

    def data(payload: str, event_id: str | None = None) -> bytes:
        with_id = f',"event_id":"{event_id}"' if event_id else ""
        return f'data: {{"choices":[{{"delta":{{"content":"{payload}"}}}}]{with_id}}}'.encode()

    usage = b'data: {"choices":[],"usage":{"completion_tokens":2}}'
    writes = [data("", "0-1") + b"\n\n" + data("t0 ", "0-2")[:20],  # role, half a token
              data("t0 ", "0-2")[20:] + b"\r\n\r\n" + data("t1 ", "0-3") + b"\r",
              b"\n\r\n" + usage + b"\n\n",  # a CRLF blank line split across reads
              b"data: [DONE]\n\n"]

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in writes:
            await resp.write(chunk)
            await asyncio.sleep(0.05)  # each write its own read
        return resp

    async def scenario() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", sse)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with http_client(2) as client:
                load = await run_load(lambda _i: stream_once(
                    client, f"http://127.0.0.1:{port}", {}, keep_ids=True), 1, 1)
        finally:
            await runner.cleanup()
        (request,) = load.requests
        assert request.error is None and request.reads is None  # parsed, and let go
        assert request.text == ["", "t0 ", "t1 "] and request.tokens == 2
        ids = [event_id for event_id, _ in request.arrivals]
        times = [at for _, at in request.arrivals]
        assert ids == ["0-1", "0-2", "0-3"]
        # "0-2" was completed by the second read, "0-3" by the third, ~50 ms apart each.
        assert times[1] - times[0] > 0.03 and times[2] - times[1] > 0.03
        assert request.first == times[1]  # the first content, not the role chunk
        assert request.ended is not None and request.ended - times[2] > 0.03

    asyncio.run(scenario())


def test_a_stream_the_load_generator_read_without_its_done_is_an_error() -> None:
    from bench.loadgen import Request

    cut = Request(0.0, reads=[(1.0, b'data: {"choices":[{"delta":{"content":"t0 "}}]}\n\n')])
    cut.parse()
    assert cut.error == "no [DONE]" and cut.first == 1.0
    untimed = Request(0.0, ended=2.0)  # not an SSE stream (an engine's own request)
    untimed.parse()
    assert untimed.error is None


def test_a_paired_serving_bench_says_each_pair_as_it_ends(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import loadgen, serving
    from bench.loadgen import Request

    monkeypatch.setattr(serving, "SETTLE_S", 0.0)
    # The load generator's clock is the fakes' own: each request takes 10 ms of it, so
    # both sides' rounds last alike and the ratio is their tokens' alone, however busy
    # the host (wall time made it flaky).
    clock = [0.0]
    monkeypatch.setattr(loadgen, "time", SimpleNamespace(
        perf_counter=lambda: clock[0], process_time=time.process_time))

    def maker(tokens: int) -> Callable[[int], Awaitable[Request]]:
        async def one(_seed: int) -> Request:
            sent = clock[0]
            clock[0] += 0.01
            await asyncio.sleep(0)
            return Request(sent, first=sent + 0.005, ended=sent + 0.01, tokens=tokens)
        return one

    out = asyncio.run(serving.paired(maker(10), maker(5), [1, 2], quick=True, per_client=2,
                                     names=("engine", "worker")))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("serving:")]
    assert [line.split(":")[1] for line in lines] == [
        f" worker / engine at {c} clients, pair {i} of 3" for c in (1, 2) for i in (1, 2, 3)]
    assert all(line.endswith("%") for line in lines)
    assert out.ratios == [[pytest.approx(0.5)] * 3] * 2  # 5 / 10 tokens


def test_the_in_process_benches_run_through_the_code_they_measure() -> None:
    """``pipeline bench hotpath`` and ``sealing`` drive the worker's own output: a bench
    that no test runs broke unseen when that output changed."""
    import math

    from bench import hotpath, sealing
    from workers.output import GATHER_PASSES

    takers, output, writer = hotpath._takers(4, 2)

    async def one_step() -> None:
        for taker in takers:
            taker.take("a ", (1,), 3, None)
        for _ in range(GATHER_PASSES):  # the step's records made
            await asyncio.sleep(0)

    asyncio.run(one_step())
    assert (output.records, writer.records) == (2, 2 + 4)  # a record per partition; starts
    figures = hotpath.run(True, turns=8, steps=3)
    assert math.isfinite(figures["us_per_token"]) and figures["us_per_token"] > 0
    assert "| 8 | 3 | 6 |" in hotpath.table(figures)
    cases = sealing.run(True)["cases"]
    assert set(cases) == set(sealing.CASES)
    assert all(math.isfinite(case["sealed_us_per_token"]) for case in cases.values())
