"""vLLM's front end in a process of its own: the child a worker's ``VllmProcess`` starts
(``python -m workers.vllm_frontend``; the protocol is in ``workers.vllm_process``).

It holds the worker's ``VllmEngine`` (``AsyncLLM``, the chat template, the pump) and
runs each attempt the worker sends on it. The outputs its pump hands out in one pass,
a step's for every request, go to the worker as one frame. It ends when its input
does (the worker closed it, or died) or its engine dies, and shuts its engine down
then. It leads a process group of its own (see ``VllmProcess``): Ctrl-C at a terminal
reaches the worker, which closes this process's input.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from workers.engine import EngineDead, EngineRejected, EngineRequest, EngineSettingsRefused
from workers.vllm_engine import VllmEngine, engine_nice, isolate_engine_cores
from workers.vllm_process import FRAME_BUFFER_BYTES, frame, pipe_reader, read_frame

log = logging.getLogger(__name__)
# How often the front end looks for its engine's death while no command comes.
DEATH_CHECK_S = 0.5


class _Frames(asyncio.Protocol):
    """The pipe to the worker: whether it has taken what was written (its reader paces
    the engine by not reading)."""

    def __init__(self) -> None:
        self.taken = asyncio.Event()
        self.taken.set()

    def pause_writing(self) -> None:
        self.taken.clear()

    def resume_writing(self) -> None:
        self.taken.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.taken.set()


class Frontend:
    """Runs the worker's attempts on ``engine``; batches their outputs into frames."""

    def __init__(self, engine: VllmEngine, out: asyncio.WriteTransport, frames: _Frames
                 ) -> None:
        self._engine, self._out, self._frames = engine, out, frames
        self._batch: list[tuple[object, ...]] = []
        self._tasks: dict[int, tuple[str, asyncio.Task[None]]] = {}  # n -> request id, run
        self._latest: dict[str, asyncio.Task[None]] = {}  # request id -> its last attempt's
        self._aborting: set[asyncio.Task[None]] = set()
        engine.pace(self._pace)

    def _pace(self) -> Coroutine[Any, Any, None] | None:
        return None if self._frames.taken.is_set() else self._taken()

    async def _taken(self) -> None:
        await self._frames.taken.wait()

    def _put(self, entry: tuple[object, ...]) -> None:
        if not self._batch:
            asyncio.get_running_loop().call_soon(self._flush)
        self._batch.append(entry)

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        if not self._out.is_closing():
            self._out.write(frame((self._engine.kv_cache_usage(), batch)))

    def handle(self, command: tuple[object, ...]) -> None:
        kind, n = command[0], command[1]
        assert isinstance(n, int)
        if kind == "run":
            request = command[2]
            assert isinstance(request, EngineRequest)
            before = self._latest.get(request.request_id)
            task = asyncio.create_task(self._attempt(n, request, before))
            self._tasks[n] = (request.request_id, task)
            self._latest[request.request_id] = task
        elif (running := self._tasks.get(n)) is not None:
            request_id, task = running
            if kind == "cancel":
                task.cancel()
            elif kind == "abort":
                aborting = asyncio.create_task(self._engine.abort(request_id))
                self._aborting.add(aborting)
                aborting.add_done_callback(self._aborting.discard)

    async def _attempt(self, n: int, request: EngineRequest,
                       before: asyncio.Task[None] | None) -> None:
        error: tuple[str, ...] | None = None
        try:
            if before is not None:  # the same turn's stopped attempt: gone from vLLM first
                await asyncio.wait([before])

            def sink(text: str, token_ids: tuple[int, ...], prompt_tokens: int,
                     finish_reason: str | None) -> None:
                self._put((n, text, token_ids, prompt_tokens, finish_reason))

            await self._engine.run(request, sink)
        except asyncio.CancelledError:
            return  # the worker stopped waiting for it: nothing to say
        except EngineRejected as exc:
            error = ("rejected", exc.code, str(exc))
        except EngineDead as exc:
            error = ("dead", str(exc), *(("before",) if exc.before else ()))
        except Exception as exc:
            error = ("failed", f"{type(exc).__name__}: {exc}")
        finally:
            del self._tasks[n]
            if self._latest.get(request.request_id) is asyncio.current_task():
                del self._latest[request.request_id]
        self._put((n, error))

    async def close(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def serve(out_fd: int) -> None:
    loop = asyncio.get_running_loop()
    reader, _ = await pipe_reader(sys.stdin.buffer)
    settings, model_path, model_name = await read_frame(reader)
    out = os.fdopen(out_fd, "wb", buffering=0)
    try:
        engine = VllmEngine(settings, Path(model_path), model_name)
    except EngineSettingsRefused as exc:
        out.write(frame(("refused", str(exc))))
        return
    except Exception as exc:
        out.write(frame(("failed", f"{type(exc).__name__}: {exc}")))
        raise
    try:
        out.write(frame(("ready", {
            "max_num_seqs": engine.max_num_seqs, "max_model_len": engine.max_model_len,
            "max_token_bytes": engine.max_token_bytes, "nice": engine_nice(settings),
            "isolate": isolate_engine_cores(settings)})))
        frames = _Frames()
        transport, _ = await loop.connect_write_pipe(lambda: frames, out)
        transport.set_write_buffer_limits(high=FRAME_BUFFER_BYTES)
        frontend = Frontend(engine, transport, frames)
        reading: asyncio.Future[Any] | None = None
        try:
            while True:
                reading = reading or asyncio.ensure_future(read_frame(reader))
                if not (await asyncio.wait([reading], timeout=DEATH_CHECK_S))[0]:
                    # An engine that died while idle ends this process too: the worker
                    # sees its pipe close, and exits before it starts a turn on it.
                    if (dead := engine.dead()) is not None:
                        log.error("%s: the front end exits", dead)
                        return
                    continue
                try:
                    command = reading.result()
                except asyncio.IncompleteReadError:
                    return  # the worker closed its end, or died
                reading = None
                frontend.handle(command)
        finally:
            if reading is not None:
                reading.cancel()
            await frontend.close()
    finally:
        engine.close()


def main() -> None:
    # Frames go to the worker on what was this process's stdout; whatever else prints
    # there (vLLM, its libraries) goes to stderr, the worker's log.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    from pipeline.logs import log_format, setup_logging

    setup_logging(os.environ.get("PIPELINE_LOG_LEVEL", "INFO"), log_format())
    with contextlib.suppress(EOFError):
        asyncio.run(serve(out_fd))


if __name__ == "__main__":
    main()
