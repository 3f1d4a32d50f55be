"""The ``pipeline`` command: each command parsed has what runs it, a service down is
said in one line, a metrics port in use is named (a worker's before its engine starts)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from prometheus_client import CollectorRegistry

from infra.process import free_port
from launch.cli import service_down
from pipeline.metrics import serve_metrics
from pipeline.settings import CommonSettings


@pytest.mark.parametrize(("argv", "down"), [
    (["keys", "list"], "PostgreSQL does not answer at DATABASE_URL"),
    (["migrate"], "PostgreSQL does not answer at DATABASE_URL"),
    (["audit", str(uuid.UUID(int=0))], "Kafka does not answer at 127.0.0.1:"),
])
def test_a_command_whose_service_is_down_says_so_in_one_line(argv: list[str],
                                                            down: str) -> None:
    closed = f"127.0.0.1:{free_port()}"  # nothing listens there
    env = {**os.environ, "DATABASE_URL": f"postgresql://u:secret@{closed}/db",
           "PIPELINE_KAFKA_BOOTSTRAP": closed}
    done = subprocess.run([sys.executable, "-m", "launch", *argv], env=env, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 3 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and down in done.stderr, done.stderr
    assert "secret" not in done.stderr


def test_a_command_interrupted_says_so_in_one_line() -> None:
    """Ctrl-C on a command (here one waiting for its service) ends it with the shell's
    status for an interrupt and one line, where Python printed a traceback."""
    closed = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PIPELINE_KAFKA_BOOTSTRAP": closed}
    # As from a terminal: a shell's background job (CI's, say) inherits SIGINT ignored.
    with subprocess.Popen([sys.executable, "-m", "launch", "topics", "--wait", "120"],
                          env=env, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
                          ) as command:
        try:
            assert command.stderr is not None
            said = command.stderr.readline()  # the first try failed: it waits to try again
            assert "trying again" in said, said
            command.send_signal(signal.SIGINT)
            said = command.communicate(timeout=60)[1]
        finally:
            command.kill()
    assert command.returncode == 130
    assert said == "pipeline topics: interrupted\n"


def test_the_local_database_being_down_points_at_infra_up() -> None:
    settings = CommonSettings(database_url=f"postgresql://postgres@127.0.0.1:{free_port()}/x")
    with pytest.raises(psycopg.OperationalError) as err:
        psycopg.connect(settings.database_url, connect_timeout=5)
    said = service_down(err.value, settings, external_db=False)
    assert said is not None and said.endswith("`pipeline infra up` starts it")
    assert service_down(ValueError("not a service"), settings, external_db=False) is None


def test_metrics_port_in_use_is_named() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            serve_metrics(CollectorRegistry(), port)


def test_a_worker_whose_metrics_port_is_taken_stops_before_its_engine_starts() -> None:
    """The port is bound first: an engine takes long to start, and binds ports of its own
    that could otherwise take the one meant for metrics meanwhile."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = subprocess.run([sys.executable, "-m", "launch", "worker", "--metrics-port",
                                str(port)], capture_output=True, text=True, timeout=60)
    assert taken.returncode == 2, taken.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in taken.stderr
    assert "Traceback" not in taken.stderr and "vllm" not in taken.stderr.lower()


def test_every_command_the_cli_parses_has_what_runs_it() -> None:
    import argparse

    from launch.cli import COMMANDS
    from launch.parser import parser

    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) == set(COMMANDS)


def test_a_supervised_child_that_exits_is_started_again_and_stop_ends_every_one(
        tmp_path: Path) -> None:
    """``launch.supervise`` (the demo's components, a host's gateways): a child that
    exits is started again after its pause, one that runs is left alone, and
    ``stop_all`` ends them all, a child's whole group with ``group``, even one that
    ignores SIGTERM."""
    from launch.supervise import Child, stop_all
    from pipeline.retry import Backoff

    runs = tmp_path / "runs"
    exits = Child("exits", [sys.executable, "-c",
                            f"open({str(runs)!r}, 'a').write('x')"],
                  restarts=Backoff(0.05, 0.1))
    # Ignores SIGTERM, and leads a group with a grandchild in it.
    stubborn = Child("stubborn", ["sh", "-c", "trap '' TERM; sleep 600 & wait"],
                     {"start_new_session": True})
    children = [exits, stubborn]
    for child in children:
        child.start()
    first = stubborn.proc
    deadline = time.monotonic() + 30
    while (not runs.exists() or len(runs.read_text()) < 3) and time.monotonic() < deadline:
        time.sleep(0.02)
        for child in children:
            child.keep()
    assert len(runs.read_text()) >= 3  # exited, and was started again each time
    assert stubborn.proc is first and first is not None and first.poll() is None
    group = os.getpgid(first.pid)
    stop_all(children, 1.0, group=True)
    assert first.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 5  # a SIGKILLed process is gone within moments
    while _live_in_group(group) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live_in_group(group) == []  # the grandchild went with it


