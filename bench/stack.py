"""What the benchmarks need of the local stack besides load: a log the store has caught up
with, so no projector's catching up is measured as the load's cost; a SIMULATED worker
of a model of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from infra.process import free_port
from pipeline.kafka import GroupStatus
from pipeline.settings import REPO_ROOT
from pipeline.topics import CONVERSATION_TOPICS
from projections.settings import ProjectorSettings


def wait_projected(bootstrap: str, timeout: float = 600.0) -> None:
    """Until the projector has caught up with the log (whatever earlier runs wrote)."""
    status = GroupStatus(bootstrap, ProjectorSettings().group)
    deadline = time.monotonic() + timeout
    try:
        while True:
            behind = sum(max(end - at, 0) for topic in CONVERSATION_TOPICS
                         for at, end in status.per_partition(topic).values())
            if behind < 100:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the projector is still {behind} records behind")
            print(f"waiting for the projector to catch up: {behind:,} records behind",
                  flush=True)
            time.sleep(2)
    finally:
        status.close()


def in_tree(env: dict[str, str], tree: Path | None) -> None:
    """``env`` made to run ``tree``'s code (None: this checkout's) with this stack's state,
    its key-encryption key first, not the tree's own."""
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(tree), env.get("PYTHONPATH"))))
        env.setdefault("PIPELINE_STATE_DIR", str(REPO_ROOT / ".state"))


@contextmanager
def sim_worker(bootstrap: str, log: Path, model: str, slots: int, tokens_per_s: float,
               env: dict[str, str], tree: Path | None = None) -> Iterator[tuple[str, int]]:
    """A SIMULATED worker serving ``model`` alone (``slots`` sequences at ``tokens_per_s``
    each), running ``tree``'s code (this checkout's by default), its output in ``log``;
    gives its metrics' address and its pid once it has taken its partitions."""
    metrics = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PIPELINE_KAFKA_BOOTSTRAP": bootstrap,
           "WORKER_SIM_TOKENS_PER_S": str(tokens_per_s), **env}
    in_tree(env, tree)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "launch", "worker", "--engine", "sim", "--served-model-name",
             model, "--max-num-seqs", str(slots), "--metrics-port", str(metrics)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=tree)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the worker exited; see {log}"
            assert time.monotonic() < deadline, f"the worker never took partitions; {log}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics",
                                            timeout=2) as resp:
                    text = resp.read().decode()
                if any(line.startswith("worker_assigned_partitions ")
                       and float(line.split()[1]) > 0 for line in text.splitlines()):
                    break
            except OSError:
                pass
            time.sleep(0.3)
        yield f"http://127.0.0.1:{metrics}/metrics", proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
