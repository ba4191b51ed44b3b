"""Settings of a node agent, from flags and ``HPSIM_AGENT_*`` environment variables.

Each flag of ``hyperpod-sim agent`` has an environment variable named after it:
``--control-plane`` is ``HPSIM_AGENT_CONTROL_PLANE``, ``--heartbeat-interval`` is
``HPSIM_AGENT_HEARTBEAT_INTERVAL`` (``HPSIM_AGENT_HEARTBEAT_INTERVAL_S`` works too). Flags win over
the environment. The retry knobs and the upload deadline (``HPSIM_AGENT_UPLOAD_DEADLINE_BASE_S``,
``HPSIM_AGENT_UPLOAD_MIN_RATE_BYTES_PER_S``) and the fast path's cap
(``HPSIM_AGENT_MAX_FAST_LEASES``) have no flag.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from hyperpod_sim.contracts.limits import DEFAULT_MAX_FAST_LEASES

_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HPSIM_AGENT_", extra="ignore", validate_by_name=True)

    control_plane: str = Field(description="Base URL of the control plane, e.g. http://127.0.0.1:8080.")
    cluster: str = Field(min_length=1, description="Name of the cluster this node belongs to.")
    token: SecretStr = Field(
        description="With --node-id: the node's launch secret, which the local provisioner puts in "
        "HPSIM_AGENT_TOKEN; without it: the cluster's bootstrap token (external provisioner)."
    )
    node_id: str | None = Field(
        default=None,
        description="This node's id (the local provisioner passes it, with the node's launch secret as "
        "the token). Without it the control plane binds the agent to a pending node slot and answers "
        "its id.",
    )
    host: str = Field(default="127.0.0.1", description="Address the agent API listens on.")
    port: int = Field(default=0, ge=0, le=65535, description="Port of the agent API; 0: any free port.")
    advertise_host: str | None = Field(
        default=None,
        description="Host the control plane and peers reach this agent at. Default: --host "
        "(loopback when --host is a wildcard address).",
    )
    data_dir: Path | None = Field(
        default=None,
        description="Directory for this node's local state, this user's only (made 0700): it keeps the "
        "key that seals the in-memory tier's sidecars (store.key). Without it the key is kept in the "
        "shared-memory directory.",
    )
    shm_dir: Path | None = Field(
        default=None,
        description="Shared-memory directory of the in-memory tier; default /dev/shm/hpsim/<node id>. "
        "The agent refuses to start if it, or a directory below it, is another user's or writable by "
        "others, or if a directory above it lets others rename what is in it (docs/security.md).",
    )
    replication: Literal["async", "sync"] = Field(
        default="async",
        description="async: a save is answered once the local copy is in memory, and replicated "
        "right after (the replication lag metric shows the window); sync: once the replicas are too.",
    )
    s3_endpoint_url: str | None = Field(
        default=None,
        description="S3 endpoint this agent uses for the S3 tier, instead of the one in the cluster's "
        "policy (for an agent that reaches S3 by another address). Credentials: the boto3 chain.",
    )
    drain_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="On SIGTERM, node deletion and Mode Disable: how long the agent may take to persist "
        "the newest complete step that S3 does not hold yet before it stops.",
    )
    upload_deadline_base_s: float = Field(
        default=30.0,
        gt=0,
        description="Every request body (a shard upload, a replica) must arrive within this many "
        "seconds plus its length at upload_min_rate_bytes_per_s, counted from its first read; after "
        "that the agent answers 408, closes the connection and gives back the memory reserved for it.",
    )
    upload_min_rate_bytes_per_s: float = Field(
        default=1024 * 1024,
        gt=0,
        description="The slowest transfer rate a request body may average (default 1 MiB/s): with the "
        "base of 30 s a 100 MiB shard has 130 s to arrive.",
    )
    max_fast_leases: int = Field(
        default=DEFAULT_MAX_FAST_LEASES,
        ge=1,
        description="The most same-host fast-path read leases this agent holds at once, and as many "
        "open fast-path writes: past it a locate (or a reserve) is answered 429 ResourceLimitExceeded "
        "until some are released or expire.",
    )
    instance_type: str | None = Field(default=None, description="Instance type reported at registration.")
    memory_bytes: int | None = Field(
        default=None, ge=0, description="Memory reported at registration. Default: this machine's."
    )
    heartbeat_interval_s: float = Field(
        default=1.0,
        gt=0,
        validation_alias=AliasChoices("HPSIM_AGENT_HEARTBEAT_INTERVAL", "HPSIM_AGENT_HEARTBEAT_INTERVAL_S"),
        description="Seconds between heartbeats. When not set explicitly, the interval the control "
        "plane answers at registration is used.",
    )
    log_level: str = Field(default="warning", description="Python logging level of the agent.")

    # Retry knobs (environment only).
    register_backoff_initial_s: float = Field(
        default=0.1, gt=0, description="First delay after a temporary failure (connect error, 5xx)."
    )
    register_backoff_max_s: float = Field(
        default=2.0, gt=0, description="Cap of the exponential backoff after temporary failures."
    )
    permanent_retry_s: float = Field(
        default=5.0,
        gt=0,
        description="Delay between tries after a permanent refusal (401/403, unknown cluster, ...).",
    )
    request_timeout_s: float = Field(default=5.0, gt=0, description="Timeout of one control plane call.")

    @field_validator("control_plane")
    @classmethod
    def _check_url(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if not value.startswith(("http://", "https://")) or value.endswith("://"):
            raise ValueError(f"control plane URL must be http:// or https:// with a host, got {value!r}")
        return value

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, value: str) -> str:
        value = value.strip().upper()
        if value not in {"CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"}:
            raise ValueError("log level must be one of critical, error, warning, info, debug")
        return value

    @property
    def heartbeat_interval_explicit(self) -> bool:
        """Whether the interval came from a flag or the environment (then the control plane's
        suggestion at registration does not override it)."""
        return "heartbeat_interval_s" in self.model_fields_set

    def advertised_host(self) -> str:
        host = self.advertise_host or _WILDCARDS.get(self.host, self.host)
        try:
            is_v6 = ipaddress.ip_address(host).version == 6
        except ValueError:
            is_v6 = False
        return f"[{host}]" if is_v6 else host

    def endpoint(self, port: int) -> str:
        """The URL this agent's API is reached at, once its port is known."""
        return f"http://{self.advertised_host()}:{port}"
