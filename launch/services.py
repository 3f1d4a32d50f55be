"""Each service built from its settings and run until SIGINT or SIGTERM. Apps are imported
here, when their service starts, so the command's other uses load none of them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.settings import GatewaySettings
from memory.embedder import Embedder
from memory.settings import MemorySettings
from pipeline import runtime
from pipeline.digests import Digester
from pipeline.kek import load_kek
from pipeline.keystore import open_keyring
from pipeline.logs import log_format
from pipeline.settings import CommonSettings
from pipeline.tracing import setup_tracing
from projections.settings import AnalyticsSettings, ProjectorSettings
from workers.engine import Engine
from workers.settings import WorkerSettings
from workers.tiny_model import TINY_MODEL_NAME

if TYPE_CHECKING:
    import socket
    from types import FrameType

    import uvicorn
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("pipeline")


def _run_until_signalled(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main`` on uvloop (as uvicorn runs the gateway) until SIGINT or SIGTERM. The
    loop's own work is a large share of a service's CPU per token (timers, callbacks,
    sockets), and uvloop does it in C."""
    import uvloop

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner_:
        runner_.run(runner())


def run_gateway(common: CommonSettings, settings: GatewaySettings,
                reuse_port: bool = False) -> None:
    """One gateway process; with ``reuse_port``, on a port other processes share
    (``pipeline gateway --workers N``, ``launch.gateways``)."""
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    from gateway.app import create_app
    from gateway.connections import protocol
    from launch.gateways import reuse_port_socket

    setup_tracing("gateway")
    app = create_app(settings, common)
    start = StartFailure(app, "gateway")
    # uvicorn's own handlers write text; with JSON its lines go to the root's instead.
    config = uvicorn.Config(start, host=settings.host, port=settings.port, log_level="info",
                            log_config=LOGGING_CONFIG if log_format() == "text" else None,
                            access_log=False, timeout_graceful_shutdown=settings.drain_s,
                            timeout_keep_alive=settings.keep_alive_s,
                            loop="uvloop", http=protocol(app.state.connections),
                            # The client's address is the gateway's to tell, from its
                            # GATEWAY_TRUSTED_PROXIES only (uvicorn's own would believe
                            # any caller on 127.0.0.1).
                            proxy_headers=False)
    sockets = [reuse_port_socket(settings.host, settings.port)] if reuse_port else None
    start.serve(config, sockets)


