"""The vLLM engine with its front end in a process of its own (``WORKER_VLLM_FRONTEND``:
by default, unless vLLM is a CPU build; see ``front_end_apart``).

vLLM's ``AsyncLLM`` turns its engine core's outputs into per-request outputs in the
process that holds it: for each request each step, its detokeniser, its stop strings, a
``RequestOutput`` and its stats. On this CPU that is 9-13 µs a token, on top of the
worker's own 20 (docs/benchmarks/history.md), in one process and under one GIL. Here
a child process (``workers.vllm_frontend``) holds ``AsyncLLM`` and the worker's own
``VllmEngine`` pump, and sends each step's outputs for every request it runs as one
frame; the worker reads a frame a step and hands each output to its turn's sink.

The pipe carries length-prefixed pickles between a parent and the child it started,
both this code. Each run is an *attempt*, numbered by the parent: a turn's next attempt
(same request id) is never confused with what its stopped one still sends.

- parent → child: ``(settings, model path, model name)`` once, then ``("run", n,
  EngineRequest)``, ``("cancel", n)`` (the caller stopped waiting), ``("abort", n)``
  (``Engine.abort``: it ends ``abort``); end of input: shut down.
- child → parent: ``("ready", limits)`` or ``("failed", message)`` once, then frames of
  ``(kv cache usage, entries)``, an entry being an output ``(n, text, token ids,
  prompt tokens, finish reason)`` or an attempt's end ``(n, error)``: None, or
  ``("rejected", code, message)``, ``("dead", message)`` (``"before"`` after it: the
  engine had died before the attempt reached it), ``("failed", message)``. The child
  exits when its engine dies, idle or not.

While the worker paces the engine (``Engine.pace``) it reads no frame; the child's
writes then back up to ``FRAME_BUFFER_BYTES`` and pace its own pump, whose collectors
merge what comes meanwhile, as in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from workers.engine import (
    EngineDead,
    EngineRejected,
    EngineRequest,
    EngineSettingsRefused,
    Pace,
    Sink,
    StallWatch,
    unpaced,
)
from workers.host import lower_session_priority, move_off_engine_cores, set_affinity
from workers.settings import WorkerSettings
from workers.vllm_engine import vllm_cpu_build

log = logging.getLogger(__name__)
_HEAD = struct.Struct(">I")
# How many bytes of frames the child buffers before its pump waits for the worker.
FRAME_BUFFER_BYTES = 4 * 2**20
# How long the child gets to shut its engine down once told to, before it is killed.
CLOSE_TIMEOUT_S = 30.0


def front_end_apart(settings: WorkerSettings) -> bool:
    """Whether vLLM's front end runs in a process of its own (``WORKER_VLLM_FRONTEND``):
    by default, unless vLLM is a CPU build. There the model computes on the host's cores,
    and a second process's CPU comes out of the model's: on 2 cores, the worker's tokens
    per second over the engine's fell from 78% to 39% at 8 clients and from 57% to 50%
    at 32 (``pipeline bench serving``, docs/benchmarks/history.md)."""
    if settings.vllm_frontend != "auto":
        return settings.vllm_frontend == "process"
    return not vllm_cpu_build()


def frame(message: object) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEAD.pack(len(body)) + body


def read_frame_blocking(pipe: IO[bytes]) -> Any:
    """The next frame from ``pipe``, blocking; EOFError when it closed first."""
    head = _read_exactly(pipe, _HEAD.size)
    return pickle.loads(_read_exactly(pipe, _HEAD.unpack(head)[0]))


def _read_exactly(pipe: IO[bytes], n: int) -> bytes:
    parts, left = [], n
    while left:
        part = pipe.read(left)
        if not part:
            raise EOFError
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame from ``reader``; ``asyncio.IncompleteReadError`` at its end."""
    head = await reader.readexactly(_HEAD.size)
    return pickle.loads(await reader.readexactly(_HEAD.unpack(head)[0]))


async def pipe_reader(pipe: IO[bytes]) -> tuple[asyncio.StreamReader, asyncio.ReadTransport]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**30)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), pipe)
    return reader, transport


@dataclass(slots=True)
class _Attempt:
    sink: Sink
    ended: asyncio.Future[None]


