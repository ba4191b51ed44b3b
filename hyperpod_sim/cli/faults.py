"""``hyperpod-sim fault ...``: inject, list and clear faults (docs/sdk.md#faults), through the
SDK's HyperPodClient. The fault types, the members each takes and their limits are the extensions
model's (hyperpod_sim/contracts/simulator_api.json), read when the parser is built (JSON only, no botocore).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from hyperpod_sim.cli.common import as_json, epoch_time, fields, run, table, timestamp
from hyperpod_sim.contracts import simulator_api as extensions

if TYPE_CHECKING:
    from hyperpod_sim.sdk.client import HyperPodClient


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
        print(as_json(fault))
        return 0
    pairs: list[tuple[str, object]] = [
        ("Fault", fault["FaultId"]),
        ("Type", fault["Type"]),
        ("Node", fault.get("InstanceId")),
        ("Details", _fault_details(fault)),
        ("Injected", epoch_time(fault.get("InjectedAt"))),
        ("Ends", epoch_time(fault.get("EndsAt"))),
    ]
    print(fields(pairs))
    return 0


def fault_list(client: HyperPodClient, args: argparse.Namespace) -> int:
    faults = client.list_faults(args.name)
    if args.json:
        print(as_json(faults))
    elif not faults:
        print(f"Cluster {args.name} has no faults in force.")
    else:
        rows = [
            [
                f["FaultId"],
                f["Type"],
                f.get("InstanceId"),
                _fault_details(f),
                epoch_time(f.get("InjectedAt")),
                epoch_time(f.get("EndsAt")),
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
    """``fault database --duration S`` starts a DatabaseOutage (with ``--hang`` a DatabaseHang),
    ``--end`` ends the one in force, neither shows it."""
    if args.hang and args.duration is None:
        raise SystemExit("fault database: --hang needs --duration S")
    if args.duration is not None:
        kind = "DatabaseHang" if args.hang else "DatabaseOutage"
        fault = client.inject_control_plane_fault(Type=kind, DurationSeconds=args.duration)
        print(f"{fault['FaultId']} ({kind}) until {timestamp(fault['EndsAt'])}")
        return 0
    faults = client.list_control_plane_faults()
    if not faults:
        print("The control plane's database answers: no DatabaseOutage in force.")
        return 0
    for fault in faults:
        if args.end:
            client.clear_control_plane_fault(fault["FaultId"])
            print(f"{fault['FaultId']} ({fault['Type']}) cleared")
        else:
            print(f"{fault['FaultId']} ({fault['Type']}) until {timestamp(fault['EndsAt'])}")
    return 0


# The request members of `fault inject` and the flags that set them, for its error messages.
INJECT_FLAGS = {
    "Type": "--type",
    "InstanceId": "--instance-id",
    "DurationSeconds": "--duration",
    "LatencyMs": "--latency-ms",
    "ErrorRate": "--error-rate",
    "ErrorKind": "--error-kind",
}


def _span(shape: str) -> str:
    low, high = extensions.limits(shape)
    return f"{low}..{high}"


def _taking(member: str, *, required: bool = False) -> list[str]:
    """The fault types whose input shape takes (or requires) ``member``, in model order."""
    return [
        kind
        for kind in extensions.enum("FaultType")
        if member in (extensions.required if required else extensions.members)(f"{kind}InjectFaultRequest")
    ]


def _inject_flags(inject: argparse.ArgumentParser) -> None:
    node_faults = _taking("InstanceId", required=True)
    inject.add_argument("--type", required=True, choices=extensions.enum("FaultType"), help="the fault")
    inject.add_argument("--instance-id", metavar="ID", help=f"the node ({', '.join(node_faults)})")
    needed, optional = _taking("DurationSeconds", required=True), _taking("DurationSeconds")
    inject.add_argument(
        "--duration",
        type=int,
        metavar="S",
        help=f"DurationSeconds ({_span('FaultDurationSeconds')}): {', '.join(needed)} (required), "
        f"{', '.join(k for k in optional if k not in needed)} (default: until cleared)",
    )
    inject.add_argument(
        "--latency-ms",
        type=int,
        metavar="MS",
        help=f"{', '.join(_taking('LatencyMs'))}: delay per S3 request ({_span('LatencyMs')})",
    )
    low, high = extensions.limits("ErrorRate")
    inject.add_argument(
        "--error-rate",
        type=float,
        metavar="RATE",
        help=f"{', '.join(_taking('ErrorRate'))}: share of requests failing (above {low}, at most {high})",
    )
    inject.add_argument(
        "--error-kind",
        choices=extensions.enum("ErrorKind"),
        help=f"{', '.join(_taking('ErrorKind'))}: 503 SlowDown (Throttle, the default) or 500",
    )
    inject.add_argument("--json", action="store_true", help="the fault's record as JSON")
    inject.set_defaults(action=fault_inject, flags=INJECT_FLAGS)


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> argparse.ArgumentParser:
    """The ``fault`` subcommand of ``hyperpod-sim``, its choices and limits from the model."""
    node_faults = _taking("InstanceId", required=True)
    s3_faults = [kind for kind in extensions.enum("FaultType") if kind not in node_faults]
    fault = sub.add_parser(
        "fault",
        help="inject, list and clear faults (node and S3 faults)",
        description=f"Fault injection, a hyperpod-sim extension (docs/sdk.md#faults). Node faults "
        f"({', '.join(node_faults)}) need --instance-id and the local provisioner; S3 faults "
        f"({', '.join(s3_faults)}) act on every agent of the cluster.",
    )
    faults = fault.add_subparsers(dest="fault_command", required=True, metavar="COMMAND")
    inject = faults.add_parser("inject", parents=[common], help="inject a fault")
    inject.add_argument("name", help="the cluster")
    _inject_flags(inject)
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
        help="make the control plane's database unreachable (DatabaseOutage) or silent "
        "(--hang: DatabaseHang) for a while",
        description="The control plane answers 503 ServiceUnavailable until the outage ends (during a "
        "hang, a request whose database answer does not come within the statement timeout plus 2 s); "
        "every cluster's events record it. Without options: the outage or hang in force, if any.",
    )
    action = database.add_mutually_exclusive_group()
    action.add_argument(
        "--duration", type=int, metavar="S", help=f"start an outage of S seconds ({_span('OutageSeconds')})"
    )
    action.add_argument("--end", action="store_true", help="end the outage or hang in force now")
    database.add_argument(
        "--hang",
        action="store_true",
        help="with --duration: a DatabaseHang (connections accepted, nothing answers) instead",
    )
    database.set_defaults(action=fault_database, flags={"DurationSeconds": "--duration"})
    fault.set_defaults(func=run)
    return fault
