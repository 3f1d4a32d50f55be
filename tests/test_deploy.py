"""The Helm chart (deploy/helm/chat-pipeline) and the Compose file, offline: each values
file rendered with ``helm template`` and every manifest checked against the Kubernetes
API's schemas (kubernetes-validate, strict: no unknown field) or, for KEDA's objects,
against KEDA's own CRDs; then what the chart must mean for this pipeline: probes on
/readyz and /livez, a termination grace that covers the gateway's stream drain, a
worker Deployment per model whose ScaledObject watches that model's consumer group,
settings the services actually read, and no secret in a ConfigMap. ``make test``
builds helm and fetches KEDA's CRDs (pinned, from the Go module proxy)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.settings import GatewaySettings
from memory.settings import MemorySettings
from pipeline.kafka.config import read_properties
from pipeline.settings import REPO_ROOT, CommonSettings
from pipeline.topics import PROMPTS, workers_group
from projections.settings import AnalyticsSettings, ProjectorSettings
from workers.settings import WorkerSettings

CHART = REPO_ROOT / "deploy" / "helm" / "chat-pipeline"
VALUES = ["values.yaml", "values-existing-kafka.yaml", "values-strimzi.yaml"]
KUBE_VERSION = "1.30.0"
TOOLS = REPO_ROOT / ".state" / "tools"


def _tool(pattern: str) -> Path:
    found = sorted(TOOLS.glob(pattern))
    assert found, f"{TOOLS}/{pattern} is missing: `make test` makes it"
    return found[-1]


def render(values: str, *sets: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [str(_tool("helm-*/helm")), "template", "chat", str(CHART), "-f", str(CHART / values),
         "--kube-version", KUBE_VERSION, *(a for s in sets for a in ("--set", s))],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def keda_schemas() -> dict[str, dict[str, Any]]:
    out = {}
    for path in _tool("keda-*").glob("keda.sh_*.yaml"):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            kind = crd["spec"]["names"]["kind"]
            out[f"keda.sh/{version['name']}/{kind}"] = version["schema"]["openAPIV3Schema"]
    return out


# Every setting the chart or the Compose file may give, by the services' own settings.
def known_settings() -> set[str]:
    names = {"DATABASE_URL"}
    for settings, prefix in ((CommonSettings, "PIPELINE_"), (GatewaySettings, "GATEWAY_"),
                             (WorkerSettings, "WORKER_"), (ProjectorSettings, "PROJECTOR_"),
                             (AnalyticsSettings, "ANALYTICS_"), (MemorySettings, "MEMORY_")):
        names |= {prefix + field.upper() for field in settings.model_fields}
    return names | {"PIPELINE_KAFKA_CONFIG", "PIPELINE_KAFKA_PASSWORD"}


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Values as Helm merges them: maps key by key, anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return list(doc["spec"]["template"]["spec"]["containers"])


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize("values", VALUES)
def test_every_manifest_is_valid_against_the_api_schemas(values: str) -> None:
    docs = render(values)
    schemas = keda_schemas()
    kinds = set()
    for doc in docs:
        kinds.add(doc["kind"])
        api = f"{doc['apiVersion']}/{doc['kind']}"
        if doc["apiVersion"].startswith("keda.sh/"):
            assert api in schemas, f"KEDA has no {api}"
            jsonschema.validate(doc, schemas[api])
        else:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    assert {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "Job",
            "ScaledObject", "TriggerAuthentication"} <= kinds


@pytest.mark.parametrize("values", VALUES)
def test_the_chart_means_what_the_pipeline_needs(values: str) -> None:
    given = merged(yaml.safe_load((CHART / "values.yaml").read_text()),
                   yaml.safe_load((CHART / values).read_text()))
    docs = render(values)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}

    gateway = next(d for n, d in deployments.items() if n.endswith("-gateway"))
    pod = gateway["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    drain = int(env_of(container)["GATEWAY_DRAIN_S"])
    assert drain == given["gateway"]["drainSeconds"]
    assert pod["terminationGracePeriodSeconds"] > drain + container["lifecycle"]["preStop"][
        "sleep"]["seconds"], "the pod would be killed while its streams drain"
    (pdb,) = by_kind["PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= \
        gateway["spec"]["template"]["metadata"]["labels"].items()

    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in by_kind["ScaledObject"]}
    for worker in given["workers"]:
        name = next(n for n in deployments if n.endswith(f"-worker-{worker['name']}"))
        (engine,) = containers(deployments[name])
        env = env_of(engine)
        assert env["WORKER_SERVED_MODEL_NAME"] == worker["servedModelName"]
        assert env["WORKER_TENSOR_PARALLEL_SIZE"] == str(worker["tensorParallelSize"])
        gpus = worker["gpus"] * worker["tensorParallelSize"]
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert "replicas" not in deployments[name]["spec"]  # KEDA owns the count
        (trigger,) = scaled[name]["spec"]["triggers"]
        # The group and topic the workers of that model really read.
        assert trigger["metadata"]["consumerGroup"] == workers_group(worker["servedModelName"])
        assert trigger["metadata"]["topic"] == PROMPTS
        assert scaled[name]["spec"]["maxReplicaCount"] <= given["kafka"]["partitions"]
    assert {n.split("-")[-1] for n in deployments} >= {"projector", "analytics"}
    if given["memory"]["enabled"]:  # the gateways recall from the memory service
        (memory,) = [d for n, d in deployments.items() if n.endswith("-memory")]
        (service,) = [s for s in by_kind["Service"] if s["metadata"]["name"].endswith("-memory")]
        assert service["spec"]["selector"].items() <= \
            memory["spec"]["template"]["metadata"]["labels"].items()
        url = env_of(container)["GATEWAY_MEMORY_URL"]
        assert url == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"

    known = known_settings()
    for doc in by_kind["Deployment"] + by_kind["Job"]:
        for container in containers(doc):
            unknown = set(env_of(container)) - known
            assert not unknown, f"{doc['metadata']['name']} sets {unknown}, which nothing reads"



def test_a_password_given_to_the_chart_is_in_its_secret_alone() -> None:
    docs = render("values.yaml", "kafka.passwordSecret.create=true",
                  "kafka.passwordSecret.password=Pa55-in-values",
                  "postgres.urlSecret.create=true",
                  "postgres.urlSecret.url=postgresql://u:Db-pa55@db/p?sslmode=verify-full")
    holders = [d["metadata"]["name"] for d in docs
               if "Pa55-in-values" in yaml.safe_dump(d) or "Db-pa55" in yaml.safe_dump(d)]
    assert holders == ["chat-pipeline-kafka", "chat-pipeline-postgres"]  # the Secrets
    assert all(d["kind"] == "Secret" for d in docs if d["metadata"]["name"] in holders)


def test_the_client_file_the_chart_writes_is_one_the_services_take(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (config,) = [d for d in render("values-strimzi.yaml") if d["kind"] == "ConfigMap"]
    path = tmp_path / "client.properties"
    path.write_text(config["data"]["client.properties"])
    monkeypatch.setenv("PIPELINE_KAFKA_PASSWORD", "from-the-secret")
    props = read_properties(path)
    assert props == {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                     "ssl.ca.location": "/etc/pipeline/kafka-ca/ca.crt",
                     "sasl.username": "chat-pipeline", "sasl.password": "from-the-secret"}


def test_the_compose_file_runs_the_pipelines_commands_with_known_settings() -> None:
    compose = yaml.safe_load((REPO_ROOT / "deploy" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"kafka", "postgres", "setup", "gateway", "worker", "projector",
            "analytics"} <= set(services)
    known = known_settings()
    for name in ("gateway", "worker", "projector", "analytics", "setup"):
        env = services[name]["environment"]
        assert not set(env) - known, f"{name}: {set(env) - known}"
    for name in ("gateway", "worker", "projector", "analytics"):
        assert services[name]["command"] == [name]
        assert services[name]["depends_on"]["setup"]["condition"] == \
            "service_completed_successfully"


def pod_templates(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod the chart makes, by its component label."""
    pods = {}
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job"):
            template = doc["spec"]["template"]
            pods[template["metadata"]["labels"]["app.kubernetes.io/component"]] = template
    return pods


