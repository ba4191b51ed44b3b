"""``hyperpod-sim cluster ...``, ``hyperpod-sim checkpoints`` and ``hyperpod-sim fault ...``: the
control plane from a shell,
built on the SDK's HyperPodClient (sdk/client.py; docs/sdk.md).

Only argparse is imported here at module level: ``hyperpod_sim.cli`` builds its parser from this
module for every subcommand, ``agent`` included, so the SDK (boto3, httpx) and PyYAML are imported
by the commands that use them. Results go to stdout, progress of ``--wait`` to stderr (one line
rewritten in place on a terminal), errors to stderr as one line ``error: <Code>: <message>`` with
exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from sdk.client import HyperPodClient

DEFAULT_ENDPOINT = "http://127.0.0.1:8080"
DEFAULT_EXECUTION_ROLE = "arn:aws:iam::123456789012:role/HyperPodExecution"
DEFAULT_EKS_CLUSTER_ARN = "arn:aws:eks:us-east-1:123456789012:cluster/hyperpod-sim"
DEFAULT_WAIT_S = 600.0
# The checkpoint policy's members (GET answers carry ClusterName, ClusterArn, PolicyGeneration too).
POLICY_MEMBERS = (
    "S3BaseUri",
    "PersistEverySteps",
    "PersistEverySeconds",
    "S3Retention",
    "InMemoryRetention",
    "ReplicationFactor",
    "AgentAccess",  # kept by --set like the others: a change of one member never reopens the agents
)


class CommandError(Exception):
    """A command that cannot be run as given (a bad file, a group with no type): not a refusal
    by the control plane, but reported the same way."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# ---------------------------------------------------------------------- output


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Plain-text columns, left-aligned, two spaces apart."""
    cells = [[str(c) for c in headers], *([_cell(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _cell(value: object) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, datetime):
        return _time(value)
    return str(value)


def _time(value: object) -> str:
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return "-" if value is None else str(value)


def fields(pairs: Sequence[tuple[str, object]]) -> str:
    """``Label:  value`` lines, the values aligned."""
    width = max(len(label) for label, _ in pairs) + 2
    return "\n".join(f"{label + ':':<{width}}{_cell(value)}" for label, value in pairs)


def _json(value: object) -> str:
    def default(item: object) -> str:
        if isinstance(item, datetime):
            return item.isoformat()
        raise TypeError(f"{type(item).__name__} is not JSON serializable")

    return json.dumps(value, indent=2, default=default)


def _ranges(numbers: Iterable[int]) -> str:
    """1, 2, 3, 5 -> '1-3,5'."""
    ordered = sorted(set(numbers))
    parts: list[str] = []
    start = 0
    for i, n in enumerate(ordered):
        if i + 1 == len(ordered) or ordered[i + 1] != n + 1:
            parts.append(str(n) if start == i else f"{ordered[start]}-{n}")
            start = i + 1
    return ",".join(parts)


class Progress:
    """What ``--wait`` shows: on a terminal one line rewritten in place, otherwise a plain line
    each time the status or the node count changes."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.started = time.monotonic()
        self.last: str | None = None

    def show(self, line: str) -> None:
        if self.tty:
            elapsed = time.monotonic() - self.started
            self.stream.write(f"\r\x1b[2K{line} ({elapsed:.0f} s)")
            self.stream.flush()
        elif line != self.last:
            self.stream.write(line + "\n")
            self.stream.flush()
        self.last = line

    def done(self) -> None:
        if self.tty and self.last is not None:
            self.stream.write("\n")
            self.stream.flush()


def _node_counts(cluster: dict[str, Any]) -> tuple[int, int]:
    """(Running nodes, target nodes) of a DescribeCluster answer."""
    groups = [*cluster.get("InstanceGroups", []), *cluster.get("RestrictedInstanceGroups", [])]
    running = sum(int(g.get("CurrentCount") or 0) for g in groups)
    return running, sum(int(g.get("TargetCount") or 0) for g in groups)


