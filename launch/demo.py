"""``pipeline demo``: the local stack and every component as its own process, until Ctrl-C."""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys
import time

from gateway.settings import GatewaySettings
from launch.local import infra_down, infra_up
from launch.services import served_name
from launch.supervise import Child, stop_all
from memory.settings import MemorySettings
from pipeline.settings import CommonSettings
from workers.settings import WorkerSettings


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(common: CommonSettings, gateway: GatewaySettings, external_db: bool) -> int:
    from infra.process import StartupFailed, wait_http

    # Ctrl-C and SIGTERM both stop everything, even where SIGINT was inherited ignored.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    # Another demo (or anything else) on the gateway's port would answer this one's
    # readiness check and take its clients: refused before anything starts.
    refuse_taken_port(gateway.host, gateway.port)
    started = infra_up(common, external_db)
    exe = [sys.executable, "-m", "launch"]
    # Each component in its own process group: the demo forwards Ctrl-C as SIGTERM,
    # and one that will not stop is killed with every process it started (vLLM's engine).
    # The gateway recalls users' memories from the memory service (MEMORY_PORT).
    memory_url = f"http://127.0.0.1:{MemorySettings().port}"
    env = {**os.environ, "GATEWAY_MEMORY_URL": os.environ.get("GATEWAY_MEMORY_URL", memory_url)}
    if "GATEWAY_MODELS" not in os.environ:  # the gateway serves what the worker does
        gateway = gateway.model_copy(update={"models": [served_name(WorkerSettings())]})
        env["GATEWAY_MODELS"] = gateway.models[0]
    # One that exits (a worker whose engine died) is started again, as a deployment's
    # supervisor would: the demo goes on.
    children = [Child(name, [*exe, name], {"start_new_session": True, "env": env})
                for name in ("projector", "analytics", "memory", "worker", "gateway")]
    base = f"http://{gateway.host}:{gateway.port}"
    try:
        for child in children:
            child.start()
        try:
            # Ready: the dependencies answer, and the worker has warmed its engine up
            # (the first turns a benchmark sends then wait for no compilation).
            wait_http(f"{base}/readyz", [c.proc for c in children if c.proc], timeout=600)
        except StartupFailed as exc:
            raise SystemExit(str(exc)) from None
        print(_demo_banner(base, gateway.models[0],
                           _keys_exist(common.database_url)), flush=True)
        while True:
            time.sleep(0.5)
            for child in children:
                child.keep()
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        stop_all(children, 40, group=True)
        infra_down(common, started)


def refuse_taken_port(host: str, port: int) -> None:
    """Raise ``EADDRINUSE`` (the command's "address in use" line) if ``port`` is taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise OSError(errno.EADDRINUSE, f"{host}:{port} is taken before the demo "
                          "starts anything") from None


def _keys_exist(database_url: str) -> bool:
    import psycopg

    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT EXISTS (SELECT 1 FROM api_keys)").fetchone()
    return bool(row and row[0])


def _demo_banner(base: str, model: str, auth: bool) -> str:
    access = ("API keys are required: add -H 'Authorization: Bearer <key>' to the calls below "
              "(pipeline keys create --tenant T)" if auth else
              "OPEN: no API key exists, so anyone who reaches this address is tenant "
              "'default'\n(it listens on 127.0.0.1 only; `pipeline keys create` turns keys on)")
    return f"""
The pipeline is up on {base}
{access}.
The worker serves '{model}'; with the tiny random model its text is noise.
The worker's engine may take ~30 s more to warm up; requests wait for it.

  curl -N {base}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model":"{model}","stream":true,"messages":[{{"role":"user","content":"hi"}}]}}'

  # the reply's X-Session-Id header names the session; its stored history:
  curl {base}/v1/sessions/SESSION_ID/messages

  # long-term memory: a user's turns with "memory": true are remembered, and their
  # memories recalled into the next ones (the memory service's engine takes a minute
  # or two to start; until then such turns answer 503):
  curl {base}/v1/chat/completions -H 'content-type: application/json' \
       -d '{{"model":"{model}","memory":true,"user":"ada",
            "messages":[{{"role":"user","content":"I like tea"}}]}}'
  curl "{base}/v1/memories?user=ada"

  # usage per minute (tokens, requests, TTFT), as OpenAI's usage API shapes it:
  curl "{base}/v1/usage?start_time=$(( $(date +%s) - 3600 ))&bucket_width=1m"

Ctrl-C stops everything (data stays under .state/).
"""
