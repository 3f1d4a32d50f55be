"""Small helpers for daemons started by ``pipeline infra`` and the tests."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

_handed_out: set[int] = set()


def _ephemeral_start() -> int:
    """Where the kernel's range of ports for sockets bound to port 0 begins."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port that nothing here listens on, for a service about to be started on it.

    It is drawn from below the kernel's ephemeral range, so no socket bound to port 0 (a
    vLLM engine's, a client's) can take it while the service starts, and never the same
    one twice in a process."""
    start = _ephemeral_start()
    low, high = (10000, start) if start > 12000 else (start, 65536)
    for _ in range(1000):
        port = random.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError("no free port found")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0): reap it if it is ours; it has ended either way.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def read_pid(pid_file: Path) -> int | None:
    try:
        pid = int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def spawn_daemon(cmd: list[str], log_file: Path, pid_file: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own session (so Ctrl-C in a terminal reaches it only through us)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    pid_file.write_text(str(proc.pid))
    return proc


def stop_pid(pid: int, timeout: float = 20.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return


class StartupFailed(RuntimeError):
    """A process started for a command exited, or never answered, during its start-up."""


def wait_http(url: str, procs: list[subprocess.Popen[bytes]], timeout: float,
              logs: str = "its log") -> None:
    """Until ``url`` answers 200; fail at once if one of ``procs`` exits meanwhile
    (``logs``: where the failure names their output to be), and with its last answer if
    the time runs out (a gateway's ``/readyz`` names what it waits for)."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        exited = next((p for p in procs if p.poll() is not None), None)
        if exited is not None:
            args = exited.args
            command = " ".join(map(str, args)) if isinstance(args, list) else str(args)
            raise StartupFailed(f"`{command}` exited with code {exited.returncode} during "
                                f"start-up; see {logs}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = f"{exc.code} {exc.read(300).decode(errors='replace').strip()}"
            exc.close()
            time.sleep(0.5)
        except OSError:
            time.sleep(0.5)
    raise StartupFailed(f"{url} did not answer 200 within {timeout:.0f}s; its last "
                        f"answer: {last}")


def wait_until(
    predicate: Callable[[], bool],
    timeout: float,
    what: str,
    log_file: Path | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    tail = ""
    if log_file is not None and log_file.exists():
        tail = "\n--- last lines of " + str(log_file) + " ---\n"
        tail += "\n".join(log_file.read_text(errors="replace").splitlines()[-30:])
    raise TimeoutError(f"{what} not ready after {timeout:.0f}s{tail}")
