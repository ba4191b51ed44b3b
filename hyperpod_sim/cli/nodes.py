"""``hyperpod-sim node exec``: run a command on a node of a cluster, as ``ssh node CMD`` would.

The command runs on this machine with this terminal's stdin, stdout and stderr, in the node's
environment (StartNodeSession: the node, its agent, the control plane as the node reaches it),
and this command's exit status is its own (128 + N when signal N ended it). On the namespaces
node network it runs inside the node's network namespace (hyperpod_sim/infra/netns_exec.py). It
belongs to the node: losing the node (a NodeLoss, a reboot, its deletion) ends it and its
children (docs/nodes.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

from hyperpod_sim.cli.common import command_argv, exit_status, on_node

if TYPE_CHECKING:
    from hyperpod_sim.sdk.client import HyperPodClient


def node_exec(client: HyperPodClient, args: argparse.Namespace) -> int:
    argv = command_argv(args.argv, "hyperpod-sim node exec --cluster C NODE_ID -- CMD [ARGS...]")
    opened = client.start_node_session(args.cluster, args.node_id)
    env = {**os.environ, **opened["Environment"]}
    # On the namespaces node network CMD runs inside the node's network namespace.
    argv = on_node(argv, opened["Environment"], opened["NodeId"], command="node exec")
    try:
        child = subprocess.Popen(argv, env=env)
    except OSError as exc:
        print(f"hyperpod-sim node exec: cannot run {argv[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    # A Ctrl+C in this terminal reaches the command too (the same process group): it decides.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    forward = {
        signum: signal.signal(signum, lambda n, _f: child.send_signal(n))
        for signum in (signal.SIGTERM, signal.SIGHUP)
    }
    try:
        returncode = child.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
        for signum, handler in forward.items():
            signal.signal(signum, handler)
    if returncode == -signal.SIGKILL:
        print(
            f"hyperpod-sim node exec: the command was killed (SIGKILL): node {opened['NodeId']} may "
            "have been lost or deleted",
            file=sys.stderr,
        )
    return exit_status(returncode)


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> argparse.ArgumentParser:
    """The ``node`` subcommand of ``hyperpod-sim``."""
    node = sub.add_parser(
        "node",
        help="run commands on a cluster's nodes",
        description="Commands on a node of a cluster of the local provisioner (docs/nodes.md).",
    )
    commands = node.add_subparsers(dest="node_command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "exec",
        parents=[common],
        help="run a command on a node",
        description="Run CMD on node NODE_ID with this terminal's input and output, in the node's "
        "environment: HPSIM_NODE_ID, HPSIM_NODE_ADDRESS, HPSIM_CLUSTER, HPSIM_AGENT_URL (its "
        "agent, which the SDK reads) and HPSIM_ENDPOINT_URL (the control plane as the node reaches "
        "it). The exit status is the command's. Losing the node (a NodeLoss, a reboot, its "
        "deletion) ends the command and everything it started.",
    )
    run.add_argument("--cluster", required=True, help="the cluster (name or ARN)")
    run.add_argument("node_id", metavar="NODE_ID", help="the node's instance id")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]", help="the command")
    run.set_defaults(action=node_exec, flags={"ClusterName": "--cluster", "NodeId": "NODE_ID"})
    return node
