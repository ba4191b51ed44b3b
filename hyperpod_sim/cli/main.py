"""The ``hyperpod-sim`` command. A thin shell: each subcommand imports its side lazily, so the
SDK-only install never pulls in the server."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyperpod_sim import __version__

log = logging.getLogger("hyperpod_sim.serve")

if TYPE_CHECKING:
    import socket

    from hyperpod_sim.serve import process as serving
    from hyperpod_sim.settings import Settings

DESCRIPTION = """A local SageMaker HyperPod control plane with managed tiered checkpointing: run it
(serve), its node agents (agent), and drive it from a shell (cluster, checkpoints, fault); demo
shows the whole story. Run `hyperpod-sim COMMAND --help` for a command's options."""


def port_number(value: str) -> int:
    """A TCP port for ``--port``: 0 (any free one) to 65535."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: use 1..65535 (or 0: any free one)")
    return port


def _serve(args: argparse.Namespace) -> int:
    from hyperpod_sim.contracts.shm import UnsafeDirectory
    from hyperpod_sim.serve import node_network
    from hyperpod_sim.serve import process as serving
    from hyperpod_sim.settings import get_settings

    settings = get_settings(
        host=args.host, port=args.port, data_dir=args.data_dir, database_url=args.database_url
    )
    if args.node_network is not None:
        settings = node_network.with_network(settings, args.node_network)
    if not settings.auth.enabled and not _is_loopback(settings.host):
        print(
            f"hyperpod-sim serve: refusing to listen on {settings.host} without credentials: anyone "
            "who can reach it could drive every cluster. Configure them, e.g.\n"
            """  HPSIM_AUTH__CREDENTIALS='{"AKIDEXAMPLE": "a-long-random-secret"}'\n"""
            """  HPSIM_AUTH__ADMIN_CREDENTIALS='{"AKIDADMIN": "another-secret"}'  (optional: faults)\n"""
            "and sign with them (boto3, the AWS CLI, HyperPodClient); or listen on 127.0.0.1. "
            "See docs/security.md.",
            file=sys.stderr,
        )
        return 2
    try:
        serving.prepare_shm_root(settings)
    except UnsafeDirectory as exc:
        print(
            f"hyperpod-sim serve: refusing the shared-memory root: {exc}. Remove it (the checkpoints in "
            "it cannot be trusted), or set HPSIM_SIMULATION__SHM_ROOT to a directory of this user's "
            "only. See docs/security.md.",
            file=sys.stderr,
        )
        return 1
    try:
        with (
            serving.StopSignals() as early,
            serving.hold_lock(settings),
            serving.bind(settings.host, settings.port) as listener,
        ):
            network = node_network.prepare(settings)  # the bridge, before anything needs it
            with node_network.gateway_listener(network, listener.getsockname()[1]) as extra:
                return _serve_locked(settings, args.log_level, listener, early, extra=extra)
    except (serving.AlreadyServing, serving.PortUnavailable, node_network.NodeNetworkUnavailable) as exc:
        print(f"hyperpod-sim serve: {exc}", file=sys.stderr)
        return 1


def _serve_locked(
    settings: Settings,
    log_level: str,
    listener: socket.socket,
    early: serving.StopSignals,
    *,
    extra: Sequence[socket.socket] = (),
) -> int:
    """``serve`` once it holds the data dir and its port (hyperpod_sim/serve/process.py); ``extra``:
    the bridge's gateway listener of the namespaces node network (hyperpod_sim/serve/node_network.py)."""
    from hyperpod_sim.api.app import create_app
    from hyperpod_sim.infra.netns import node_network as namespaces_network
    from hyperpod_sim.serve import node_network
    from hyperpod_sim.serve import process as serving

    # --port 0: the one the system chose (a copy: get_settings' object is shared).
    settings = settings.model_copy(update={"port": listener.getsockname()[1]})

    embedded = None
    agent_env: dict[str, str] = {}
    if settings.s3.embedded != "off" and settings.s3.endpoint_url is None:
        from hyperpod_sim.serve.embedded_s3 import EmbeddedS3Error, start_embedded_s3

        try:
            embedded = start_embedded_s3(settings.s3, data_dir=settings.data_dir)
        except EmbeddedS3Error as exc:
            print(f"hyperpod-sim serve: {exc}", file=sys.stderr, flush=True)
            return 1
        # From here on the embedded endpoint is the endpoint: policies hand it to the agents.
        s3 = settings.s3.model_copy(update={"endpoint_url": embedded.endpoint_url})
        settings = settings.model_copy(update={"s3": s3})
        agent_env = embedded.agent_env()
        print(embedded.banner(), flush=True)
        if settings.provisioning.mode == "external":
            print(external_agents_and_embedded_s3(embedded.endpoint_url), file=sys.stderr, flush=True)
    network = namespaces_network(settings) if extra else None
    relay = None
    try:
        if network is not None:
            if embedded is not None:  # the nodes cannot reach the host's 127.0.0.1: a relay on the bridge
                relay, relayed = node_network.relay_s3(network, embedded.endpoint_url)
                settings = settings.model_copy(
                    update={"s3": settings.s3.model_copy(update={"endpoint_url": relayed})}
                )
            print(node_network.banner(network, settings.port), flush=True)
        app = create_app(settings, agent_env=agent_env)
        if embedded is not None:
            embedded.supervise(_s3_events(app))
        print(
            f"hyperpod-sim control plane on http://{settings.host}:{settings.port} "
            f"(database: {settings.database_url()}; {_auth_line(settings)})\n"
            f"console at http://{settings.host}:{settings.port}/console",
            flush=True,
        )
        # What is built so far (modules, the API's routes and models, botocore's service model)
        # lives as long as the process: out of the collector's way, so that a full collection
        # scans only what serving allocates (measured: 30 ms -> 0 for these objects alone).
        gc.freeze()
        # Returns after SIGINT or SIGTERM once the agents have stopped (drained to the S3 below).
        served = node_network.SubnetGuard(app, network) if network is not None else app
        serving.run(served, listener=listener, log_level=log_level, early=early, extra=extra)
    finally:
        if relay is not None:
            relay.stop()
        if embedded is not None:
            embedded.stop()
    return 0