class StartFailure:
    """A service's app as uvicorn runs it, keeping a failed start's exception for
    ``serve`` to raise once uvicorn has given up: the command then says it as it
    says any other's (one line for a refusal or a service down), where uvicorn would log
    the application's whole traceback."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app = app
        self.name = name  # the service's, for its lines
        self.failure: Exception | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def said_by_the_command(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed":
                message = {"type": message["type"], "message": ""}
            await send(message)

        try:
            await self.app(scope, receive, said_by_the_command)
        except Exception as exc:
            self.failure = exc
            raise

    def serve(self, config: uvicorn.Config, sockets: list[socket.socket] | None = None) -> None:
        """Serve with uvicorn; a failed start raises what the app raised. SIGINT or
        SIGTERM while the app starts (waiting for Kafka, say) ends the start at once,
        where uvicorn would wait for it to finish first."""
        import uvicorn

        class Server(uvicorn.Server):
            main: asyncio.Task[None] | None = None

            async def serve(self, sockets: list[socket.socket] | None = None) -> None:
                self.main = asyncio.current_task()
                await super().serve(sockets)

            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                if not self.started and self.main is not None:
                    self.main.get_loop().call_soon_threadsafe(self.main.cancel)
                super().handle_exit(sig, frame)

        try:
            Server(config).run(sockets=sockets)
        except asyncio.CancelledError:
            log.info("%s stopped while it started", self.name)
        except SystemExit:  # uvicorn's own exit on a failed start, having said only that
            if self.failure is not None:
                raise self.failure from None
            raise


def served_name(settings: WorkerSettings) -> str:
    """The model name a worker of these settings serves (``WORKER_SERVED_MODEL_NAME``,
    else its engine's or model directory's)."""
    if settings.served_model_name:
        return settings.served_model_name
    if settings.engine == "sim":
        return "sim"
    return Path(settings.model).name if settings.model else TINY_MODEL_NAME


def resolve_model(common: CommonSettings, settings: WorkerSettings) -> tuple[Path, str]:
    if settings.model:
        return Path(settings.model), served_name(settings)
    from workers.tiny_model import make_tiny_model

    path = make_tiny_model(common.state_dir / "models" / TINY_MODEL_NAME)
    log.warning("serving the tiny random model at %s: its text is noise. "
                "Set WORKER_MODEL to a model directory to serve a real model.", path)
    return path, served_name(settings)


def make_engine(common: CommonSettings, settings: WorkerSettings) -> Engine:
    """The configured engine: vLLM (with the tiny model by default), or SIMULATED."""
    if settings.engine == "sim":
        from workers.sim_engine import SimEngine

        log.warning("SIMULATED engine: no model runs; for load and fault tests only")
        return SimEngine(served_name(settings), ttft_ms=settings.sim_ttft_ms,
                         tokens_per_s=settings.sim_tokens_per_s,
                         max_num_seqs=settings.max_num_seqs or 256,
                         max_model_len=settings.max_model_len or 8192)
    path, name = resolve_model(common, settings)
    if not settings.model and settings.max_model_len is None:
        settings = settings.model_copy(update={"max_model_len": 512})
    from workers.vllm_process import VllmProcess, front_end_apart

    if front_end_apart(settings):
        return VllmProcess(settings, path, name)
    from workers.vllm_engine import VllmEngine

    return VllmEngine(settings, path, name)


class StopDuringStart(BaseException):
    """SIGINT or SIGTERM came while a blocking start ran (``stopped_by_signal``)."""


@contextlib.contextmanager
def stopped_by_signal() -> Iterator[None]:
    """While a start blocks the event loop (a model's load: minutes on a large GPU model),
    the loop runs no signal handler, so a stop asked then would wait for the start to
    end: SIGINT and SIGTERM raise ``StopDuringStart`` instead, at once, and the start
    unwinds (vLLM stops the engine core it began)."""

    def stop(signum: int, frame: object) -> None:
        raise StopDuringStart

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in saved:
        signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def run_worker(common: CommonSettings, settings: WorkerSettings) -> None:
    from prometheus_client import CollectorRegistry

    from pipeline.metrics import serve_metrics
    from workers.sim_engine import SimEngine
    from workers.worker import Worker

    registry = CollectorRegistry()
    setup_tracing("worker")

    async def main(stop: asyncio.Event) -> None:
        # First: the engine takes long to start and binds ports of its own, and a port in
        # use should stop the worker at once.
        serve_metrics(registry, settings.metrics_port, common.metrics_host)
        # A worker reads its prompt partitions in order, and a conversation's key is in
        # the same partition of chat.keys, just before its first prompt: a fetch for one
        # new conversation brings the next ones' keys.
        keyring = await asyncio.to_thread(open_keyring, common, "worker",
                                          read_ahead=True)
        try:
            if stop.is_set():
                raise StopDuringStart
            with stopped_by_signal():  # an engine's start blocks the loop, for minutes
                engine = make_engine(common, settings)
        except StopDuringStart:
            log.info("worker stopped while its engine started")
            keyring.close()
            return
        if isinstance(engine, SimEngine):  # fault injection, simulated engine only
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, engine.crash)
        try:
            log.info("worker ready: engine %s, model %s, max_num_seqs %d", settings.engine,
                     engine.model_name, engine.max_num_seqs)
            worker = await Worker.opened(engine, common.kafka_bootstrap, registry, settings,
                                         keyring.codec, max_record_bytes=common.max_record_bytes,
                                         compression=common.compression)
            runtime.settle()
            await worker.run(stop)
        finally:
            engine.close()
            keyring.close()

    _run_until_signalled(main)


def run_memory(common: CommonSettings, settings: MemorySettings) -> None:
    """The memory service: its consumer (group ``memory``) and its recall API."""
    import uvicorn
    from prometheus_client import CollectorRegistry
    from psycopg.conninfo import make_conninfo

    from memory import store
    from memory.service import MemoryService

    url = common.database_url
    if settings.schema_name is not None:
        from pipeline.pgschema import create_schema

        create_schema(url, settings.schema_name)
        # pgvector's type lives in the schema the extension was created in (public).
        url = make_conninfo(url, options=f"-c search_path={settings.schema_name},public")
    store.migrate(url)
    embedder = open_embedder(common, settings)
    registry = CollectorRegistry()
    keyring = open_keyring(common, "memory")  # content is sealed
    service = MemoryService(settings, common.kafka_bootstrap, url, embedder, registry,
                            Digester(load_kek(common)), keyring.codec)

    @contextlib.asynccontextmanager
    async def lifespan(_app: object) -> AsyncIterator[None]:
        await service.open()
        stop = asyncio.Event()
        consuming = asyncio.create_task(service.run(stop))
        consuming.add_done_callback(_stop_if_failed)
        log.info("memory ready: model %s, on http://%s:%d", embedder.name, settings.host,
                 settings.port)
        runtime.settle()
        try:
            yield
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await consuming
            await service.close()
            embedder.close()

    app = service.app()
    app.router.lifespan_context = lifespan
    start = StartFailure(app, "memory")
    try:
        start.serve(uvicorn.Config(start, host=settings.host, port=settings.port,
                                   log_level="warning", loop="uvloop", http="httptools"))
    finally:
        keyring.close()


def _stop_if_failed(task: asyncio.Task[None]) -> None:
    """A service's consumer that died stops its process (its supervisor restarts it)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("the consumer stopped", exc_info=task.exception())
        os.kill(os.getpid(), signal.SIGTERM)


def open_embedder(common: CommonSettings, settings: MemorySettings) -> Embedder:
    """The configured embedding model's embedder; without one, the tiny random model's."""
    if settings.model:
        return Embedder(settings.model, Path(settings.model).name, settings)
    from workers.tiny_model import make_tiny_model

    path = make_tiny_model(common.state_dir / "models" / TINY_MODEL_NAME)
    log.warning("embedding with the tiny random model at %s: its vectors rank memories by "
                "nothing. Set MEMORY_MODEL to an embedding model.", path)
    if settings.max_model_len is None:
        settings = settings.model_copy(update={"max_model_len": 512})
    return Embedder(str(path), TINY_MODEL_NAME, settings)


def run_analytics(common: CommonSettings, settings: AnalyticsSettings) -> None:
    from prometheus_client import CollectorRegistry

    from pipeline.metrics import serve_metrics
    from projections import analytics_app
    from projections.migrate import in_schema, migrate

    url = in_schema(common.database_url, settings.schema_name)
    migrate(common.database_url, settings.schema_name)
    registry = CollectorRegistry()
    serve_metrics(registry, settings.metrics_port, common.metrics_host)
    log.info("analytics: group %s, tables in %s", settings.group,
             settings.schema_name or "the store's schema")
    analytics_app.run(settings, common.kafka_bootstrap, url, registry, common.topic_policy())


def run_projector(common: CommonSettings, settings: ProjectorSettings) -> None:
    from prometheus_client import CollectorRegistry

    from pipeline.metrics import serve_metrics
    from projections.migrate import migrate
    from projections.projector import Projector

    migrate(common.database_url)
    registry = CollectorRegistry()
    serve_metrics(registry, settings.metrics_port, common.metrics_host)
    # The store holds conversations' content in the clear, to serve it: opened with
    # their data keys, and dropped when they are deleted or erased (their keys destroyed
    # if their deleter did not).
    with open_keyring(common, "projector", read_ahead=True) as keyring:
        projector = Projector(settings, common.kafka_bootstrap, common.database_url,
                              registry, keyring=keyring)
        log.info("projector ready: group %s", settings.group)
        runtime.settle()
        _run_until_signalled(projector.run)
