"""docker-compose.yml cannot run here (no Docker engine); check what can be checked without one:
every command it runs exists with the flags it passes, every setting it sets exists, and the agents
answer where the amzn-sagemaker-checkpointing library's default config looks for HyperPod's daemon."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from hyperpod_sim.agents.config import AgentSettings
from hyperpod_sim.settings import Settings
from tests.deployment import BOTO3_VARIABLES, flags_of, library_daemon_address

ROOT = Path(__file__).resolve().parent.parent


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def argv(service: dict[str, Any]) -> list[str]:
    if "entrypoint" in service:
        script = service["entrypoint"][-1].replace("$$", "$")
        words = shlex.split(script.split("exec ", 1)[1])
        return words[1:]  # drop the program name
    return list(service["command"])


def test_services_and_dependencies() -> None:
    services = compose()["services"]
    assert set(services) == {"postgres", "minio", "minio-init", "control-plane", "agent"}
    control_plane = services["control-plane"]["depends_on"]
    assert control_plane["postgres"]["condition"] == "service_healthy"
    # The bucket exists before the control plane hands its endpoint to any agent.
    assert control_plane["minio-init"]["condition"] == "service_completed_successfully"
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    assert services["agent"]["depends_on"]["control-plane"]["condition"] == "service_healthy"


def test_minio_serves_the_bucket_the_settings_name() -> None:
    services = compose()["services"]
    minio, init = services["minio"], services["minio-init"]
    assert minio["command"] == ["server", "/data"]
    assert init["environment"] == minio["environment"]  # the same root credentials
    script = init["entrypoint"][-1]
    assert "http://minio:9000" in script
    assert f"mc mb --ignore-existing hpsim/{Settings().s3.bucket}" in script


def test_commands_use_existing_flags() -> None:
    services = compose()["services"]
    for name, subcommand in (("control-plane", "serve"), ("agent", "agent")):
        words = argv(services[name])
        assert words[0] == subcommand
        used = {w for w in words if w.startswith("--")}
        assert used <= flags_of(subcommand), f"{name}: unknown flags {used - flags_of(subcommand)}"


def test_environment_names_existing_settings() -> None:
    services = compose()["services"]
    cp_env = services["control-plane"]["environment"]
    settings = Settings(**{})  # defaults
    for key in cp_env:
        assert key.startswith("HPSIM_")
        path = key.removeprefix("HPSIM_").lower().split("__")
        node: Any = settings
        for part in path:
            assert hasattr(node, part), f"{key}: no setting {part}"
            node = getattr(node, part)
    assert cp_env["HPSIM_PROVISIONING__MODE"] == "external"
    agent_env = services["agent"]["environment"]
    for key in agent_env:
        if key.startswith("HPSIM_AGENT_"):
            assert key.removeprefix("HPSIM_AGENT_").lower() in AgentSettings.model_fields, key
        else:
            assert key in BOTO3_VARIABLES, f"{key}: neither an agent setting nor a boto3 variable"
    # The agents' bootstrap token is the one the control plane accepts.
    assert agent_env["HPSIM_AGENT_TOKEN"] == cp_env["HPSIM_PROVISIONING__BOOTSTRAP_TOKEN"]
    # The agents sign their S3 requests with MinIO's credentials, for the region policies name.
    minio_env = services["minio"]["environment"]
    assert agent_env["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"]
    assert agent_env["AWS_SECRET_ACCESS_KEY"] == minio_env["MINIO_ROOT_PASSWORD"]
    assert agent_env["AWS_DEFAULT_REGION"] == settings.s3.region


def test_control_plane_environment_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The values, not only the names: the control plane starts with this environment, and uses
    MinIO instead of starting its embedded S3 endpoint."""
    for key in list(os.environ):
        if key.startswith("HPSIM_"):
            monkeypatch.delenv(key)
    for key, value in compose()["services"]["control-plane"]["environment"].items():
        monkeypatch.setenv(key, str(value))
    settings = Settings()
    assert settings.s3.endpoint_url == "http://minio:9000"
    assert settings.s3.embedded == "off"
    assert settings.provisioning.mode == "external"


def test_the_control_plane_runs_with_auth_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """It listens on the container network, which serve allows only with credentials; the agents
    and the healthcheck use the routes the credentials do not cover."""
    from hyperpod_sim.api.gate import AGENT_PREFIX, OPEN_PATHS
    from hyperpod_sim.cli.main import _is_loopback

    for key in list(os.environ):
        if key.startswith("HPSIM_"):
            monkeypatch.delenv(key)
    services = compose()["services"]
    for key, value in services["control-plane"]["environment"].items():
        monkeypatch.setenv(key, str(value))
    settings = Settings()
    assert not _is_loopback(settings.host)
    assert settings.auth.enabled
    assert settings.auth.credentials
    assert settings.auth.admin_credentials
    assert not set(settings.auth.credentials) & set(settings.auth.admin_credentials)
    healthcheck = " ".join(services["control-plane"]["healthcheck"]["test"])
    assert "http://127.0.0.1:8080/health" in healthcheck
    assert "/health" in OPEN_PATHS
    agent = " ".join(argv(services["agent"]))
    assert "--control-plane http://control-plane:8080" in agent  # it calls /agent/v1/* only
    assert AGENT_PREFIX == "/agent/"


def test_the_agents_are_where_the_library_looks() -> None:
    """A trainer container on compose's network with the library's default InMemoryClientConfig()
    reaches the agents: they carry its host name as a network alias (compose's DNS answers it with
    every replica's address) and listen at its port on every address of their container."""
    daemon = library_daemon_address()
    agent = compose()["services"]["agent"]
    assert daemon.host in agent["networks"]["default"]["aliases"]
    words = argv(agent)
    assert int(words[words.index("--port") + 1]) == daemon.port
    assert words[words.index("--host") + 1] == "0.0.0.0"
    # What each replica registers is its own address at that port, where peers replicate to it.
    assert words[words.index("--advertise-host") + 1] == "$(hostname -i | cut -d' ' -f1)"