def external_agents_and_embedded_s3(endpoint_url: str) -> str:
    """serve's warning when the external provisioner meets the embedded S3: the policies hand its
    loopback URL to agents that run elsewhere (docker compose, a DaemonSet, another namespace), and
    its credentials go only to the agents serve starts, so every persist of theirs would fail."""
    return (
        f"hyperpod-sim serve: warning: the embedded S3 at {endpoint_url} listens on this machine's "
        "loopback only, and only agents that serve starts get its credentials: the external "
        "provisioner's agents cannot persist checkpoints to it. Set HPSIM_S3__ENDPOINT_URL to an S3 "
        "endpoint they reach (docker-compose.yml and deploy/ use MinIO), or HPSIM_S3__EMBEDDED=off "
        "for the in-memory tier only (docs/kubernetes.md)."
    )


def _s3_events(app: Any) -> Callable[[str, str], None]:
    """What the embedded S3's supervisor tells: a cluster event on each cluster persisting to it
    (the app's services exist once its lifespan has started; before, a log line only)."""
    from hyperpod_sim.domain.events import Level

    def record(level: str, message: str) -> None:
        services = getattr(app.state, "services", None)
        if services is None:
            log.warning("%s", message)
            return
        named = services.clusters.record_s3_event(level=Level(level), description=message)
        log.info("recorded on %d cluster(s): %s", len(named), message)

    return record


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def _auth_line(settings: Settings) -> str:
    auth = settings.auth
    if not auth.enabled:
        return "auth off: loopback only, no credentials configured"
    admins = f", {len(auth.admin_credentials)} admin" if auth.admin_credentials else ""
    return f"auth on: {len(auth.credentials)} access key(s){admins}"