def _status_line(cluster: dict[str, Any]) -> str:
    running, total = _node_counts(cluster)
    return f"{cluster['ClusterName']}: {cluster['ClusterStatus']}, nodes {running}/{total} Running"


def _wait_in_service(client: HyperPodClient, name: str, timeout: float) -> dict[str, Any]:
    progress = Progress(sys.stderr)
    try:
        cluster = client.wait_until_in_service(
            name, timeout=timeout, on_poll=lambda c: progress.show(_status_line(c))
        )
    finally:
        progress.done()
    return cluster


# ---------------------------------------------------------------------- inputs


def _load_file(path: str) -> dict[str, Any]:
    """A request from a JSON or YAML file (``-``: standard input)."""
    import yaml

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CommandError("InvalidFile", f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        doc = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        problem = " ".join(str(exc).split())
        raise CommandError(
            "InvalidFile", f"{path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {problem}"
        ) from exc
    if not isinstance(doc, dict):
        raise CommandError(
            "InvalidFile", f"{path} must hold an object of request members, not {type(doc).__name__}"
        )
    return doc


_GROUP = re.compile(r"(?P<name>[^:]+)(:(?P<type>[^:]+))?:(?P<count>\d+)")


def group_flag(value: str) -> tuple[str, str | None, int]:
    """``NAME:TYPE:COUNT`` or ``NAME:COUNT`` (an existing group, on update)."""
    match = _GROUP.fullmatch(value)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not NAME:TYPE:COUNT (or NAME:COUNT for an existing group)"
        )
    return match["name"], match["type"], int(match["count"])


def tiered_flag(value: str) -> dict[str, Any]:
    """``PERCENT`` (Mode Enable with that InstanceMemoryAllocationPercentage) or ``off`` (Disable)."""
    if value.lower() in ("off", "disable"):
        return {"Mode": "Disable"}
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is neither a percentage nor 'off'")
    return {"Mode": "Enable", "InstanceMemoryAllocationPercentage": int(value)}


def setting_flag(value: str) -> tuple[str, object]:
    """``KEY=VALUE`` of a checkpoint policy: integers parsed, ``null``/``none`` unset the member."""
    key, sep, raw = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{value!r} is not KEY=VALUE")
    parsed: object = raw
    if raw.lower() in ("null", "none", ""):
        parsed = None
    elif re.fullmatch(r"-?\d+", raw):
        parsed = int(raw)
    return key, parsed


def _existing_spec(client: HyperPodClient, details: dict[str, Any]) -> dict[str, Any]:
    """An UpdateCluster group specification that keeps what DescribeCluster shows of a group
    (UpdateCluster replaces a named group's specification whole): the members that have the same
    shape in both. Those that differ (KubernetesConfig, InstanceRequirements, ...) are left out:
    update such a group with --file."""
    model = client.sagemaker.meta.service_model
    shown = model.shape_for("ClusterInstanceGroupDetails").members
    accepted = model.shape_for("ClusterInstanceGroupSpecification").members
    spec = {
        key: value
        for key, value in details.items()
        if key in accepted and key in shown and accepted[key].name == shown[key].name
    }
    if "DesiredImageId" in details:
        spec["ImageId"] = details["DesiredImageId"]
    return spec


# ---------------------------------------------------------------------- commands


def _client(args: argparse.Namespace) -> HyperPodClient:
    from sdk.client import HyperPodClient

    endpoint = args.endpoint_url or os.environ.get("HPSIM_ENDPOINT_URL") or DEFAULT_ENDPOINT
    # Credentials: the boto3 chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, --profile).
    return HyperPodClient(endpoint, profile=getattr(args, "profile", None))


