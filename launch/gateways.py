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
import sys
import time
from collections.abc import Callable

from gateway.settings import GatewaySettings
from launch.supervise import Child, stop_all

log = logging.getLogger("pipeline.gateways")
STOP_S = 30.0
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
    arm = _die_with(os.getpid())
    for i in range(workers):
        command = [sys.executable, "-m", "launch", "gateway", "--workers", "1", "--reuse-port",
                   "--host", settings.host, "--port", str(settings.port)]
        if settings.metrics_port:
            command += ["--metrics-port", str(settings.metrics_port + i)]
        children.append(Child(f"gateway {i}", command, {"preexec_fn": arm}))
    log.info("%d gateways on %s:%d", workers, settings.host, settings.port)
    try:
        for child in children:
            child.start()
        while not stopping:
            time.sleep(0.2)
            for child in children:
                child.keep()
        return 0
    finally:
        stop_all(children, STOP_S)
        held.close()