_AGENT_FLAGS = (
    "control_plane",
    "cluster",
    "token",
    "node_id",
    "host",
    "port",
    "advertise_host",
    "data_dir",
    "shm_dir",
    "replication",
    "instance_type",
    "heartbeat_interval_s",
    "memory_bytes",
    "log_level",
)


def _agent_flag(loc: tuple[int | str, ...]) -> str:
    name = str(loc[0]) if loc else "settings"
    if name.startswith("HPSIM_AGENT_"):  # an alias: the environment variable itself
        name = name.removeprefix("HPSIM_AGENT_").lower()
    if name not in _AGENT_FLAGS and f"{name}_s" not in _AGENT_FLAGS:
        return f"HPSIM_AGENT_{name.upper()}"  # a setting without a flag
    name = name.removesuffix("_s") if name == "heartbeat_interval_s" else name
    return f"--{name.replace('_', '-')} (HPSIM_AGENT_{name.upper()})"


def _agent(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from hyperpod_sim.agents.config import AgentSettings
    from hyperpod_sim.agents.main import run

    # Flags win over HPSIM_AGENT_* variables: only the flags given are passed on.
    overrides = {name: getattr(args, name) for name in _AGENT_FLAGS if getattr(args, name) is not None}
    try:
        settings = AgentSettings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{_agent_flag(error['loc'])}: {error['msg']}" for error in exc.errors(include_url=False)
        )
        print(f"hyperpod-sim agent: invalid settings: {problems}", file=sys.stderr)
        return 2
    return run(settings)


