"""``hyperpod-sim cluster ...`` and ``hyperpod-sim checkpoints``: the control plane from a shell,
built on the SDK's HyperPodClient (hyperpod_sim/sdk/client.py; docs/sdk.md). ``hyperpod-sim fault ...`` is
hyperpod_sim/cli/faults.py; what the commands share, hyperpod_sim/cli/common.py.

Only argparse (and the extensions model's JSON, for the checkpoint policy's members) is loaded
here at module level: ``hyperpod_sim.cli.main`` builds its parser from this module for every
subcommand, ``agent`` included, so the SDK (boto3, httpx) and PyYAML are imported by the commands
that use them. Results go to stdout, progress of ``--wait`` to stderr (one line rewritten in place
on a terminal), errors to stderr as one line ``error: <Code>: <message>`` with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyperpod_sim.cli import faults as fault_cli
from hyperpod_sim.cli import jobs as job_cli
from hyperpod_sim.cli import nodes as node_cli
from hyperpod_sim.cli.common import (
    CommandError,
    Progress,
    as_json,
    common_flags,
    fields,
    node_counts,
    ranges,
    run,
    status_line,
    table,
    wait_flags,
    wait_in_service,
)
from hyperpod_sim.contracts import simulator_api as extensions

if TYPE_CHECKING:
    from hyperpod_sim.sdk.client import HyperPodClient

DEFAULT_EXECUTION_ROLE = "arn:aws:iam::123456789012:role/HyperPodExecution"
DEFAULT_EKS_CLUSTER_ARN = "arn:aws:eks:us-east-1:123456789012:cluster/hyperpod-sim"
# The checkpoint policy's members, from the model (GET answers carry ClusterName, ClusterArn and
# PolicyGeneration too). AgentAccess is kept by --set like the others: a change of one member
# never reopens the agents.
POLICY_MEMBERS = extensions.members("PutCheckpointPolicyRequest")


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
        _report_in_service(wait_in_service(client, request["ClusterName"], args.timeout))
    return 0


def _report_in_service(cluster: dict[str, Any]) -> None:
    running, total = node_counts(cluster)
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
        _report_in_service(wait_in_service(client, args.name, args.timeout))
    return 0


def cluster_describe(client: HyperPodClient, args: argparse.Namespace) -> int:
    cluster = client.describe_cluster(args.name)
    if args.json:
        print(as_json(cluster))
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
    running, total = node_counts(cluster)
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
        print(as_json(clusters))
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
                args.name, timeout=args.timeout, on_poll=lambda c: progress.show(status_line(c))
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
        print(as_json(nodes))
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
        print(as_json(events))
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
            wait_in_service(client, args.name, args.timeout)
    if args.json:
        print(as_json(policy))
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
        print(as_json(listing))
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
        # A step saved at another world size than the namespace's (resharding): a column says each's.
        resharded = any("WorldSize" in step for step in namespace["Steps"])
        for step in namespace["Steps"]:
            memory = {int(r) for r in step.get("Memory", {})}
            replicas = {int(r) for r in step.get("Replica", {})}
            missing = set(range(ranks)) - memory - replicas
            rows.append(
                [
                    step["Step"],
                    *([step.get("WorldSize", max(ranks - 1, 1))] if resharded else []),
                    f"{len(memory)}/{ranks}",
                    f"{len(replicas)}/{ranks}",
                    "unknown" if step.get("S3") is None else "yes" if step["S3"] else "no",
                    "yes" if step.get("Complete") else "no",
                    ranges(missing) if missing else None,
                ]
            )
        headers = ["STEP", *(["WORLD SIZE"] if resharded else []), "IN MEMORY", "REPLICAS", "ON S3"]
        print(table([*headers, "COMPLETE", "NOT IN MEMORY"], rows))
    unreachable = listing.get("Unreachable") or []
    if unreachable:
        print()
        print(f"Agents that did not answer (what they hold is not shown): {', '.join(unreachable)}")
    return 0


# ---------------------------------------------------------------------- parser


def auth_token(args: argparse.Namespace) -> int:
    """Print the bearer token of the access key the other commands sign with."""
    from hyperpod_sim.sdk.auth import bearer_token, resolve_access_key

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


# The CreateCluster/UpdateCluster members the flags set, for error messages.
CREATE_FLAGS = {
    "ClusterName": "--name",
    "InstanceGroups": "--instance-group",
    "TieredStorageConfig": "--tiered-storage",
    "NodeRecovery": "--node-recovery",
    "ExecutionRole": "--execution-role",
}


def _check_create(args: argparse.Namespace) -> str | None:
    """Without --file, a cluster needs a name and a group: argparse's message, before any call."""
    if args.file:
        return None
    missing = [
        flag
        for flag, value in (("--name", args.name), ("--instance-group", args.instance_group))
        if not value
    ]
    if missing:
        return f"the following arguments are required without --file: {', '.join(missing)}"
    return None


def _change_parsers(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``cluster create`` and ``cluster update``."""
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
    wait_flags(create, "InService")
    create.set_defaults(action=cluster_create, check=_check_create, check_parser=create, flags=CREATE_FLAGS)

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
    wait_flags(update, "InService again")
    update.set_defaults(action=cluster_update, flags=CREATE_FLAGS)


def _inspect_parsers(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """``cluster describe``, ``list``, ``delete``, ``nodes``, ``events`` and ``policy``."""
    describe = commands.add_parser("describe", parents=[common], help="describe a cluster")
    describe.add_argument("name", help="the cluster (name or ARN)")
    describe.add_argument("--json", action="store_true", help="the DescribeCluster answer as JSON")
    describe.set_defaults(action=cluster_describe)

    listing = commands.add_parser("list", parents=[common], help="list clusters")
    listing.add_argument("--json", action="store_true", help="the cluster summaries as JSON")
    listing.set_defaults(action=cluster_list)

    delete = commands.add_parser("delete", parents=[common], help="delete a cluster")
    delete.add_argument("name", help="the cluster")
    wait_flags(delete, "gone")
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
    wait_flags(policy, "InService again (with --set)")
    policy.set_defaults(action=cluster_policy)


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``cluster``, ``checkpoints`` and ``fault`` subcommands of ``hyperpod-sim``."""
    common = common_flags()
    cluster = sub.add_parser(
        "cluster",
        help="create, inspect, change and delete clusters",
        description="The control plane's clusters, through the SDK's HyperPodClient (docs/sdk.md).",
    )
    commands = cluster.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")
    _change_parsers(commands, common)
    _inspect_parsers(commands, common)

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

    fault = fault_cli.add_parser(sub, common)
    node = node_cli.add_parser(sub, common)
    job = job_cli.add_parser(sub, common)
    for parser in (cluster, ckpt, fault, node, job):
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