@pytest.mark.parametrize("values", VALUES)
def test_every_pod_runs_unprivileged_on_a_read_only_root(values: str) -> None:
    pods = pod_templates(render(values, "memory.enabled=true"))
    assert {"gateway", "projector", "analytics", "memory", "setup"} <= set(pods)
    assert any(name.startswith("worker-") for name in pods)
    for name, pod in pods.items():
        spec = pod["spec"]
        security = spec.get("securityContext", {})
        assert security.get("runAsNonRoot") is True and security.get("runAsUser"), name
        assert security.get("seccompProfile") == {"type": "RuntimeDefault"}, name
        writable = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        for container in spec["containers"]:
            context = container.get("securityContext", {})
            assert context.get("readOnlyRootFilesystem") is True, name
            assert context.get("allowPrivilegeEscalation") is False, name
            assert context.get("capabilities") == {"drop": ["ALL"]}, name
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts.get("/tmp") in writable, f"{name} has no /tmp to write to"
            assert env_of(container)["PIPELINE_STATE_DIR"].startswith("/tmp/"), name


def secrets_of(container: dict[str, Any]) -> set[str]:
    return {e["name"] for e in container.get("env", []) if "secretKeyRef" in e.get(
        "valueFrom", {})}


@pytest.mark.parametrize("values", VALUES)
def test_each_component_holds_only_the_secrets_it_uses(values: str) -> None:
    pods = pod_templates(render(values, "memory.enabled=true"))
    held = {name: secrets_of(pod["spec"]["containers"][0]) for name, pod in pods.items()}
    kafka_password = {"PIPELINE_KAFKA_PASSWORD"} & held["gateway"]
    assert held["analytics"] == {"DATABASE_URL"} | kafka_password  # no KEK
    assert held["setup"] == {"DATABASE_URL"} | kafka_password  # topics, migrations
    assert held["projector"] == held["gateway"] == {"DATABASE_URL", "PIPELINE_KEK"} | \
        kafka_password
    workers = [held[name] for name in held if name.startswith("worker-")]
    assert workers and all(w == {"PIPELINE_KEK"} | kafka_password for w in workers)
    # The memory service's Kafka password is its own, named by its own client file.
    memory = pods["memory"]["spec"]["containers"][0]
    gateway = pods["gateway"]["spec"]["containers"][0]
    if kafka_password:
        mine = env_of(memory)["PIPELINE_KAFKA_PASSWORD"]["secretKeyRef"]["name"]
        theirs = env_of(gateway)["PIPELINE_KAFKA_PASSWORD"]["secretKeyRef"]["name"]
        assert mine != theirs
    assert env_of(memory)["PIPELINE_KAFKA_CONFIG"].endswith("/memory.properties")