def cluster_create(client: HyperPodClient, args: argparse.Namespace) -> int:
    request = _load_file(args.file) if args.file else {}
    if args.name:
        request["ClusterName"] = args.name
    if args.instance_group:
        groups = []
        for name, instance_type, count in args.instance_group:
            if instance_type is None:
                raise CommandError(
                    "InvalidArguments", f"--instance-group {name}:{count} needs a type: NAME:TYPE:COUNT"
                )
            groups.append(
                {
                    "InstanceGroupName": name,
                    "InstanceType": instance_type,
                    "InstanceCount": count,
                    "ExecutionRole": args.execution_role or DEFAULT_EXECUTION_ROLE,
                }
            )
        request["InstanceGroups"] = groups
    if args.eks_cluster_arn or not args.file:
        request["Orchestrator"] = {"Eks": {"ClusterArn": args.eks_cluster_arn or DEFAULT_EKS_CLUSTER_ARN}}
    if args.tiered_storage is not None:
        request["TieredStorageConfig"] = args.tiered_storage
    if args.node_recovery:
        request["NodeRecovery"] = args.node_recovery
    arn = client.create_cluster(**request)
    print(arn)
    if args.wait:
        _report_in_service(_wait_in_service(client, request["ClusterName"], args.timeout))
    return 0


def _report_in_service(cluster: dict[str, Any]) -> None:
    running, total = _node_counts(cluster)
    print(f"{cluster['ClusterName']} is {cluster['ClusterStatus']} ({running}/{total} nodes Running)")


def cluster_update(client: HyperPodClient, args: argparse.Namespace) -> int:
    request = _load_file(args.file) if args.file else {}
    request["ClusterName"] = args.name
    if args.instance_group:
        existing = {
            g["InstanceGroupName"]: g for g in client.describe_cluster(args.name).get("InstanceGroups", [])
        }
        groups = []
        for name, instance_type, count in args.instance_group:
            if name in existing:
                spec = _existing_spec(client, existing[name])
            elif instance_type is None:
                raise CommandError(
                    "InvalidArguments",
                    f"cluster {args.name} has no instance group {name!r}; a new group needs a type: "
                    f"--instance-group {name}:TYPE:{count}",
                )
            else:
                spec = {
                    "InstanceGroupName": name,
                    "ExecutionRole": args.execution_role or DEFAULT_EXECUTION_ROLE,
                }
            if instance_type is not None:
                spec["InstanceType"] = instance_type
            spec["InstanceCount"] = count
            groups.append(spec)
        request["InstanceGroups"] = groups
    if args.delete_instance_group:
        request["InstanceGroupsToDelete"] = args.delete_instance_group
    if args.tiered_storage is not None:
        request["TieredStorageConfig"] = args.tiered_storage
    if args.node_recovery:
        request["NodeRecovery"] = args.node_recovery
    print(client.update_cluster(**request))
    if args.wait:
        _report_in_service(_wait_in_service(client, args.name, args.timeout))
    return 0


def cluster_describe(client: HyperPodClient, args: argparse.Namespace) -> int:
    cluster = client.describe_cluster(args.name)
    if args.json:
        print(_json(cluster))
        return 0
    orchestrator = cluster.get("Orchestrator") or {}
    if "Eks" in orchestrator:
        orchestrated = f"EKS {orchestrator['Eks'].get('ClusterArn')}"
    elif "Slurm" in orchestrator:
        orchestrated = "Slurm"
    else:
        orchestrated = None
    tiered = cluster.get("TieredStorageConfig") or {}
    if tiered.get("Mode") == "Enable":
        storage = f"Enable ({tiered.get('InstanceMemoryAllocationPercentage')}% of instance memory)"
    else:
        storage = tiered.get("Mode") or "Disable"
    running, total = _node_counts(cluster)
    pairs: list[tuple[str, object]] = [
        ("Cluster", cluster["ClusterName"]),
        ("ARN", cluster["ClusterArn"]),
        ("Status", cluster["ClusterStatus"]),
        ("Created", cluster.get("CreationTime")),
        ("Nodes", f"{running}/{total} Running"),
        ("Orchestrator", orchestrated),
        ("Tiered storage", storage),
        ("Node recovery", cluster.get("NodeRecovery")),
    ]
    if cluster.get("FailureMessage"):
        pairs.append(("Failure", cluster["FailureMessage"]))
    print(fields(pairs))
    groups = [*cluster.get("InstanceGroups", []), *cluster.get("RestrictedInstanceGroups", [])]
    if groups:
        print()
        print(
            table(
                ["GROUP", "TYPE", "RUNNING", "TARGET", "STATUS"],
                [
                    [
                        g["InstanceGroupName"],
                        g.get("InstanceType"),
                        g.get("CurrentCount"),
                        g.get("TargetCount"),
                        g.get("Status"),
                    ]
                    for g in groups
                ],
            )
        )
    return 0


