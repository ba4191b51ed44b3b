"""deploy/'s Kubernetes manifests, checked offline: each resource against the Kubernetes schemas
(kubernetes-validate), the kustomization against the files, and what tests/test_compose.py checks
of docker-compose.yml: every command's flags and every setting the manifests set exist, the values
parse, and the secrets the containers name are in the Secret of their namespace; and that the agents
are where the amzn-sagemaker-checkpointing library's default config looks for HyperPod's daemon."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from hyperpod_sim.agents.config import AgentSettings
from hyperpod_sim.settings import Settings
from tests.deployment import BOTO3_VARIABLES, flags_of, library_daemon_address

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
GUIDE = DEPLOY.parent / "docs" / "kubernetes.md"
KUBERNETES = "1.30.0"
# Variables Kubernetes fills in itself (the downward API), which the agents' arguments name.
DOWNWARD_API = {"POD_IP"}
# Where the pieces live: hyperpod-sim's own, and HyperPod's daemon namespace for the agents.
NAMESPACE = "hyperpod-sim"
AGENTS_NAMESPACE = "aws-hyperpod"


def kustomization() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    return data


def resources() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for name in kustomization()["resources"]:
        found += [doc for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc]
    return found


def resource(kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
    found = next(
        (
            r
            for r in resources()
            if r["kind"] == kind
            and r["metadata"]["name"] == name
            and namespace in (None, r["metadata"].get("namespace"))
        ),
        None,
    )
    assert found is not None, f"no {kind} {name} in {namespace or 'any namespace'} in deploy/"
    return found


def container(kind: str, name: str) -> dict[str, Any]:
    spec = resource(kind, name)["spec"]["template"]["spec"]
    found: dict[str, Any] = spec["containers"][0]
    return found


def secret(namespace: str = NAMESPACE) -> dict[str, str]:
    data: dict[str, str] = resource("Secret", "hyperpod-sim", namespace)["stringData"]
    return data


def environment(kind: str, name: str) -> dict[str, str]:
    """A workload's container's environment as it starts: secret references resolved from the
    Secret of the workload's namespace (a pod sees no other)."""
    namespace = resource(kind, name)["metadata"]["namespace"]
    values: dict[str, str] = {}
    for variable in container(kind, name).get("env", []):
        if "value" in variable:
            values[variable["name"]] = variable["value"]
        elif "secretKeyRef" in variable.get("valueFrom", {}):
            ref = variable["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "hyperpod-sim", variable
            keys = secret(namespace)
            assert ref["key"] in keys, f"{variable['name']}: no key {ref['key']} in the Secret of {namespace}"
            values[variable["name"]] = keys[ref["key"]]
        else:
            values[variable["name"]] = "<downward API>"
    return values


def test_the_kustomization_lists_every_file() -> None:
    listed = set(kustomization()["resources"])
    assert listed == {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    # No namespace for all: it would pull the agents out of aws-hyperpod, away from their Service.
    assert "namespace" not in kustomization()
    declared = {r["metadata"]["name"] for r in resources() if r["kind"] == "Namespace"}
    assert declared == {NAMESPACE, AGENTS_NAMESPACE}
    for r in resources():
        if r["kind"] != "Namespace":
            assert r["metadata"].get("namespace") in declared, f"{r['kind']}/{r['metadata']['name']}"
    agents = {
        (r["kind"], r["metadata"]["name"])
        for r in resources()
        if r["metadata"].get("namespace") == AGENTS_NAMESPACE
    }
    assert agents == {
        ("DaemonSet", "agent"),
        ("Service", "ai-toolkit-gossip-headless"),
        ("Secret", "hyperpod-sim"),
    }


@pytest.mark.parametrize("document", resources(), ids=lambda r: f"{r['kind']}/{r['metadata']['name']}")
def test_each_resource_is_valid_kubernetes(document: dict[str, Any]) -> None:
    kubernetes_validate.validate(document, KUBERNETES, strict=True)


def test_the_workloads() -> None:
    kinds = {(r["kind"], r["metadata"]["name"]) for r in resources()}
    assert {
        ("Deployment", "control-plane"),
        ("Service", "control-plane"),
        ("StatefulSet", "postgres"),
        ("Service", "postgres"),
        ("Deployment", "minio"),
        ("Service", "minio"),
        ("Job", "minio-init"),
        ("DaemonSet", "agent"),
        ("Service", "ai-toolkit-gossip-headless"),
    } <= kinds
    # One control plane: its reconciler is the only writer of node status.
    assert resource("Deployment", "control-plane")["spec"]["replicas"] == 1
    probe = container("Deployment", "control-plane")["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health"


def test_commands_use_existing_flags() -> None:
    for kind, name, subcommand in (("Deployment", "control-plane", "serve"), ("DaemonSet", "agent", "agent")):
        words = container(kind, name)["args"]
        assert words[0] == subcommand
        used = {w for w in words if w.startswith("--")}
        assert used <= flags_of(subcommand), f"{name}: unknown flags {used - flags_of(subcommand)}"


def test_environment_names_existing_settings() -> None:
    settings = Settings()
    cp_env = environment("Deployment", "control-plane")
    for key in cp_env:
        assert key.startswith("HPSIM_")
        node: Any = settings
        for part in key.removeprefix("HPSIM_").lower().split("__"):
            assert hasattr(node, part), f"{key}: no setting {part}"
            node = getattr(node, part)
    agent = container("DaemonSet", "agent")
    agent_env = environment("DaemonSet", "agent")
    for key in agent_env:
        if key.startswith("HPSIM_AGENT_"):
            assert key.removeprefix("HPSIM_AGENT_").lower() in AgentSettings.model_fields, key
        else:
            assert key in BOTO3_VARIABLES | DOWNWARD_API, f"{key}: not an agent setting nor a boto3 variable"
    # What the arguments expand is set in the container (Kubernetes' $(VAR)).
    for word in agent["args"]:
        if word.startswith("$("):
            assert word[2:-1] in agent_env, word
    assert agent_env["HPSIM_AGENT_TOKEN"] == cp_env["HPSIM_PROVISIONING__BOOTSTRAP_TOKEN"]
    minio_env = environment("Deployment", "minio")
    assert agent_env["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"]
    assert agent_env["AWS_SECRET_ACCESS_KEY"] == minio_env["MINIO_ROOT_PASSWORD"]
    assert agent_env["AWS_DEFAULT_REGION"] == settings.s3.region


def test_the_services_are_where_the_settings_point() -> None:
    cp_env = environment("Deployment", "control-plane")
    ports = {
        r["metadata"]["name"]: r["spec"]["ports"][0]["port"] for r in resources() if r["kind"] == "Service"
    }
    # Named with their namespace: the agents, in another one, call the first and are handed the
    # second in their node policy.
    assert cp_env["HPSIM_PUBLIC_URL"] == f"http://control-plane.{NAMESPACE}:{ports['control-plane']}"
    assert cp_env["HPSIM_S3__ENDPOINT_URL"] == f"http://minio.{NAMESPACE}:{ports['minio']}"
    assert f"@postgres:{ports['postgres']}/" in cp_env["HPSIM_DATABASE__URL"]
    agent_args = container("DaemonSet", "agent")["args"]
    assert agent_args[agent_args.index("--control-plane") + 1] == cp_env["HPSIM_PUBLIC_URL"]
    script = container("Job", "minio-init")["command"][-1]
    assert f"mc mb --ignore-existing hpsim/{Settings().s3.bucket}" in script
    assert "http://minio:9000" in script
    # The database URL's password is the one PostgreSQL starts with.
    postgres_env = environment("StatefulSet", "postgres")
    assert f":{postgres_env['POSTGRES_PASSWORD']}@" in cp_env["HPSIM_DATABASE__URL"]


def test_control_plane_environment_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The values, not only the names: the control plane starts with this environment (auth on, as
    serve demands on 0.0.0.0), on PostgreSQL, with MinIO instead of its embedded S3 endpoint."""
    from hyperpod_sim.cli.main import _is_loopback

    for key in list(os.environ):
        if key.startswith("HPSIM_"):
            monkeypatch.delenv(key)
    for key, value in environment("Deployment", "control-plane").items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.s3.embedded == "off"
    assert settings.provisioning.mode == "external"
    assert settings.database_url().startswith("postgresql+psycopg://")
    assert not _is_loopback(settings.host)
    assert settings.auth.enabled
    assert settings.auth.admin_credentials
    assert not set(settings.auth.credentials) & set(settings.auth.admin_credentials)


def test_the_validator_refuses_what_kubernetes_would() -> None:
    """The check above has teeth: an unknown field and a wrong type are refused."""
    broken = resource("Deployment", "control-plane")
    broken["spec"]["replica"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)
    broken = resource("DaemonSet", "agent")
    broken["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "soon"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


def test_the_agents_are_where_the_library_looks() -> None:
    """A trainer pod with the library's default InMemoryClientConfig() reaches the agents: its
    base_url names a Service of this name, namespace and port, headless (the name resolves to the
    agent pods' own addresses, so their port must be the URL's), selecting the DaemonSet's pods, and
    the agents listen there."""
    from hyperpod_sim.contracts.agent_api import HEALTH_PATH

    daemon = library_daemon_address()
    service = resource("Service", daemon.service, daemon.namespace)
    daemonset = resource("DaemonSet", "agent")
    # A Service selects the pods of its own namespace only.
    assert daemonset["metadata"]["namespace"] == daemon.namespace
    assert service["spec"]["clusterIP"] == "None"
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    [service_port] = service["spec"]["ports"]
    assert service_port["port"] == daemon.port
    agent = container("DaemonSet", "agent")
    [container_port] = [p for p in agent["ports"] if p["name"] == service_port["targetPort"]]
    # On the node's address too: a trainer's own node's agent, at http://<status.hostIP>:9200.
    assert container_port["containerPort"] == container_port["hostPort"] == daemon.port
    args = agent["args"]
    assert int(args[args.index("--port") + 1]) == daemon.port
    assert args[args.index("--host") + 1] == "0.0.0.0"
    # The name lists an agent once it answers, on its open health route.
    probe = agent["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == (HEALTH_PATH, service_port["targetPort"])


def test_the_agents_secret_matches_the_control_planes() -> None:
    """The agents' Secret (in their namespace) repeats three values of hyperpod-sim's: a change to
    one side only would leave every agent unable to register, or to sign its S3 requests."""
    agents = secret(AGENTS_NAMESPACE)
    assert agents == {key: secret()[key] for key in agents}
    assert set(agents) == {"bootstrap-token", "minio-user", "minio-password"}


def test_the_guides_trainer_job_takes_the_default_config() -> None:
    """docs/kubernetes.md's trainer Job is valid Kubernetes and names no agent: what reaches the
    agents is the library's default base_url, nothing of ours."""
    blocks = re.findall(r"```yaml\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    jobs = [doc for block in blocks for doc in yaml.safe_load_all(block) if doc and "apiVersion" in doc]
    [job] = jobs
    assert job["kind"] == "Job"
    kubernetes_validate.validate(job, KUBERNETES, strict=True)
    assert job["metadata"]["namespace"] not in {NAMESPACE, AGENTS_NAMESPACE}
    [trainer] = job["spec"]["template"]["spec"]["containers"]
    assert "env" not in trainer
    assert "http" not in " ".join(trainer["command"])
