"""``pipeline gateway --workers N``: N gateway processes on one address, so that one host's
cores serve one port.

Each process is a whole gateway (its own fan-out consumer, producers and pool: gateways
share nothing), listening on the same port with ``SO_REUSEPORT``, so the kernel spreads
new connections over them. This process only supervises: it holds the address (so a
port already taken fails here, at once), starts the gateways, starts again one that
exits (after a pause that grows while it keeps failing), and stops them all on SIGINT
or SIGTERM. With ``GATEWAY_METRICS_PORT`` P, gateway i serves its metrics on P + i.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.settings import GatewaySettings
from pipeline.retry import Backoff

log = logging.getLogger("pipeline.gateways")
STOP_S = 30.0
RESTART_MIN_S, RESTART_MAX_S = 1.0, 30.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def reuse_port_socket(host: str, port: int, shared: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` that other such sockets may share (with
    ``shared`` false, one that fails if anything holds the address, sharers included)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _die_with(supervisor: int) -> Callable[[], None]:
    """What a gateway runs before it starts: it gets SIGTERM when its supervisor dies,
    however it dies (a supervisor SIGKILLed left its gateways serving on, orphans)."""
    def arm() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != supervisor:  # it died before that: nothing will tell us
            os._exit(1)

    return arm


@dataclass
class _Child:
    index: int
    command: list[str]
    proc: subprocess.Popen[bytes] | None = None
    # Its pauses before starting again, doubling while it keeps exiting.
    restarts: Backoff = field(default_factory=lambda: Backoff(RESTART_MIN_S, RESTART_MAX_S))
    restart_at: float = 0.0
    started_at: float = field(default=0.0)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command, preexec_fn=_die_with(os.getpid()))
        self.started_at = time.monotonic()
        log.info("gateway %d started (pid %d)", self.index, self.proc.pid)


def run_gateways(settings: GatewaySettings, workers: int) -> int:
    """Supervise ``workers`` gateway processes until SIGINT or SIGTERM."""
    # A port held by anything, another set of gateways sharing it included, is refused
    # here (EADDRINUSE: one line, exit 2); then it is held until the gateways stop.
    reuse_port_socket(settings.host, settings.port, shared=False).close()
    held = reuse_port_socket(settings.host, settings.port)
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    children = []
    for i in range(workers):
        command = [sys.executable, "-m", "launch", "gateway", "--workers", "1", "--reuse-port",
                   "--host", settings.host, "--port", str(settings.port)]
        if settings.metrics_port:
            command += ["--metrics-port", str(settings.metrics_port + i)]
        children.append(_Child(i, command))
    log.info("%d gateways on %s:%d", workers, settings.host, settings.port)
    try:
        for child in children:
            child.start()
        while not stopping:
            time.sleep(0.2)
            for child in children:
                _keep(child)
        return 0
    finally:
        for child in children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        for child in children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("gateway %d did not stop in %.0f s: killing it", child.index,
                            STOP_S)
                child.proc.kill()
                child.proc.wait()
        held.close()


def _keep(child: _Child) -> None:
    """Start ``child`` again if it exited, after its pause."""
    proc = child.proc
    if proc is not None and proc.poll() is None:
        if time.monotonic() - child.started_at > RESTART_MAX_S:
            child.restarts.reset()  # it has run a while: the next exit restarts soon again
        return
    now = time.monotonic()
    if proc is not None:
        pause = child.restarts.next()
        log.warning("gateway %d (pid %d) exited with code %s; starting it again in %.0f s",
                    child.index, proc.pid, proc.returncode, pause)
        child.proc, child.restart_at = None, now + pause
    if now >= child.restart_at:
        child.start()