def cluster_list(client: HyperPodClient, args: argparse.Namespace) -> int:
    clusters = client.list_clusters()
    if args.json:
        print(_json(clusters))
    elif not clusters:
        print("No clusters.")
    else:
        print(
            table(
                ["NAME", "STATUS", "CREATED", "ARN"],
                [
                    [c["ClusterName"], c["ClusterStatus"], c.get("CreationTime"), c["ClusterArn"]]
                    for c in clusters
                ],
            )
        )
    return 0


def cluster_delete(client: HyperPodClient, args: argparse.Namespace) -> int:
    print(client.delete_cluster(args.name))
    if args.wait:
        progress = Progress(sys.stderr)
        try:
            client.wait_until_deleted(
                args.name, timeout=args.timeout, on_poll=lambda c: progress.show(_status_line(c))
            )
        finally:
            progress.done()
        print(f"{args.name} is deleted")
    return 0


def _s3_lag(agent: dict[str, Any]) -> str | None:
    s3 = agent.get("S3Tier")
    if not s3:
        return None
    lag = s3.get("LagSeconds")
    pending = s3.get("PendingSteps")
    text = f"{lag:.1f} s" if isinstance(lag, int | float) else "-"
    return f"{text} ({pending} pending)" if pending else text


def cluster_nodes(client: HyperPodClient, args: argparse.Namespace) -> int:
    nodes = client.list_nodes(args.name)
    if args.json:
        print(_json(nodes))
        return 0
    if not nodes:
        print(f"Cluster {args.name} has no nodes.")
        return 0
    # The cluster's policy generation: what every node's agent should have applied.
    desired = client.get_checkpoint_policy(args.name).get("PolicyGeneration")
    rows = []
    for node in nodes:
        agent = node.get("AgentStatus") or {}
        applied = agent.get("AppliedPolicyGeneration")
        rows.append(
            [
                node["InstanceId"],
                node.get("InstanceGroupName"),
                node.get("InstanceType"),
                (node.get("InstanceStatus") or {}).get("Status"),
                agent.get("Endpoint"),
                f"{applied}/{desired}" if agent else None,
                _s3_lag(agent),
            ]
        )
    print(table(["NODE", "GROUP", "TYPE", "STATUS", "AGENT", "POLICY (APPLIED/DESIRED)", "S3 LAG"], rows))
    return 0


def cluster_events(client: HyperPodClient, args: argparse.Namespace) -> int:
    events = client.events(args.name)
    if args.json:
        print(_json(events))
    elif not events:
        print(f"Cluster {args.name} has no events.")
    else:
        rows = [
            [
                e.get("EventTime"),
                e.get("EventLevel"),
                e.get("InstanceId") or e.get("InstanceGroupName") or e.get("ResourceType"),
                " ".join(str(e.get("Description") or "").split()),
            ]
            for e in events
        ]
        print(table(["TIME", "LEVEL", "RESOURCE", "DESCRIPTION"], rows))
    return 0


