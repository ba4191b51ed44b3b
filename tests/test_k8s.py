"""deploy/'s Kubernetes manifests, checked offline: each resource against the Kubernetes schemas
(kubernetes-validate), the kustomization against the files, and what tests/test_compose.py checks
of docker-compose.yml: every command's flags and every setting the manifests set exist, the values
parse, and the secrets the containers name are in the Secret."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from hyperpod_sim.agents.config import AgentSettings
from hyperpod_sim.settings import Settings
from tests.test_compose import BOTO3_VARIABLES, flags_of

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
KUBERNETES = "1.30.0"
# Variables Kubernetes fills in itself (the downward API), which the agents' arguments name.
DOWNWARD_API = {"POD_IP"}


def kustomization() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    return data


def resources() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for name in kustomization()["resources"]:
        found += [doc for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc]
    return found


def resource(kind: str, name: str) -> dict[str, Any]:
    return next(r for r in resources() if r["kind"] == kind and r["metadata"]["name"] == name)


def container(kind: str, name: str) -> dict[str, Any]:
    spec = resource(kind, name)["spec"]["template"]["spec"]
    found: dict[str, Any] = spec["containers"][0]
    return found


def secret() -> dict[str, str]:
    data: dict[str, str] = resource("Secret", "hyperpod-sim")["stringData"]
    return data


def environment(entry: dict[str, Any]) -> dict[str, str]:
    """A container's environment as it starts: secret references resolved from the Secret."""
    values: dict[str, str] = {}
    for variable in entry.get("env", []):
        if "value" in variable:
            values[variable["name"]] = variable["value"]
        elif "secretKeyRef" in variable.get("valueFrom", {}):
            ref = variable["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "hyperpod-sim", variable
            assert ref["key"] in secret(), f"{variable['name']}: no key {ref['key']} in the Secret"
            values[variable["name"]] = secret()[ref["key"]]
        else:
            values[variable["name"]] = "<downward API>"
    return values


def test_the_kustomization_lists_every_file() -> None:
    listed = set(kustomization()["resources"])
    assert listed == {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert kustomization()["namespace"] == "hyperpod-sim"


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
    cp_env = environment(container("Deployment", "control-plane"))
    for key in cp_env:
        assert key.startswith("HPSIM_")
        node: Any = settings
        for part in key.removeprefix("HPSIM_").lower().split("__"):
            assert hasattr(node, part), f"{key}: no setting {part}"
            node = getattr(node, part)
    agent = container("DaemonSet", "agent")
    agent_env = environment(agent)
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
    minio_env = environment(container("Deployment", "minio"))
    assert agent_env["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"]
    assert agent_env["AWS_SECRET_ACCESS_KEY"] == minio_env["MINIO_ROOT_PASSWORD"]
    assert agent_env["AWS_DEFAULT_REGION"] == settings.s3.region


def test_the_services_are_where_the_settings_point() -> None:
    cp_env = environment(container("Deployment", "control-plane"))
    ports = {
        r["metadata"]["name"]: r["spec"]["ports"][0]["port"] for r in resources() if r["kind"] == "Service"
    }
    assert cp_env["HPSIM_PUBLIC_URL"] == f"http://control-plane:{ports['control-plane']}"
    assert cp_env["HPSIM_S3__ENDPOINT_URL"] == f"http://minio:{ports['minio']}"
    assert f"@postgres:{ports['postgres']}/" in cp_env["HPSIM_DATABASE__URL"]
    agent_args = container("DaemonSet", "agent")["args"]
    assert agent_args[agent_args.index("--control-plane") + 1] == cp_env["HPSIM_PUBLIC_URL"]
    script = container("Job", "minio-init")["command"][-1]
    assert f"mc mb --ignore-existing hpsim/{Settings().s3.bucket}" in script
    assert "http://minio:9000" in script
    # The database URL's password is the one PostgreSQL starts with.
    postgres_env = environment(container("StatefulSet", "postgres"))
    assert f":{postgres_env['POSTGRES_PASSWORD']}@" in cp_env["HPSIM_DATABASE__URL"]


def test_control_plane_environment_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The values, not only the names: the control plane starts with this environment (auth on, as
    serve demands on 0.0.0.0), on PostgreSQL, with MinIO instead of its embedded S3 endpoint."""
    from hyperpod_sim.cli import _is_loopback

    for key in list(os.environ):
        if key.startswith("HPSIM_"):
            monkeypatch.delenv(key)
    for key, value in environment(container("Deployment", "control-plane")).items():
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