def _agent_launcher(args: argparse.Namespace) -> int:
    import hyperpod_sim.agents.main  # noqa: F401 (what each forked agent runs, imported once here)
    from hyperpod_sim.agents.launcher.server import run_launcher
    from hyperpod_sim.settings import default_agent_command

    # Each forked agent runs `hyperpod-sim agent ...` as this command would, from its arguments,
    # with the parser built here once (building it in each agent cost 2.6 MiB of private memory).
    parser = build_parser()
    return run_launcher(
        socket_path=Path(args.socket),
        parent=args.parent,
        entry=lambda argv: main(argv, parser=parser),
        agent_command=default_agent_command(),
        merge_pages=args.merge_pages,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyperpod-sim", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the control plane",
        description="Run the control plane. Every flag can also be set by environment "
        "(HPSIM_HOST, HPSIM_PORT, HPSIM_DATABASE__URL, HPSIM_DATA_DIR). Without "
        "HPSIM_S3__ENDPOINT_URL it also starts an embedded S3 endpoint: SeaweedFS, durable, its "
        "data in the data dir, on port 8333 (HPSIM_S3__EMBEDDED_PORT); HPSIM_S3__EMBEDDED=moto for "
        "moto's in memory, =off for none.",
    )
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=port_number, help="port to listen on (default 8080; 0: any free one)")
    serve.add_argument("--database-url", help="SQLAlchemy URL (default: SQLite in the data dir)")
    serve.add_argument("--data-dir", help="directory for local state (default .hyperpod-sim)")
    serve.add_argument("--log-level", default="warning", help="uvicorn log level")
    serve.add_argument(
        "--node-network",
        choices=["loopback", "shared", "namespaces"],
        help="the nodes' network (HPSIM_PROVISIONING__NODE_NETWORK; namespaces: Linux, root; docs/nodes.md)",
    )
    serve.set_defaults(func=_serve)

    agent = sub.add_parser(
        "agent",
        help="run a node agent",
        description="Run a node agent (docs/agent-protocol.md). Every flag can also be set by "
        "environment: HPSIM_AGENT_CONTROL_PLANE, HPSIM_AGENT_CLUSTER, HPSIM_AGENT_TOKEN, "
        "HPSIM_AGENT_NODE_ID, ... (the flag's name, upper case, after HPSIM_AGENT_).",
    )
    agent.add_argument("--control-plane", help="control plane URL, e.g. http://127.0.0.1:8080")
    agent.add_argument("--cluster", help="cluster name")
    agent.add_argument(
        "--token",
        help="the node's launch secret with --node-id, the bootstrap token without "
        "(better in HPSIM_AGENT_TOKEN: a flag shows in ps)",
    )
    agent.add_argument("--node-id", help="this node's id (without it, the control plane assigns one)")
    agent.add_argument("--host", help="address the agent API listens on (default 127.0.0.1)")
    agent.add_argument(
        "--port",
        type=port_number,
        help="port of the agent API (default 0: any free port)",
    )
    agent.add_argument("--advertise-host", help="host to reach this agent at (default: --host)")
    agent.add_argument("--data-dir", help="directory for this node's local state")
    agent.add_argument(
        "--shm-dir",
        help="shared-memory directory of the in-memory checkpoint tier (default /dev/shm/hpsim/<node>)",
    )
    agent.add_argument(
        "--replication",
        choices=["async", "sync"],
        help="answer a save after the local copy (async, default) or after the replicas too (sync)",
    )
    agent.add_argument("--instance-type", help="instance type reported at registration")
    agent.add_argument(
        "--heartbeat-interval",
        dest="heartbeat_interval_s",
        type=float,
        help="seconds between heartbeats (default 1.0, or what the control plane answers)",
    )
    agent.add_argument(
        "--memory-bytes", type=int, help="memory reported at registration (default: this machine's)"
    )
    agent.add_argument("--log-level", help="logging level (default warning)")
    agent.set_defaults(func=_agent)

    launcher = sub.add_parser(
        "agent-launcher",
        help="fork node agents for serve (serve starts it)",
        description="The agent launcher of serve's local provisioner: it imports the agent once and "
        "forks one agent per node on serve's request, over a Unix socket only serve's user may use "
        "(docs/nodes.md). serve starts and stops it; it exits when serve is gone.",
    )
    launcher.add_argument("--socket", required=True, help="the Unix socket to listen on")
    launcher.add_argument("--parent", type=int, required=True, help="exit once this pid is not the parent")
    launcher.add_argument("--room", default="", help="padding: room for a forked agent's command line")
    launcher.add_argument(
        "--no-merge-pages",
        dest="merge_pages",
        action="store_false",
        help="do not mark the agents' memory mergeable by the kernel's same-page merging (KSM)",
    )
    launcher.set_defaults(func=_agent_launcher)

    from hyperpod_sim.cli import (
        clusters as cluster_cli,  # argparse only: the SDK is imported when a command runs
    )

    cluster_cli.add_parsers(sub)
    from hyperpod_sim.cli import demo  # argparse only at this point

    demo.add_parser(sub)
    return parser


# The extra that brings each third-party module a command may need, for the one-line message of
# a command run without it (the SDK's own dependencies come with every install).
EXTRA_OF = {
    **dict.fromkeys(
        ("fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "psycopg", "moto", "regex"),
        "server",
    ),
    "torch": "trainer",
}


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """``needs the 'server' extra ...`` for a module of one of our extras, else None."""
    top = (exc.name or "").partition(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        return None
    return f"needs the '{extra}' extra (no module {top!r}): pip install 'hyperpod-sim[{extra}]'"


def main(argv: Sequence[str] | None = None, *, parser: argparse.ArgumentParser | None = None) -> int:
    """The command; ``parser``: one already built (the agent launcher's, shared by its agents)."""
    args = (parser or build_parser()).parse_args(argv)
    # What argparse cannot say alone (``cluster create`` needs --name unless --file gives it):
    # its usage line and message, exit status 2.
    check = getattr(args, "check", None)
    problem = check(args) if check is not None else None
    if problem is not None:
        args.check_parser.error(problem)
    try:
        result: int = args.func(args)
    except ModuleNotFoundError as exc:
        message = missing_extra(exc)
        if message is None:
            raise
        print(f"hyperpod-sim {args.command}: {message}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as cat does; the interpreter's own flush
        # of stdout at exit would fail again, so stdout goes to /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for such a writer
    return result


if __name__ == "__main__":
    sys.exit(main())