def cluster_policy(client: HyperPodClient, args: argparse.Namespace) -> int:
    policy = client.get_checkpoint_policy(args.name)
    if args.set:
        # PUT replaces the whole policy (omitted members take their defaults): keep what is set.
        body = {key: policy[key] for key in POLICY_MEMBERS if key in policy}
        body.update(dict(args.set))
        policy = client.put_checkpoint_policy(args.name, **body)
        if args.wait:
            _wait_in_service(client, args.name, args.timeout)
    if args.json:
        print(_json(policy))
        return 0
    pairs: list[tuple[str, object]] = [
        ("Cluster", policy.get("ClusterName")),
        ("PolicyGeneration", policy.get("PolicyGeneration")),
    ]
    pairs += [(key, policy.get(key)) for key in POLICY_MEMBERS]
    print(fields(pairs))
    return 0


def checkpoints(client: HyperPodClient, args: argparse.Namespace) -> int:
    listing = client.checkpoints(args.name)
    if args.json:
        print(_json(listing))
        return 0
    namespaces = listing.get("Namespaces", [])
    if not namespaces:
        print(f"Cluster {listing.get('ClusterName', args.name)} has no checkpoint namespaces.")
    for index, namespace in enumerate(namespaces):
        if index:
            print()
        ranks = int(namespace["NumRanks"])
        print(
            f"Namespace {namespace['Namespace']}: {ranks} ranks, "
            f"{namespace['StepsRetained']} steps kept in memory"
        )
        if not namespace["Steps"]:
            print("  no steps")
            continue
        rows = []
        for step in namespace["Steps"]:
            memory = {int(r) for r in step.get("Memory", {})}
            replicas = {int(r) for r in step.get("Replica", {})}
            missing = set(range(ranks)) - memory - replicas
            rows.append(
                [
                    step["Step"],
                    f"{len(memory)}/{ranks}",
                    f"{len(replicas)}/{ranks}",
                    "yes" if step.get("S3") else "no",
                    "yes" if step.get("Complete") else "no",
                    _ranges(missing) if missing else None,
                ]
            )
        print(table(["STEP", "IN MEMORY", "REPLICAS", "ON S3", "COMPLETE", "NOT IN MEMORY"], rows))
    unreachable = listing.get("Unreachable") or []
    if unreachable:
        print()
        print(f"Agents that did not answer (what they hold is not shown): {', '.join(unreachable)}")
    return 0


def _fault_details(fault: dict[str, Any]) -> str | None:
    parts = []
    if fault.get("LatencyMs") is not None:
        parts.append(f"{fault['LatencyMs']} ms")
    if fault.get("ErrorRate") is not None:
        parts.append(f"rate {fault['ErrorRate']:g} {fault.get('ErrorKind') or 'Throttle'}")
    if fault.get("DurationSeconds") is not None:
        parts.append(f"{fault['DurationSeconds']} s")
    elif fault.get("Type", "").startswith("S3"):
        parts.append("until cleared")
    return ", ".join(parts) or None


def _epoch(value: object) -> object:
    return datetime.fromtimestamp(value, tz=UTC) if isinstance(value, int | float) else value


def fault_inject(client: HyperPodClient, args: argparse.Namespace) -> int:
    spec: dict[str, Any] = {"Type": args.type}
    for member, value in (
        ("InstanceId", args.instance_id),
        ("DurationSeconds", args.duration),
        ("LatencyMs", args.latency_ms),
        ("ErrorRate", args.error_rate),
        ("ErrorKind", args.error_kind),
    ):
        if value is not None:
            spec[member] = value
    fault = client.inject_fault(args.name, **spec)
    if args.json:
        print(_json(fault))
        return 0
    pairs: list[tuple[str, object]] = [
        ("Fault", fault["FaultId"]),
        ("Type", fault["Type"]),
        ("Node", fault.get("InstanceId")),
        ("Details", _fault_details(fault)),
        ("Injected", _epoch(fault.get("InjectedAt"))),
        ("Ends", _epoch(fault.get("EndsAt"))),
    ]
    print(fields(pairs))
    return 0


