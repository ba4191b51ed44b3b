"""What the ``cluster``, ``checkpoints`` and ``fault`` commands share: the client they run with,
how they fail (one line ``error: <Code>: <message>`` on stderr, exit status 1), and how they show
results (tables, ``Label: value`` lines, JSON) and ``--wait`` progress.

Only the standard library is imported here at module level (see hyperpod_sim/cli/clusters.py).
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
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from hyperpod_sim.sdk.client import HyperPodClient

DEFAULT_ENDPOINT = "http://127.0.0.1:8080"
DEFAULT_WAIT_S = 600.0


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


def timestamp(value: object) -> str:
    """A time as every command shows it: ``2026-01-02 03:04:05 UTC`` (epoch seconds too)."""
    return _time(epoch_time(value))


def _time(value: object) -> str:
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return "-" if value is None else str(value)


def fields(pairs: Sequence[tuple[str, object]]) -> str:
    """``Label:  value`` lines, the values aligned."""
    width = max(len(label) for label, _ in pairs) + 2
    return "\n".join(f"{label + ':':<{width}}{_cell(value)}" for label, value in pairs)


def as_json(value: object) -> str:
    def default(item: object) -> str:
        if isinstance(item, datetime):
            return item.isoformat()
        raise TypeError(f"{type(item).__name__} is not JSON serializable")

    return json.dumps(value, indent=2, default=default)


def ranges(numbers: Iterable[int]) -> str:
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


def node_counts(cluster: dict[str, Any]) -> tuple[int, int]:
    """(Running nodes, target nodes) of a DescribeCluster answer."""
    groups = [*cluster.get("InstanceGroups", []), *cluster.get("RestrictedInstanceGroups", [])]
    running = sum(int(g.get("CurrentCount") or 0) for g in groups)
    return running, sum(int(g.get("TargetCount") or 0) for g in groups)


def status_line(cluster: dict[str, Any]) -> str:
    running, total = node_counts(cluster)
    return f"{cluster['ClusterName']}: {cluster['ClusterStatus']}, nodes {running}/{total} Running"


def wait_in_service(client: HyperPodClient, name: str, timeout: float) -> dict[str, Any]:
    progress = Progress(sys.stderr)
    try:
        cluster = client.wait_until_in_service(
            name, timeout=timeout, on_poll=lambda c: progress.show(status_line(c))
        )
    finally:
        progress.done()
    return cluster


def client_for(args: argparse.Namespace) -> HyperPodClient:
    from hyperpod_sim.sdk.client import HyperPodClient

    endpoint = args.endpoint_url or os.environ.get("HPSIM_ENDPOINT_URL") or DEFAULT_ENDPOINT
    # Credentials: the boto3 chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, --profile).
    return HyperPodClient(endpoint, profile=getattr(args, "profile", None))


def epoch_time(value: object) -> object:
    return datetime.fromtimestamp(value, tz=UTC) if isinstance(value, int | float) else value


def run(args: argparse.Namespace) -> int:
    """Run the command ``args.action`` names; errors as one line on stderr, exit status 1."""
    from hyperpod_sim.sdk.client import ClusterError

    action: Callable[[HyperPodClient, argparse.Namespace], int] = args.action
    try:
        with client_for(args) as client:
            return action(client, args)
    except (ClusterError, CommandError) as exc:
        message = flag_names(" ".join(exc.message.split()) or type(exc).__name__, getattr(args, "flags", {}))
        print(f"error: {exc.code or 'Error'}: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def flag_names(message: str, flags: dict[str, str]) -> str:
    """An error message with the request members it names ('durationSeconds', "ClusterName")
    written as the command's flags (--duration, --name): what the user typed."""
    for member, flag in flags.items():
        message = re.sub(rf"""(['"]){member}\1""", flag, message, flags=re.IGNORECASE)
    return message


def common_flags() -> argparse.ArgumentParser:
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


def wait_flags(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--wait", action="store_true", help=f"wait until the cluster is {what}, showing progress"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_WAIT_S,
        help=f"seconds --wait waits at most (default {DEFAULT_WAIT_S:g})",
    )


# ---------------------------------------------------------------------- commands on a node

NETNS_VARIABLE = "HPSIM_NODE_NETNS"  # in a node's session environment on the namespaces network


def exit_status(returncode: int) -> int:
    """A child's return code as a shell reports it: 128 + N for a child that signal N ended."""
    return 128 - returncode if returncode < 0 else returncode


def command_argv(given: Sequence[str], usage: str) -> list[str]:
    """The command after ``--`` of ``node exec`` and ``job run`` (argparse's REMAINDER keeps the
    ``--``); CommandError, naming ``usage``, when there is none."""
    argv = list(given)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise CommandError("ValidationException", f"no command to run: {usage}")
    return argv


def on_node(argv: Sequence[str], environment: dict[str, str], node_id: str, *, command: str) -> list[str]:
    """The command line that runs ``argv`` on the node whose session environment (StartNodeSession,
    StartJobAttempt) is ``environment``: ``argv`` itself, or on the namespaces node network the
    trampoline that enters the node's network namespace and execs ``argv`` (the pid stays, so its
    starter holds the command's process and process group). ``node exec`` and the job supervisor
    start their commands through it. AccessDeniedException without root
    (CAP_SYS_ADMIN), naming ``command``."""
    namespace = environment.get(NETNS_VARIABLE)
    if not namespace:
        return list(argv)
    if os.geteuid() != 0:
        raise CommandError(
            "AccessDeniedException",
            f"node {node_id} is the network namespace {namespace}: entering it takes root "
            f"(CAP_SYS_ADMIN); run {command} as root",
        )
    # hyperpod_sim/infra/netns_exec.py (standard library only), named, not imported: the cluster
    # commands stay clients (pyproject's import contracts).
    return [sys.executable, "-m", "hyperpod_sim.infra.netns_exec", namespace, "--", *argv]
