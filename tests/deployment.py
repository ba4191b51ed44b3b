"""What the deployment files (docker-compose.yml, the Kubernetes manifests) are checked against:
the flags of the CLI's subcommands, the environment the agents may take, where the
amzn-sagemaker-checkpointing library looks for the agents."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from hyperpod_sim.cli.main import build_parser


def flags_of(subcommand: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {opt for action in sub.choices[subcommand]._actions for opt in action.option_strings}  # type: ignore[union-attr]


# What the agents may take from the environment besides their own settings: the boto3 chain's
# variables, for the S3 tier's client.
BOTO3_VARIABLES = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"}


@dataclass(frozen=True)
class DaemonAddress:
    """Where the amzn-sagemaker-checkpointing library looks for HyperPod's daemon by default: the
    URL of ``InMemoryClientConfig().base_url``, and the Kubernetes Service it names."""

    url: str
    host: str
    service: str
    namespace: str
    port: int


def library_daemon_address() -> DaemonAddress:
    """Read from the installed library, so that a release moving the daemon fails these tests."""
    from amzn_sagemaker_checkpointing.config.in_memory_client import InMemoryClientConfig

    url = InMemoryClientConfig().base_url
    parts = urlsplit(url)
    assert parts.scheme == "http", url
    assert parts.hostname, url
    assert parts.port, url
    service, namespace, rest = parts.hostname.split(".", 2)
    assert rest == "svc.cluster.local", f"{url}: not a Kubernetes Service's name"
    return DaemonAddress(url=url, host=parts.hostname, service=service, namespace=namespace, port=parts.port)