def fault_list(client: HyperPodClient, args: argparse.Namespace) -> int:
    faults = client.list_faults(args.name)
    if args.json:
        print(_json(faults))
    elif not faults:
        print(f"Cluster {args.name} has no faults in force.")
    else:
        rows = [
            [
                f["FaultId"],
                f["Type"],
                f.get("InstanceId"),
                _fault_details(f),
                _epoch(f.get("InjectedAt")),
                _epoch(f.get("EndsAt")),
            ]
            for f in faults
        ]
        print(table(["FAULT", "TYPE", "NODE", "DETAILS", "INJECTED", "ENDS"], rows))
    return 0


def fault_clear(client: HyperPodClient, args: argparse.Namespace) -> int:
    fault = client.clear_fault(args.name, args.fault_id)
    print(f"{fault['FaultId']} ({fault['Type']}) cleared")
    return 0


def fault_database(client: HyperPodClient, args: argparse.Namespace) -> int:
    """``fault database --duration S`` starts a DatabaseOutage, ``--end`` ends the one in force,
    neither shows it."""
    if args.duration is not None:
        fault = client.inject_control_plane_fault(Type="DatabaseOutage", DurationSeconds=args.duration)
        print(f"{fault['FaultId']} (DatabaseOutage) until {_epoch(fault['EndsAt'])}")
        return 0
    faults = client.list_control_plane_faults()
    if not faults:
        print("The control plane's database answers: no DatabaseOutage in force.")
        return 0
    for fault in faults:
        if args.end:
            client.clear_control_plane_fault(fault["FaultId"])
            print(f"{fault['FaultId']} (DatabaseOutage) cleared")
        else:
            print(f"{fault['FaultId']} (DatabaseOutage) until {_epoch(fault['EndsAt'])}")
    return 0


# ---------------------------------------------------------------------- parser


def run(args: argparse.Namespace) -> int:
    """Run the command ``args.action`` names; errors as one line on stderr, exit status 1."""
    from sdk.client import ClusterError

    action: Callable[[HyperPodClient, argparse.Namespace], int] = args.action
    try:
        with _client(args) as client:
            return action(client, args)
    except (ClusterError, CommandError) as exc:
        message = " ".join(exc.message.split()) or type(exc).__name__
        print(f"error: {exc.code or 'Error'}: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--endpoint-url",
        help=f"the control plane (default: $HPSIM_ENDPOINT_URL, else {DEFAULT_ENDPOINT})",
    )
    common.add_argument(
        "--profile",
        help="the AWS profile whose access key signs the calls (default: the boto3 chain: "
        "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE)",
    )
    return common


def auth_token(args: argparse.Namespace) -> int:
    """Print the bearer token of the access key the other commands sign with."""
    from sdk.auth import bearer_token, resolve_access_key

    key = resolve_access_key(profile=args.profile)
    if key is None:
        print(
            "error: NoCredentials: no access key found: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE / --profile",
            file=sys.stderr,
        )
        return 1
    print(bearer_token(key.access_key_id, key.secret_access_key))
    return 0


def _wait_flags(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--wait", action="store_true", help=f"wait until the cluster is {what}, showing progress"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_WAIT_S,
        help=f"seconds --wait waits at most (default {DEFAULT_WAIT_S:g})",
    )