def _live_in_group(group: int) -> list[int]:
    """The processes of a process group that still run (not zombies)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == group and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


def test_a_start_that_never_gets_ready_says_what_the_url_last_answered() -> None:
    """``make demo`` waits for the gateway's ``/readyz``, which names what it waits for
    (a model no worker serves): the failure quotes it, not only the time spent."""
    import http.server
    import threading

    from infra.process import StartupFailed, wait_http

    class Warming(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b'{"status":"warming","waiting_for":{"m":"no worker"}}')

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Warming)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(StartupFailed, match=r'last answer: 503 \{"status":"warming",'
                                                r'"waiting_for":\{"m":"no worker"\}\}'):
            wait_http(f"http://127.0.0.1:{server.server_port}/readyz", [], timeout=1.5)
    finally:
        server.shutdown()
        server.server_close()


def test_a_service_whose_start_fails_under_uvicorn_raises_what_its_app_raised(
        capfd: pytest.CaptureFixture[str]) -> None:
    """The gateway and the memory service serve through ``StartFailure``: the command
    says the app's own exception in one line, where uvicorn would log its traceback."""
    import contextlib
    from collections.abc import AsyncIterator

    import uvicorn
    from starlette.applications import Starlette

    from launch.services import StartFailure
    from pipeline.keystore import KeyringError

    @contextlib.asynccontextmanager
    async def lifespan(_app: object) -> AsyncIterator[None]:
        raise KeyringError("the KEK does not open this cluster's keys")
        yield

    start = StartFailure(Starlette(lifespan=lifespan), "test")
    config = uvicorn.Config(start, host="127.0.0.1", port=free_port(), log_level="warning")
    with pytest.raises(KeyringError, match="does not open"):
        start.serve(config)
    assert "Traceback" not in capfd.readouterr().err


def test_a_gateway_waiting_for_kafka_at_its_start_stops_when_asked() -> None:
    """A gateway waits up to ``GATEWAY_STARTUP_TIMEOUT_S`` (120 s) for Kafka as it
    starts, and uvicorn let SIGTERM wait for that start to end: a deploy or a demo
    stopping it then hung. The start is now cut short, and the process says so."""
    closed = f"127.0.0.1:{free_port()}"  # nothing listens there
    env = {**os.environ, "DATABASE_URL": f"postgresql://u:p@{closed}/db",
           "PIPELINE_KAFKA_BOOTSTRAP": closed, "GATEWAY_PORT": str(free_port())}
    with subprocess.Popen([sys.executable, "-m", "launch", "gateway"], env=env,
                          stderr=subprocess.PIPE, text=True) as gateway:
        try:
            assert gateway.stderr is not None
            for line in gateway.stderr:  # the start is under way, waiting for Kafka
                if "waiting for Kafka to start the gateway" in line:
                    break
            gateway.send_signal(signal.SIGTERM)
            asked = time.monotonic()
            said = gateway.communicate(timeout=30)[1]
            took = time.monotonic() - asked
        finally:
            gateway.kill()
    assert gateway.returncode == 0, said
    assert took < 15  # what is left of one metadata request (5 s), then the clients' close
    assert "gateway stopped while it started" in said and "Traceback" not in said


def test_a_demo_whose_port_is_taken_starts_nothing(tmp_path: Path) -> None:
    """A second ``make demo`` (or anything on the gateway's port) would answer the
    demo's readiness check and take its clients, and stopping it stopped the Kafka and
    PostgreSQL the first one ran on: it is refused before it starts anything."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**os.environ, "GATEWAY_PORT": str(port), "PIPELINE_STATE_DIR": str(tmp_path)}
        done = subprocess.run([sys.executable, "-m", "launch", "demo"], env=env, timeout=120,
                              capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert f"127.0.0.1:{port} is taken" in done.stderr and "address in use" in done.stderr
    assert list(tmp_path.iterdir()) == []  # no Kafka, no PostgreSQL


def test_a_demo_stops_only_what_it_started(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    """A demo started beside a running stack (``pipeline infra up``'s) leaves it running
    when it stops; ``pipeline infra down`` stops it. A process stands in for the broker
    here: its pid where the local broker's is kept."""
    from launch.local import Started, infra_down

    common = CommonSettings(state_dir=tmp_path)
    (tmp_path / "kafka").mkdir()
    broker = subprocess.Popen(["sleep", "600"])
    try:
        (tmp_path / "kafka" / "broker.pid").write_text(f"{broker.pid}\n")
        infra_down(common, Started(kafka=False, postgres=False))  # what a demo started
        assert broker.poll() is None
        assert "left Kafka and PostgreSQL running" in capsys.readouterr().out
        infra_down(common)  # pipeline infra down
        broker.wait(timeout=30)  # stopped (reaped by the stop itself: no status here)
    finally:
        broker.kill()
        broker.wait()