def _ended(error: tuple[str, ...] | None) -> BaseException | None:
    """What an attempt's end, as the child sent it, raises here."""
    if error is None:
        return None
    kind, *rest = error
    if kind == "rejected":
        return EngineRejected(rest[0], rest[1])
    if kind == "dead":
        return EngineDead(rest[0], before="before" in rest[1:])
    return RuntimeError(rest[0])


class VllmProcess:
    """The worker's ``Engine``: vLLM and its front end in a child process."""

    def __init__(self, settings: WorkerSettings, model_path: Path, model_name: str) -> None:
        self.model_name = model_name
        self._cores = os.sched_getaffinity(0)
        self._writer: asyncio.WriteTransport | None = None
        self._reader: asyncio.StreamReader | None = None
        self._read_pipe: asyncio.ReadTransport | None = None
        self._connecting: asyncio.Future[asyncio.WriteTransport] | None = None
        self._reading: asyncio.Task[None] | None = None
        self._watching: asyncio.Task[None] | None = None
        self._pidfd: int | None = None  # readable once the child has exited
        self._watched_on: asyncio.AbstractEventLoop | None = None
        # Watches the child, which its own ``VllmEngine`` cannot: a stopped front end.
        # The child's engine watches vLLM as in one process, and says why first when it
        # is vLLM's engine core that stalled; whichever sees the stall first, the
        # requests fail with ``EngineDead`` and the worker exits.
        self.stalls = StallWatch(settings.engine_stall_s)
        # A process group of its own, with vLLM's processes under it: vLLM's engine core
        # outlives a front end that is killed, and this one's end ends them all
        # (``_end_group``). Signals for this worker's group (Ctrl-C) are this process's
        # to act on: it closes the child's input.
        self._proc = subprocess.Popen([sys.executable, "-m", "workers.vllm_frontend"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                      process_group=0)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(frame((settings, str(model_path), model_name)))
            kind, said = read_frame_blocking(self._proc.stdout)
        except (EOFError, OSError):
            code = self._proc.wait()
            self._end_group()
            raise RuntimeError(f"vLLM's front-end process exited (code {code}) before it "
                               "was ready: its log is above") from None
        if kind != "ready":
            self._stop()
            if kind == "refused":
                raise EngineSettingsRefused(said)
            raise RuntimeError(f"vLLM's front-end process could not start vLLM: {said}")
        self.max_num_seqs: int = said["max_num_seqs"]
        self.max_model_len: int = said["max_model_len"]
        self.max_token_bytes: int | None = said["max_token_bytes"]
        if said["nice"] and lower_session_priority(os.getpid(), said["nice"]):
            log.info("this worker's session (autogroup) lowered in CPU priority by %d",
                     said["nice"])
        if said["isolate"]:
            move_off_engine_cores(os.getpid())
        log.info("vLLM's front end runs in process %d", self._proc.pid)
        self._attempts: dict[int, _Attempt] = {}
        self._numbers: dict[str, int] = {}  # request id -> its running attempt
        self._next = 0
        self._kv: float | None = None
        self._pace: Pace = unpaced
        self._dead: EngineDead | None = None

    @property
    def pid(self) -> int:
        """The front-end process's."""
        return self._proc.pid

    def running(self) -> int:
        return len(self._attempts)

    def dead(self) -> EngineDead | None:
        """Known once the child has exited (it exits when its engine dies, idle or not)."""
        return self._dead

    def pace(self, wait: Pace) -> None:
        self._pace = wait

    def kv_cache_usage(self) -> float | None:
        return self._kv

    async def _connected(self) -> asyncio.WriteTransport:
        """The pipe to the child, on this event loop (connected by the first caller only),
        and its reader running."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        writer = await asyncio.shield(self._connecting)
        if self._reading is None or self._reading.done():
            self._reading = asyncio.create_task(self._read(), name="vllm-frontend-reader")
        return writer

    async def _connect(self) -> asyncio.WriteTransport:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        loop = asyncio.get_running_loop()
        self._reader, self._read_pipe = await pipe_reader(self._proc.stdout)
        self._writer, _ = await loop.connect_write_pipe(asyncio.Protocol, self._proc.stdin)
        with contextlib.suppress(OSError, AttributeError):  # Linux 5.3 and later
            self._pidfd = os.pidfd_open(self._proc.pid)
            loop.add_reader(self._pidfd, self._exited)
            self._watched_on = loop
        return self._writer

    def _exited(self) -> None:
        """The child exited: what vLLM left of its group goes too. (A process forked
        from it holds its end of the pipe: the pipe's end alone would not come.)"""
        self._unwatch()
        self._end_group()

    def _unwatch(self) -> None:
        if self._pidfd is not None and self._watched_on is not None:
            self._watched_on.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def _stalled(self, quiet: float) -> None:
        """Kill the child (``StallWatch``): its requests then fail with ``EngineDead``,
        and the worker exits, its partitions going to a worker that serves them."""
        self._dead = EngineDead(
            f"vLLM's front end handed out nothing for {quiet:.0f} s with "
            f"{len(self._attempts)} requests running (WORKER_ENGINE_STALL_S): killed")
        log.error("%s", self._dead)
        self._proc.kill()

    def _send(self, message: object) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(frame(message))

    async def run(self, request: EngineRequest, sink: Sink) -> None:
        if self._dead is not None:
            raise self._dead.raised_before()
        writer = await self._connected()
        n, self._next = self._next, self._next + 1
        attempt = _Attempt(sink, asyncio.get_running_loop().create_future())
        if not self._attempts:
            self.stalls.heard()  # quiet while idle is no stall
        self._attempts[n] = attempt
        self._numbers[request.request_id] = n
        if self._watching is None or self._watching.done():
            self._watching = asyncio.create_task(
                self.stalls.watch(self.running, self._stalled), name="vllm-frontend-watch")
        try:
            writer.write(frame(("run", n, request)))
            await attempt.ended
        except BaseException:  # cancelled, or its sink raised: the child stops it
            self._send(("cancel", n))
            raise
        finally:
            del self._attempts[n]
            if self._numbers.get(request.request_id) == n:
                del self._numbers[request.request_id]

    async def _read(self) -> None:
        """Each frame's outputs to their sinks, then the pace. If it fails, every attempt
        it serves fails with it, and the next ``run`` reads on."""
        try:
            await self._read_frames()
        except asyncio.IncompleteReadError:
            code = await asyncio.to_thread(self._proc.wait)
            self._end_group()
            if self._dead is None:
                self._dead = EngineDead(f"vLLM's front-end process exited (code {code})")
                log.error("%s: its running requests fail with it", self._dead)
            self._fail_all(self._dead)
        except Exception as exc:
            log.exception("reading vLLM's front end failed: its running requests fail")
            self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for attempt in list(self._attempts.values()):
            if not attempt.ended.done():
                attempt.ended.set_exception(exc)

    async def _read_frames(self) -> None:
        assert self._reader is not None
        attempts, stalls = self._attempts, self.stalls
        while True:
            self._kv, entries = await read_frame(self._reader)
            stalls.heard()
            for entry in entries:
                attempt = attempts.get(entry[0])
                if attempt is None or attempt.ended.done():
                    continue  # an attempt its caller stopped: what it still sent
                ended = attempt.ended
                if len(entry) == 2:
                    error = _ended(entry[1])
                    if error is None:
                        ended.set_result(None)
                    else:
                        ended.set_exception(error)
                    continue
                try:
                    attempt.sink(entry[1], entry[2], entry[3], entry[4])
                except Exception as exc:  # its sink's: that request's
                    ended.set_exception(exc)
            wait = self._pace()
            if wait is not None:
                await stalls.paced(wait)

    async def abort(self, request_id: str) -> None:
        n = self._numbers.get(request_id)
        if n is not None:
            self._send(("abort", n))

    def close(self) -> None:
        for task in (self._reading, self._watching):
            if task is not None:
                task.cancel()
        self._unwatch()
        self._stop()
        set_affinity(os.getpid(), self._cores)  # all cores again for what follows

    def _stop(self) -> None:
        """End the child's input (it shuts its engine down and exits); kill it if it
        has not within ``CLOSE_TIMEOUT_S``."""
        # The pipes' own ends, closed now: their transports would close them only once
        # the event loop runs again, and the child waits for the end of its input. (One
        # closing already lost its child: aborting it again would raise.)
        if self._writer is not None and not self._writer.is_closing():
            self._writer.abort()
        if self._read_pipe is not None:
            self._read_pipe.close()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        try:
            self._proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("vLLM's front-end process did not stop in %.0f s: killed",
                        CLOSE_TIMEOUT_S)
            self._proc.kill()
            self._proc.wait()
        self._end_group()

    def _end_group(self) -> None:
        """Kill what is left of the child's process group once it has exited: vLLM's
        engine core, which outlives a front end that was killed."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