def _group_flags(parser: argparse.ArgumentParser, *, update: bool) -> None:
    parser.add_argument(
        "--instance-group",
        action="append",
        type=group_flag,
        metavar="NAME:TYPE:COUNT",
        help="an instance group (repeat for more)"
        + (
            "; NAME:COUNT rescales an existing group, keeping the rest of its specification" if update else ""
        ),
    )
    parser.add_argument(
        "--tiered-storage",
        type=tiered_flag,
        metavar="PERCENT|off",
        help="TieredStorageConfig: Mode Enable with this InstanceMemoryAllocationPercentage, "
        "or off (Disable)",
    )
    parser.add_argument("--node-recovery", choices=["Automatic", "None"], help="NodeRecovery")
    parser.add_argument(
        "--execution-role",
        metavar="ARN",
        help=f"ExecutionRole of new groups (default {DEFAULT_EXECUTION_ROLE})",
    )


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``cluster``, ``checkpoints`` and ``fault`` subcommands of ``hyperpod-sim``."""
    common = _common()
    cluster = sub.add_parser(
        "cluster",
        help="create, inspect, change and delete clusters",
        description="The control plane's clusters, through the SDK's HyperPodClient (docs/sdk.md).",
    )
    commands = cluster.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")

    create = commands.add_parser(
        "create",
        parents=[common],
        help="create a cluster",
        description="CreateCluster from a file (JSON or YAML: the request's members) and/or flags; "
        "flags override the file's members. Prints the cluster's ARN.",
    )
    create.add_argument("--file", "-f", help="the CreateCluster request, JSON or YAML ('-': stdin)")
    create.add_argument("--name", help="ClusterName")
    _group_flags(create, update=False)
    create.add_argument(
        "--eks-cluster-arn",
        metavar="ARN",
        help=f"Orchestrator.Eks.ClusterArn (default without --file: {DEFAULT_EKS_CLUSTER_ARN})",
    )
    _wait_flags(create, "InService")
    create.set_defaults(action=cluster_create)

    update = commands.add_parser(
        "update",
        parents=[common],
        help="update a cluster",
        description="UpdateCluster from a file (JSON or YAML) and/or flags. Groups not named are left "
        "alone. Prints the cluster's ARN.",
    )
    update.add_argument("name", help="the cluster")
    update.add_argument("--file", "-f", help="the UpdateCluster request, JSON or YAML ('-': stdin)")
    _group_flags(update, update=True)
    update.add_argument(
        "--delete-instance-group",
        action="append",
        metavar="NAME",
        help="InstanceGroupsToDelete (repeat for more)",
    )
    _wait_flags(update, "InService again")
    update.set_defaults(action=cluster_update)

    describe = commands.add_parser("describe", parents=[common], help="describe a cluster")
    describe.add_argument("name", help="the cluster (name or ARN)")
    describe.add_argument("--json", action="store_true", help="the DescribeCluster answer as JSON")
    describe.set_defaults(action=cluster_describe)

    listing = commands.add_parser("list", parents=[common], help="list clusters")
    listing.add_argument("--json", action="store_true", help="the cluster summaries as JSON")
    listing.set_defaults(action=cluster_list)

    delete = commands.add_parser("delete", parents=[common], help="delete a cluster")
    delete.add_argument("name", help="the cluster")
    _wait_flags(delete, "gone")
    delete.set_defaults(action=cluster_delete)

    nodes = commands.add_parser(
        "nodes",
        parents=[common],
        help="list a cluster's nodes and their agents",
        description="Each node with its agent: endpoint, policy generation applied / the cluster's, "
        "and the S3 tier's lag as its last heartbeat reported it.",
    )
    nodes.add_argument("name", help="the cluster")
    nodes.add_argument("--json", action="store_true", help="the node summaries (with AgentStatus) as JSON")
    nodes.set_defaults(action=cluster_nodes)

    events = commands.add_parser("events", parents=[common], help="list a cluster's events, newest first")
    events.add_argument("name", help="the cluster")
    events.add_argument("--json", action="store_true", help="the events as JSON")
    events.set_defaults(action=cluster_events)

    policy = commands.add_parser(
        "policy",
        parents=[common],
        help="show or change a cluster's checkpoint policy",
        description="Without --set: the checkpoint policy. With --set KEY=VALUE (repeatable): change "
        f"those members and keep the others ({', '.join(POLICY_MEMBERS)}; integers are parsed, "
        "null unsets a member); the change rolls out to every agent like UpdateCluster.",
    )
    policy.add_argument("name", help="the cluster")
    policy.add_argument(
        "--set", action="append", type=setting_flag, metavar="KEY=VALUE", help="a member to change"
    )
    policy.add_argument("--json", action="store_true", help="the policy as JSON")
    _wait_flags(policy, "InService again (with --set)")
    policy.set_defaults(action=cluster_policy)

    ckpt = sub.add_parser(
        "checkpoints",
        parents=[common],
        help="list a cluster's checkpoints and where they are held",
        description="Every checkpoint namespace of the cluster with its steps, newest first: how many "
        "ranks are held in memory as primary copies and as replicas, whether the step is on S3, and "
        "whether it is complete (restorable). Agents that do not answer are named.",
    )
    ckpt.add_argument("name", help="the cluster")
    ckpt.add_argument("--json", action="store_true", help="the listing as JSON")
    ckpt.set_defaults(action=checkpoints)

    fault = sub.add_parser(
        "fault",
        help="inject, list and clear faults (node and S3 faults)",
        description="Fault injection, a hyperpod-sim extension (docs/sdk.md#faults). Node faults "
        "(AgentCrash, NodeLoss, AgentHang, NetworkPartition) need --instance-id and the local "
        "provisioner; S3 faults "
        "(S3Latency, S3Errors, S3Outage) act on every agent of the cluster.",
    )
    faults = fault.add_subparsers(dest="fault_command", required=True, metavar="COMMAND")
    inject = faults.add_parser("inject", parents=[common], help="inject a fault")
    inject.add_argument("name", help="the cluster")
    inject.add_argument(
        "--type",
        required=True,
        choices=[
            "AgentCrash",
            "NodeLoss",
            "AgentHang",
            "NetworkPartition",
            "S3Latency",
            "S3Errors",
            "S3Outage",
        ],
        help="the fault",
    )
    inject.add_argument("--instance-id", metavar="ID", help="the node (node faults)")
    inject.add_argument(
        "--duration",
        type=int,
        metavar="S",
        help="DurationSeconds: AgentHang and NetworkPartition (required), S3 faults (default: until cleared)",
    )
    inject.add_argument("--latency-ms", type=int, metavar="MS", help="S3Latency: delay per S3 request")
    inject.add_argument(
        "--error-rate", type=float, metavar="RATE", help="S3Errors: share of requests failing"
    )
    inject.add_argument(
        "--error-kind", choices=["Throttle", "InternalError"], help="S3Errors: 503 SlowDown (default) or 500"
    )
    inject.add_argument("--json", action="store_true", help="the fault's record as JSON")
    inject.set_defaults(action=fault_inject)
    listed = faults.add_parser("list", parents=[common], help="list the faults in force")
    listed.add_argument("name", help="the cluster")
    listed.add_argument("--json", action="store_true", help="the faults as JSON")
    listed.set_defaults(action=fault_list)
    clear = faults.add_parser("clear", parents=[common], help="end an S3 fault or a hang now")
    clear.add_argument("name", help="the cluster")
    clear.add_argument("fault_id", metavar="ID", help="the fault (FaultId)")
    clear.set_defaults(action=fault_clear)
    database = faults.add_parser(
        "database",
        parents=[common],
        help="make the control plane's database unreachable for a while (DatabaseOutage)",
        description="The control plane answers 503 ServiceUnavailable until the outage ends; every "
        "cluster's events record it. Without options: the outage in force, if any.",
    )
    action = database.add_mutually_exclusive_group()
    action.add_argument("--duration", type=int, metavar="S", help="start an outage of S seconds (1..3600)")
    action.add_argument("--end", action="store_true", help="end the outage in force now")
    database.set_defaults(action=fault_database)
    for parser in (cluster, ckpt, fault):
        parser.set_defaults(func=run)
    token = sub.add_parser(
        "auth-token",
        help="print the bearer token of your access key (for curl and the browser)",
        description="The control plane's bearer token for the access key the other commands sign "
        "with (the boto3 chain, or --profile): send it as 'Authorization: Bearer <token>'. It is "
        "derived from the secret, so it changes when the secret does (docs/security.md).",
    )
    token.add_argument("--profile", help="the AWS profile (default: the boto3 chain)")
    token.set_defaults(func=auth_token)
