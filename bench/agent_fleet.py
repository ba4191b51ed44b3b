"""Memory of a cluster's idle agents: forked by the agent launcher vs exec'ed one interpreter each.

    .venv/bin/python bench/agent_fleet.py [--nodes 64] [--modes forked,exec] [--s3 off|seaweedfs]

For each mode: ``hyperpod-sim serve`` with the local provisioner on a fresh data dir, one cluster
of ``--nodes`` nodes (tiered storage on), InService, then ``--settle`` seconds of heartbeats; then
the PSS, private memory and RSS of every agent (``/proc/<pid>/smaps_rollup``), of the launcher, of
serve and of the embedded S3, summed. ``exec`` runs the same agent command through ``/usr/bin/env``,
which the provisioner does not fork (only its default command is). Prints a table and, with
``--json``, writes it. The issue's target: 1,024 idle agents with serve and its S3 in 8 GiB of PSS,
about 7 MiB an agent.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    MIB,
    exit_on_sigterm,
    poll,
    progress,
    sagemaker_client,
    start_hpsim,
    stop_servers,
    wait_ready,
    write_json,
)
from hyperpod_sim.infra.processes import pids_mentioning

EKS = {"Eks": {"ClusterArn": "arn:aws:eks:us-east-1:123456789012:cluster/bench"}}
ROLE = "arn:aws:iam::123456789012:role/HyperPodExecution"


def rollup(pid: int) -> dict[str, int]:
    """Pss, Rss and private bytes of a process from smaps_rollup; {} when it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    values = {}
    for line in text.splitlines()[1:]:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[-1] == "kB":
            values[name] = int(parts[0]) * 1024
    return {
        "pss": values.get("Pss", 0),
        "rss": values.get("Rss", 0),
        "private": values.get("Private_Clean", 0) + values.get("Private_Dirty", 0),
    }


def total(pids: list[int]) -> dict[str, int]:
    sums = {"count": 0, "pss": 0, "rss": 0, "private": 0}
    for pid in pids:
        one = rollup(pid)
        if one:
            sums["count"] += 1
            for key in ("pss", "rss", "private"):
                sums[key] += one[key]
    return sums


def measure(mode: str, nodes: int, s3: str, settle_s: float, workdir: Path) -> dict[str, Any]:
    settings = {
        "HPSIM_PROVISIONING__MODE": "local",
        "HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "1.0",
        "HPSIM_PROVISIONING__LAUNCH_TIMEOUT_S": "600",
        "HPSIM_PROVISIONING__HEARTBEAT_TIMEOUT_S": "120",
        "HPSIM_SIMULATION__SHM_ROOT": f"/dev/shm/hpsim-bench-{workdir.name}",
    }
    if s3 == "off":
        settings["HPSIM_S3__EMBEDDED"] = "off"
    if mode == "exec":
        command = ["/usr/bin/env", sys.executable, "-m", "hyperpod_sim", "agent"]
        settings["HPSIM_PROVISIONING__AGENT_COMMAND"] = json.dumps(command)
    server = start_hpsim(workdir, settings)
    try:
        wait_ready(server, 120)
        sm = sagemaker_client(server.endpoint, read_timeout=60)
        started = time.monotonic()
        sm.create_cluster(
            ClusterName="fleet",
            InstanceGroups=[
                {
                    "InstanceGroupName": "workers",
                    "InstanceType": "ml.c5.large",
                    "InstanceCount": nodes,
                    "ExecutionRole": ROLE,
                    "LifeCycleConfig": {"SourceS3Uri": "s3://bench/lifecycle/", "OnCreate": "on_create.sh"},
                }
            ],
            Orchestrator=EKS,
            TieredStorageConfig={"Mode": "Enable"},
        )
        poll(
            lambda: sm.describe_cluster(ClusterName="fleet")["ClusterStatus"] == "InService" or None,
            900,
            1.0,
            lambda: TimeoutError(f"the {nodes}-node cluster is not InService; log: {server.log_tail()}"),
        )
        up_s = time.monotonic() - started
        progress(f"{mode}: {nodes} nodes InService in {up_s:.0f} s; {settle_s:.0f} s of heartbeats")
        time.sleep(settle_s)
        data = workdir / "hpsim-data"
        agents = pids_mentioning(data / "agents", "agent")
        launcher = pids_mentioning(data / "launcher", "agent-launcher")
        weed = pids_mentioning(data / "s3", "weed")
        result = {
            "mode": mode,
            "nodes": nodes,
            "up_s": round(up_s, 1),
            "agents": total(agents),
            "launcher": total(launcher),
            "serve": total([server.proc.pid]),
            "s3": total(weed),
        }
        sm.delete_cluster(ClusterName="fleet")
        return result
    finally:
        stop_servers([server])
        shutil.rmtree(settings["HPSIM_SIMULATION__SHM_ROOT"], ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--modes", default="forked,exec")
    parser.add_argument("--s3", choices=["off", "seaweedfs"], default="seaweedfs")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds of heartbeats before measuring")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    exit_on_sigterm()
    results = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"hpsim-fleet-{mode}-") as tmp:
            results.append(measure(mode, args.nodes, args.s3, args.settle, Path(tmp)))
    print(
        "| mode | agents | PSS/agent MiB | private/agent MiB | RSS/agent MiB | launcher PSS | serve PSS "
        "| S3 PSS | total PSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        a = r["agents"]
        n = max(a["count"], 1)
        everything = a["pss"] + r["launcher"]["pss"] + r["serve"]["pss"] + r["s3"]["pss"]
        print(
            f"| {r['mode']} | {a['count']} | {a['pss'] / n / MIB:.1f} | {a['private'] / n / MIB:.1f} | "
            f"{a['rss'] / n / MIB:.1f} | {r['launcher']['pss'] / MIB:.1f} | {r['serve']['pss'] / MIB:.1f} | "
            f"{r['s3']['pss'] / MIB:.1f} | {everything / MIB:.0f} |"
        )
    if args.json is not None:
        write_json(args.json, {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