def test_the_gateway_serves_metrics_and_hosts_apart_from_its_api() -> None:
    docs = render("values.yaml")
    gateway = next(d for d in docs if d["kind"] == "Deployment"
                   and d["metadata"]["name"].endswith("-gateway"))
    container = containers(gateway)[0]
    env = env_of(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert env["GATEWAY_METRICS_PORT"] == str(ports["metrics"]) != str(ports["http"])
    service = next(d for d in docs if d["kind"] == "Service"
                   and d["metadata"]["name"].endswith("-gateway"))
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    hosts = env["GATEWAY_ALLOWED_HOSTS"].split(",")
    assert "*" not in hosts and service["metadata"]["name"] in hosts
    # The kubelet's probes name a host the gateway answers.
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        headers = container[probe]["httpGet"]["httpHeaders"]
        assert {"name": "Host", "value": "localhost"} in headers
    added = render("values.yaml", "gateway.allowedHosts={chat.example.com}")
    gateway = next(d for d in added if d["kind"] == "Deployment"
                   and d["metadata"]["name"].endswith("-gateway"))
    assert "chat.example.com" in env_of(containers(gateway)[0])["GATEWAY_ALLOWED_HOSTS"]


SETTINGS_OF = {"gateway": [GatewaySettings], "projector": [ProjectorSettings],
               "analytics": [AnalyticsSettings], "memory": [MemorySettings],
               "setup": [], "worker": [WorkerSettings]}


@pytest.mark.parametrize("values", VALUES)
def test_every_value_the_chart_sets_is_one_its_service_parses(
        values: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each container's environment, as its service reads it at start: a value Helm
    renders in a form no setting parses (86400000 as "8.64e+07") would crash-loop the
    pod. Values from Secrets stand in as valid ones."""
    stand_ins = {"PIPELINE_KEK": "A" * 43 + "=", "DATABASE_URL": "postgresql://x@db/x",
                 "PIPELINE_KAFKA_PASSWORD": "secret"}
    for name, pod in pod_templates(render(values, "memory.enabled=true")).items():
        for container in pod["spec"]["containers"]:
            with monkeypatch.context() as env:
                for variable in list(os.environ):
                    if variable.startswith(("PIPELINE_", "GATEWAY_", "WORKER_", "PROJECTOR_",
                                            "ANALYTICS_", "MEMORY_")):
                        env.delenv(variable)
                for entry in container.get("env", []):
                    value = entry.get("value", stand_ins.get(entry["name"]))
                    if value is not None:
                        env.setenv(entry["name"], value)
                CommonSettings()
                for settings in SETTINGS_OF[name.split("-")[0]]:
                    settings()
