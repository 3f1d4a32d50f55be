"""Sharing a host's CPUs with a vLLM engine that computes on them. No vLLM imports: these
read and set scheduling for processes and threads, through /proc and os.

vLLM's engine processes (named ``VLLM::...``) poll without pause; on a host whose CPU
also runs the model they starve the broker and the worker's own Kafka threads. The
worker lowers their priority, its session's (where the kernel schedules by session),
and keeps its own threads off the cores vLLM binds its compute to.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def _engine_processes(root: int) -> list[tuple[int, str]]:
    """(pid, name) of each vLLM engine process (named ``VLLM::...``, API servers
    aside) under process ``root``."""
    children: dict[int, list[tuple[int, str]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text()
            name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:]
            children.setdefault(int(rest.split()[1]), []).append((int(stat.parent.name), name))
    found = []
    todo = [root]
    while todo:
        for pid, name in children.get(todo.pop(), []):
            todo.append(pid)
            if name.startswith("VLLM::") and not name.startswith("VLLM::APIServer"):
                found.append((pid, name))
    return found


def _threads(pid: int) -> list[int]:
    return [int(task.name) for task in Path(f"/proc/{pid}/task").glob("*")]


def lower_engine_priority(root: int, nice: int) -> int:
    """Give every thread of each vLLM engine process under process ``root`` a nice
    value of at least ``nice``; return how many threads changed. Threads they start
    later inherit it. Calling it again changes nothing."""
    changed = 0
    for pid, _ in _engine_processes(root):
        for tid in _threads(pid):
            with contextlib.suppress(OSError):
                if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
                    changed += 1
    return changed


AUTOGROUP_SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")


def lower_session_priority(pid: int, nice: int) -> bool:
    """Give the session that process ``pid`` leads the nice value ``nice``, when the
    kernel schedules by session (autogroup); return whether it did.

    With autogroup on (many distributions' kernels, and this machine), the CPU is
    first shared equally between sessions, and a thread's nice ranks it only within
    its own: engine threads at nice 10 then still take half of a contended core from
    the broker, the gateway or PostgreSQL in other sessions. (Measured here, a worker
    serving vLLM at 8 clients, four runs each: a plain Kafka round trip from another
    process had a p99 of 71-132 ms, at most 208 ms; with the worker's session at nice
    10, 1.3-4.6 ms and at most 13 ms.) Only a process that leads a session of its own
    (as a supervisor, ``pipeline demo``, the bench and the tests start it) is changed:
    a worker run from a terminal shares that terminal's session, which is left alone."""
    try:
        if AUTOGROUP_SWITCH.read_text().strip() != "1" or os.getsid(pid) != pid:
            return False
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        return False
    return True


def move_off_engine_cores(pid: int) -> set[int]:
    """Move every thread of process ``pid`` off the cores that its vLLM model
    processes are bound to (vLLM's CPU backend binds its OpenMP compute threads to
    cores of their own and leaves the rest for the serving process). Returns the
    cores ``pid`` keeps, or an empty set when nothing was moved (no binding, or no
    core would be left). Threads started later inherit it."""
    engine: set[int] = set()
    for child, name in _engine_processes(pid):
        if name.startswith("VLLM::Worker"):
            with contextlib.suppress(OSError):
                engine |= os.sched_getaffinity(child)
    ours = os.sched_getaffinity(pid)
    rest = ours - engine
    if not engine or not rest or rest == ours:
        return set()
    set_affinity(pid, rest)
    return rest


def set_affinity(pid: int, cores: set[int]) -> None:
    """Every thread of process ``pid`` on ``cores``."""
    for tid in _threads(pid):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cores)
