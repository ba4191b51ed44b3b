"""The namespaces node network against the loopback one, and a link rate against its own bound.

Usage (Linux, as root: the namespaces network needs CAP_NET_ADMIN and CAP_SYS_ADMIN)::

    python bench/node_network.py [--nodes 8] [--repeats 3] [--rate-mbit 200] [--mib 16] [--json out.json]

For each network, loopback then namespaces (docs/nodes.md, "Namespaces"), ``hyperpod-sim serve``
runs as a subprocess (SQLite in a temp dir, the local provisioner, the embedded S3 off):

1. **agent start**: CreateCluster of ``--nodes`` nodes with tiered storage until DescribeCluster
   says ``InService`` (every agent started, registered and holding the policy). On the
   namespaces network that includes each node's namespace, veth pair, routes and hosts file.
2. **policy rollout**: UpdateCluster of the memory percentage until ``InService`` again (every
   agent acknowledged the new generation), ``--repeats`` times; the median.

The ratios are namespaces / loopback of the same run.

3. **link rate**: a third serve on the namespaces network with
   ``HPSIM_PROVISIONING__NODE_LINK_RATE_MBIT=--rate-mbit`` and synchronous replication
   (``HPSIM_AGENT_REPLICATION=sync``: a save is answered once its replica is on the peer node), a
   two-node cluster; on the first node (``hyperpod-sim node exec``: the save does not cross the
   link, its replication does) a client saves ``--mib`` MiB shards to its own agent at the gossip
   service name, ``--repeats`` times. The ratio is the median save time over the rate's own bound
   (the shard's bits at the rate): about 1 or more when replication takes network time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.common, as bench/x.py too

from bench.common import MIB, fmt, progress, sagemaker_client, table, with_notes
from bench.runner import EXECUTION_ROLE, INSTANCE_TYPE, ORCHESTRATOR, BenchRun, Cell, Target, finish
from hyperpod_sim.infra import netns

START_TARGET = Target("<=", 2.0)
ROLLOUT_TARGET = Target("<=", 1.5)
LINK_TARGET = Target(">=", 0.9)
BASE_SETTINGS = {
    "HPSIM_PROVISIONING__MODE": "local",
    "HPSIM_PROVISIONING__HEARTBEAT_TIMEOUT_S": "60",
    "HPSIM_PROVISIONING__LAUNCH_TIMEOUT_S": "300",
    "HPSIM_S3__EMBEDDED": "off",
}

# Run inside the first node: saves of MIB MiB to its own agent, each timed; prints the seconds.
SAVER = textwrap.dedent(
    """
    import base64, json, sys, time
    import httpx, xxhash
    agent = "http://ai-toolkit-gossip-headless.aws-hyperpod.svc.cluster.local:9200"
    size, repeats = int(sys.argv[1]), int(sys.argv[2])
    data = bytes(size)
    meta = json.dumps({"checksum": base64.b64encode(xxhash.xxh3_128(data).digest()).decode(),
                       "algorithm": "xxh3_128"})
    with httpx.Client(timeout=600) as client:
        answer = client.post(f"{agent}/v1/cp/namespaces/bench", params={"num_ranks": 2, "steps_retained": 2})
        assert answer.status_code in (200, 201), answer.text
        times = []
        for step in range(1, repeats + 1):
            start = time.perf_counter()
            answer = client.post(f"{agent}/v1/cp/checkpoints/bench/0/{step}", content=data,
                                 headers={"Shard-Meta": meta})
            times.append(time.perf_counter() - start)
            assert answer.status_code in (200, 201), answer.text
    print(json.dumps(times))
    """
)


def create_cluster(sm: Any, name: str, nodes: int) -> float:
    start = time.perf_counter()
    sm.create_cluster(
        ClusterName=name,
        InstanceGroups=[
            {
                "InstanceGroupName": "workers",
                "InstanceType": INSTANCE_TYPE,
                "InstanceCount": nodes,
                "ExecutionRole": EXECUTION_ROLE,
            }
        ],
        Orchestrator=ORCHESTRATOR,
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 20},
    )
    wait_in_service(sm, name)
    return time.perf_counter() - start


def wait_in_service(sm: Any, name: str, deadline_s: float = 600) -> None:
    deadline = time.monotonic() + deadline_s
    while sm.describe_cluster(ClusterName=name)["ClusterStatus"] != "InService":
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not InService within {deadline_s} s")
        time.sleep(0.01)


def rollout(sm: Any, name: str, percentage: int) -> float:
    start = time.perf_counter()
    sm.update_cluster(
        ClusterName=name,
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": percentage},
    )
    while sm.describe_cluster(ClusterName=name)["ClusterStatus"] == "InService":  # until Updating shows
        if time.perf_counter() - start > 5:
            break
        time.sleep(0.002)
    wait_in_service(sm, name)
    return time.perf_counter() - start


def measure_network(run: BenchRun, network: str, args: argparse.Namespace, subnet: str) -> dict[str, Any]:
    settings = {**BASE_SETTINGS, "HPSIM_PROVISIONING__NODE_NETWORK": network}
    if network == "namespaces":
        settings["HPSIM_PROVISIONING__NODE_SUBNET"] = subnet
    server = run.serve(settings, subdir=network, name=f"serve ({network})")
    run.ready(60, server)
    sm = sagemaker_client(server.endpoint, connect_timeout=5, read_timeout=60)
    progress(f"{network}: creating {args.nodes} nodes")
    created = create_cluster(sm, "bench", args.nodes)
    rollouts = [rollout(sm, "bench", 30 + 10 * (i % 5)) for i in range(args.repeats)]
    sm.delete_cluster(ClusterName="bench")
    server.stop(timeout=120)
    return {"create_s": created, "rollout_s": rollouts}


def measure_link(run: BenchRun, args: argparse.Namespace, subnet: str) -> list[float]:
    settings = {
        **BASE_SETTINGS,
        "HPSIM_PROVISIONING__NODE_NETWORK": "namespaces",
        "HPSIM_PROVISIONING__NODE_SUBNET": subnet,
        "HPSIM_PROVISIONING__NODE_LINK_RATE_MBIT": str(args.rate_mbit),
        "HPSIM_AGENT_REPLICATION": "sync",
    }
    server = run.serve(settings, subdir="link", name="serve (link rate)")
    run.ready(60, server)
    sm = sagemaker_client(server.endpoint, connect_timeout=5, read_timeout=60)
    progress(f"link: 2 nodes at {args.rate_mbit:g} Mbit/s, {args.repeats} saves of {args.mib} MiB")
    create_cluster(sm, "link", 2)
    node = sm.list_cluster_nodes(ClusterName="link")["ClusterNodeSummaries"][0]["InstanceId"]
    argv = [sys.executable, "-m", "hyperpod_sim", "node", "exec", "--endpoint-url", server.endpoint]
    argv += [
        "--cluster",
        "link",
        node,
        "--",
        sys.executable,
        "-c",
        SAVER,
        str(args.mib * MIB),
        str(args.repeats),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the saver failed: {done.stderr[-2000:]}")
    sm.delete_cluster(ClusterName="link")
    server.stop(timeout=120)
    times: list[float] = json.loads(done.stdout.strip().splitlines()[-1])
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    missing = netns.missing_privileges() if os.geteuid() == 0 else ["root"]
    if missing:
        print(f"bench/node_network.py needs {', '.join(missing)}", file=sys.stderr)
        return 2
    subnets = [f"198.19.{200 + i}.0/24" for i in range(2)]
    with BenchRun("hpsim-netns-bench-") as run:
        for subnet in subnets:
            run.on_exit(lambda s=subnet: netns.remove_network(netns.NodeNetwork.of(s)))
        results = {net: measure_network(run, net, args, subnets[0]) for net in ("loopback", "namespaces")}
        link_times = measure_link(run, args, subnets[1])
    loop, spaces = results["loopback"], results["namespaces"]
    start_ratio = spaces["create_s"] / loop["create_s"]
    rollout_ratio = statistics.median(spaces["rollout_s"]) / statistics.median(loop["rollout_s"])
    bound_s = args.mib * MIB * 8 / (args.rate_mbit * 1_000_000)
    link_ratio = statistics.median(link_times) / bound_s
    cells = [
        Cell(f"agent start, {args.nodes} nodes, namespaces / loopback", start_ratio, START_TARGET),
        Cell(f"policy rollout, {args.nodes} nodes, namespaces / loopback", rollout_ratio, ROLLOUT_TARGET),
        Cell(
            f"save with sync replication {args.mib} MiB at {args.rate_mbit:g} Mbit/s / the rate's bound",
            link_ratio,
            LINK_TARGET,
        ),
    ]
    lines = table(f"{'network':<11} {'create s':>9} {'rollout s (median)':>19}")
    for name, row in results.items():
        lines.append(
            f"{name:<11} {fmt(row['create_s'], '9.2f')} {fmt(statistics.median(row['rollout_s']), '19.3f')}"
        )
    lines.append("")
    lines.append(
        f"link: saves {', '.join(fmt(t, '.3f') for t in link_times)} s; bound {bound_s:.3f} s "
        f"({args.mib} MiB at {args.rate_mbit:g} Mbit/s)"
    )
    lines += [f"{c.name}: {fmt(c.value, '.2f')}x (target {c.target}) {c.verdict}" for c in cells]
    report = with_notes(lines, ["ratios of one run on this machine: compare ratios, not seconds"])
    payload = {
        "results": results,
        "link_times_s": link_times,
        "bound_s": bound_s,
        "args": vars(args) | {"json": None},
    }
    return finish(report, cells, args.json, payload)


if __name__ == "__main__":
    sys.exit(main())
