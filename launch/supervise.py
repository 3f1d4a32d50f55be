"""Child processes kept running until their supervisor stops them: one that exits is
started again after a pause that doubles, from ``RESTART_MIN_S`` to ``RESTART_MAX_S``,
while it keeps exiting (``pipeline gateway --workers N``'s gateways, ``pipeline demo``'s
components). A worker exits by design when its engine dies; started again, it takes
its partitions' turns back."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.retry import Backoff

log = logging.getLogger("pipeline.supervise")
RESTART_MIN_S, RESTART_MAX_S = 1.0, 30.0


@dataclass
class Child:
    """``command``, run as ``name``; ``popen``: ``subprocess.Popen``'s other arguments."""

    name: str
    command: list[str]
    popen: dict[str, Any] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    restarts: Backoff = field(default_factory=lambda: Backoff(RESTART_MIN_S, RESTART_MAX_S))
    restart_at: float = 0.0
    started_at: float = 0.0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command, **self.popen)
        self.started_at = time.monotonic()
        log.info("%s started (pid %d)", self.name, self.proc.pid)

    def keep(self) -> None:
        """Start it again if it exited, once its pause is over."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            if time.monotonic() - self.started_at > RESTART_MAX_S:
                self.restarts.reset()  # it has run a while: the next exit restarts soon again
            return
        now = time.monotonic()
        if proc is not None:
            pause = self.restarts.next()
            log.warning("%s (pid %d) exited with code %s; starting it again in %.0f s",
                        self.name, proc.pid, proc.returncode, pause)
            self.proc, self.restart_at = None, now + pause
        if now >= self.restart_at:
            self.start()


def stop_all(children: list[Child], within_s: float, group: bool = False) -> None:
    """SIGTERM to every child running, then SIGKILL to each still running after
    ``within_s`` (to its whole process group with ``group``: one that leads a session
    of its own, with the processes it started)."""
    for child in children:
        if child.proc is not None and child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + within_s
    for child in children:
        if child.proc is None:
            continue
        try:
            child.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0f s: killing it", child.name, within_s)
            if group:
                os.killpg(child.proc.pid, signal.SIGKILL)
            else:
                child.proc.kill()
            child.proc.wait()
