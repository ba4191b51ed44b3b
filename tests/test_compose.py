"""docker-compose.yml cannot run here (no Docker engine); check what can be checked without one:
every command it runs exists with the flags it passes, and every setting it sets exists."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml

from agents.config import AgentSettings
from hyperpod_sim.cli import build_parser
from hyperpod_sim.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def flags_of(subcommand: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {opt for action in sub.choices[subcommand]._actions for opt in action.option_strings}  # type: ignore[union-attr]


def argv(service: dict[str, Any]) -> list[str]:
    if "entrypoint" in service:
        script = service["entrypoint"][-1].replace("$$", "$")
        words = shlex.split(script.split("exec ", 1)[1])
        return words[1:]  # drop the program name
    return list(service["command"])


def test_services_and_dependencies() -> None:
    services = compose()["services"]
    assert set(services) == {"postgres", "control-plane", "agent"}
    assert services["control-plane"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["agent"]["depends_on"]["control-plane"]["condition"] == "service_healthy"


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
        assert key.removeprefix("HPSIM_AGENT_").lower() in AgentSettings.model_fields, key
    # The agents' bootstrap token is the one the control plane accepts.
    assert agent_env["HPSIM_AGENT_TOKEN"] == cp_env["HPSIM_PROVISIONING__BOOTSTRAP_TOKEN"]
