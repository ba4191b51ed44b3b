"""``hyperpod-sim cluster ...`` and ``hyperpod-sim checkpoints``: the real entry point as a
subprocess against a real control plane (simulated nodes on the real clock, so that ``--wait``
sees them come up; real agents for the checkpoint listing)."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hyperpod_sim.api.app import create_app
from hyperpod_sim.cli.common import Progress, table
from hyperpod_sim.sdk.client import HyperPodClient
from tests.conftest import ControlPlane, ServerThread, free_port, make_settings, wait_for
from tests.helpers import hpsim, ok
from tests.s3_checkpoints import save_step
from tests.tier import cluster, create_namespace, put, replicated, url

ROOT = Path(__file__).resolve().parent.parent
ROLE = "arn:aws:iam::123456789012:role/HyperPodExecution"

SPEC = """\
ClusterName: from-yaml
InstanceGroups:
  - InstanceGroupName: workers
    InstanceType: ml.g5.2xlarge
    InstanceCount: 2
    ExecutionRole: arn:aws:iam::123456789012:role/Custom
    LifeCycleConfig: {SourceS3Uri: "s3://bucket/lifecycle/", OnCreate: on_create.sh}
Orchestrator:
  Eks: {ClusterArn: "arn:aws:eks:us-east-1:123456789012:cluster/mine"}
TieredStorageConfig: {Mode: Enable, InstanceMemoryAllocationPercentage: 40}
"""


@pytest.fixture
def plane(database_url: str, tmp_path: Path) -> Iterator[str]:
    """A control plane with simulated nodes on the real clock: Running half a second after launch."""
    port = free_port()
    settings = make_settings(
        database_url,
        tmp_path / "data",
        port=port,
        provisioning={"mode": "simulated", "node_ready_delay_s": 0.5},
        reconciler={"interval_s": 0.2},
        s3={"embedded": False},
    )
    with ServerThread(create_app(settings), port):
        yield f"http://127.0.0.1:{port}"


def failed(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed command prints."""
    assert result.returncode == 1, result.stdout
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def labelled(text: str) -> dict[str, str]:
    """``Label:  value`` lines -> {label: value}."""
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines() if line)}


def rows(text: str) -> list[list[str]]:
    """A table's lines split at runs of two or more spaces (cells themselves have single spaces)."""
    return [re.split(r"\s{2,}", line.strip()) for line in text.strip().splitlines()]


def test_create_from_yaml_then_describe_list_nodes_events(plane: str, tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    result = hpsim(plane, "cluster", "create", "--file", str(spec), "--wait")
    out = ok(result).splitlines()
    assert re.fullmatch(r"arn:aws:sagemaker:us-east-1:123456789012:cluster/[a-z0-9]{12}", out[0])
    assert out[1:] == ["from-yaml is InService (2/2 nodes Running)"]
    # Not a terminal: progress as plain lines, one per change, ending InService.
    progress = result.stderr.splitlines()
    assert progress[-1] == "from-yaml: InService, nodes 2/2 Running"
    assert all(re.fullmatch(r"from-yaml: \w+, nodes \d/2 Running", line) for line in progress)
    assert len(progress) == len(set(progress))

    described = ok(hpsim(plane, "cluster", "describe", "from-yaml"))
    head, groups = described.split("\n\n")
    fields = labelled(head)
    assert fields["Cluster"] == "from-yaml"
    assert fields["ARN"] == out[0]
    assert fields["Status"] == "InService"
    assert fields["Nodes"] == "2/2 Running"
    assert fields["Orchestrator"] == "EKS arn:aws:eks:us-east-1:123456789012:cluster/mine"
    assert fields["Tiered storage"] == "Enable (40% of instance memory)"
    assert fields["Node recovery"] == "Automatic"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", fields["Created"])
    assert rows(groups) == [
        ["GROUP", "TYPE", "RUNNING", "TARGET", "STATUS"],
        ["workers", "ml.g5.2xlarge", "2", "2", "InService"],
    ]
    raw = json.loads(ok(hpsim(plane, "cluster", "describe", "from-yaml", "--json")))
    assert raw["ClusterArn"] == out[0]
    assert raw["InstanceGroups"][0]["LifeCycleConfig"] == {
        "SourceS3Uri": "s3://bucket/lifecycle/",
        "OnCreate": "on_create.sh",
    }
    assert raw["InstanceGroups"][0]["ExecutionRole"] == "arn:aws:iam::123456789012:role/Custom"

    # The endpoint from the environment.
    listed = rows(ok(hpsim(None, "cluster", "list", env={"HPSIM_ENDPOINT_URL": plane})))
    assert listed[0] == ["NAME", "STATUS", "CREATED", "ARN"]
    assert [(r[0], r[1], r[3]) for r in listed[1:]] == [("from-yaml", "InService", out[0])]

    nodes = rows(ok(hpsim(plane, "cluster", "nodes", "from-yaml")))
    assert nodes[0] == ["NODE", "GROUP", "TYPE", "STATUS", "AGENT", "POLICY (APPLIED/DESIRED)", "S3 LAG"]
    assert sorted(r[0] for r in nodes[1:]) == sorted(n["InstanceId"] for n in raw_nodes(plane, "from-yaml"))
    # Simulated nodes have no agent.
    assert [r[1:] for r in nodes[1:]] == [["workers", "ml.g5.2xlarge", "Running", "-", "-", "-"]] * 2

    events = rows(ok(hpsim(plane, "cluster", "events", "from-yaml")))
    assert events[0] == ["TIME", "LEVEL", "RESOURCE", "DESCRIPTION"]
    assert ["Info", "Cluster", "Cluster creation started with 2 nodes in 1 instance groups."] in [
        r[1:] for r in events
    ]


def raw_nodes(endpoint: str, name: str) -> list[dict[str, Any]]:
    with HyperPodClient(endpoint) as client:
        return client.list_nodes(name)


def test_create_from_flags_update_policy_delete(plane: str) -> None:
    created = hpsim(
        plane, "cluster", "create", "--name", "flags",
        "--instance-group", "workers:ml.g5.2xlarge:2", "--instance-group", "ctl:ml.m5.xlarge:1",
        "--tiered-storage", "30", "--node-recovery", "None", "--wait",
    )  # fmt: skip
    assert ok(created).splitlines()[-1] == "flags is InService (3/3 nodes Running)"
    raw = json.loads(ok(hpsim(plane, "cluster", "describe", "flags", "--json")))
    assert raw["TieredStorageConfig"] == {"Mode": "Enable", "InstanceMemoryAllocationPercentage": 30}
    assert raw["NodeRecovery"] == "None"
    assert raw["Orchestrator"] == {
        "Eks": {"ClusterArn": "arn:aws:eks:us-east-1:123456789012:cluster/hyperpod-sim"}
    }
    groups = [(g["InstanceGroupName"], g["InstanceType"], g["TargetCount"]) for g in raw["InstanceGroups"]]
    assert groups == [("workers", "ml.g5.2xlarge", 2), ("ctl", "ml.m5.xlarge", 1)]
    assert {g["ExecutionRole"] for g in raw["InstanceGroups"]} == {ROLE}

    # NAME:COUNT rescales an existing group and keeps its type; the other group is left alone.
    updated = hpsim(plane, "cluster", "update", "flags", "--instance-group", "workers:3", "--wait")
    assert ok(updated).splitlines() == [raw["ClusterArn"], "flags is InService (4/4 nodes Running)"]
    raw = json.loads(ok(hpsim(plane, "cluster", "describe", "flags", "--json")))
    assert [
        (g["InstanceGroupName"], g["InstanceType"], g["CurrentCount"]) for g in raw["InstanceGroups"]
    ] == [
        ("workers", "ml.g5.2xlarge", 3),
        ("ctl", "ml.m5.xlarge", 1),
    ]
    # A new group needs a type.
    assert failed(hpsim(plane, "cluster", "update", "flags", "--instance-group", "more:2")) == (
        "error: InvalidArguments: cluster flags has no instance group 'more'; a new group needs a type: "
        "--instance-group more:TYPE:2"
    )

    policy = labelled(ok(hpsim(plane, "cluster", "policy", "flags")))
    assert policy == {
        "Cluster": "flags",
        "PolicyGeneration": policy["PolicyGeneration"],
        "S3BaseUri": "-",
        "PersistEverySteps": "-",
        "PersistEverySeconds": "-",
        "S3Retention": "-",
        "InMemoryRetention": "3",
        "ReplicationFactor": "1",
        "AgentAccess": "Open",
        "S3Layout": "-",
    }
    generation = int(policy["PolicyGeneration"])
    changed = hpsim(
        plane, "cluster", "policy", "flags",
        "--set", "S3BaseUri=s3://ckpt/flags", "--set", "PersistEverySteps=10", "--wait",
    )  # fmt: skip
    policy = labelled(ok(changed))
    assert (policy["S3BaseUri"], policy["PersistEverySteps"]) == ("s3://ckpt/flags", "10")
    assert int(policy["PolicyGeneration"]) == generation + 1
    # --set changes the members named and keeps the others (the PUT underneath replaces them all).
    changed = hpsim(plane, "cluster", "policy", "flags", "--set", "S3Retention=2", "--json", "--wait")
    document = json.loads(ok(changed))
    assert (document["S3BaseUri"], document["PersistEverySteps"], document["S3Retention"]) == (
        "s3://ckpt/flags",
        10,
        2,
    )
    # Refused by the service: one line, exit status 1, nothing changed.
    assert failed(hpsim(plane, "cluster", "policy", "flags", "--set", "PersistEverySteps=0")) == (
        "error: ValidationException: 1 validation error detected: Value '0' at 'persistEverySteps' failed "
        "to satisfy constraint: Member must have value greater than or equal to 1"
    )
    assert json.loads(ok(hpsim(plane, "cluster", "policy", "flags", "--json")))["PersistEverySteps"] == 10
    # AgentAccess too is kept by a --set of another member: changing one never reopens the agents.
    ok(hpsim(plane, "cluster", "policy", "flags", "--set", "AgentAccess=Token", "--wait"))
    changed = hpsim(plane, "cluster", "policy", "flags", "--set", "S3Retention=3", "--json", "--wait")
    document = json.loads(ok(changed))
    assert (document["AgentAccess"], document["S3Retention"]) == ("Token", 3)

    deleted = hpsim(plane, "cluster", "delete", "flags", "--wait")
    assert ok(deleted).splitlines() == [raw["ClusterArn"], "flags is deleted"]
    assert failed(hpsim(plane, "cluster", "describe", "flags")) == (
        "error: ResourceNotFound: Cluster 'flags' does not exist."
    )
    assert ok(hpsim(plane, "cluster", "list")) == "No clusters.\n"


def test_errors_are_one_line(plane: str, tmp_path: Path) -> None:
    assert failed(hpsim(plane, "cluster", "create", "--file", str(tmp_path / "missing.yaml"))) == (
        f"error: InvalidFile: cannot read {tmp_path / 'missing.yaml'}: No such file or directory"
    )
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    assert failed(hpsim(plane, "cluster", "create", "-f", str(tmp_path / "list.yaml"))) == (
        f"error: InvalidFile: {tmp_path / 'list.yaml'} must hold an object of request members, not list"
    )
    # The service's own checks.
    assert failed(hpsim(plane, "cluster", "create", "--name", "x", "--instance-group", "a:ml.g5.2xlarge:1",
                        "--tiered-storage", "10")) == (
        "error: ValidationException: InstanceMemoryAllocationPercentage 10 is out of range: with Mode "
        "'Enable' it must be between 20 and 100."
    )  # fmt: skip
    assert failed(hpsim(plane, "cluster", "delete", "nope")) == (
        "error: ResourceNotFound: Cluster 'nope' does not exist."
    )
    line = failed(hpsim(f"http://127.0.0.1:{free_port()}", "cluster", "nodes", "any"))
    assert line.startswith(
        "error: EndpointConnectionError: Could not connect to the endpoint URL: http://127.0.0.1:"
    )
    # A malformed flag is a usage error (argparse's exit status 2), before anything is sent.
    usage = hpsim(plane, "cluster", "create", "--name", "x", "--instance-group", "workers")
    assert usage.returncode == 2
    assert "'workers' is not NAME:TYPE:COUNT" in usage.stderr


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_checkpoints_and_nodes_of_a_cluster_with_agents(agent_plane: ControlPlane) -> None:
    sm = agent_plane.client()
    nodes = cluster(sm, agent_plane, "ckpt", 2, instance_type="ml.g5.2xlarge")
    a, b = (url(n) for n in nodes)
    assert ok(hpsim(agent_plane.url, "checkpoints", "ckpt")) == "Cluster ckpt has no checkpoint namespaces.\n"
    assert create_namespace(a, "job", 3).status_code == 201
    save_step([a, b], "job", 1, 2)
    assert put(b, "job", 1, 2, os.urandom(1000)).status_code == 200  # step 2: only rank 1
    wait_for(lambda: replicated(a) and replicated(b), timeout=30, what="the replicas")

    assert ok(hpsim(agent_plane.url, "checkpoints", "ckpt")).splitlines() == [
        "Namespace job: 3 ranks, 3 steps kept in memory",
        "STEP  IN MEMORY  REPLICAS  ON S3  COMPLETE  NOT IN MEMORY",
        "2     1/3        1/3       no     no        0,2",
        "1     3/3        3/3       no     yes       -",
    ]
    with HyperPodClient(agent_plane.url) as client:
        assert json.loads(ok(hpsim(agent_plane.url, "checkpoints", "ckpt", "--json"))) == client.checkpoints(
            "ckpt"
        )

    listed = rows(ok(hpsim(agent_plane.url, "cluster", "nodes", "ckpt")))
    assert sorted(r[0] for r in listed[1:]) == sorted(n["InstanceId"] for n in nodes)
    endpoints = {n["InstanceId"]: url(n) for n in nodes}
    for row in listed[1:]:
        assert row[1:] == ["workers", "ml.g5.2xlarge", "Running", endpoints[row[0]], "1/1", "-"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_rewrites_one_line_on_a_terminal_and_prints_changes_otherwise() -> None:
    terminal = Terminal()
    progress = Progress(terminal)
    for line in [
        "c: Creating, nodes 0/2 Running",
        "c: Creating, nodes 0/2 Running",
        "c: InService, nodes 2/2 Running",
    ]:
        progress.show(line)
    progress.done()
    shown = terminal.getvalue()
    assert shown.endswith("\n")
    assert shown.count("\n") == 1
    assert [re.sub(r" \(\d+ s\)$", "", part) for part in shown.rstrip("\n").split("\r\x1b[2K")[1:]] == [
        "c: Creating, nodes 0/2 Running",
        "c: Creating, nodes 0/2 Running",
        "c: InService, nodes 2/2 Running",
    ]

    plain = io.StringIO()
    progress = Progress(plain)
    for line in [
        "c: Creating, nodes 0/2 Running",
        "c: Creating, nodes 0/2 Running",
        "c: InService, nodes 2/2 Running",
    ]:
        progress.show(line)
    progress.done()
    assert plain.getvalue() == "c: Creating, nodes 0/2 Running\nc: InService, nodes 2/2 Running\n"


def test_table_aligns_columns() -> None:
    assert table(["A", "LONGER"], [["wide cell", None], ["x", 3]]) == (
        "A          LONGER\nwide cell  -\nx          3"
    )


def test_the_command_stays_light() -> None:
    """Building the parser (what ``hyperpod-sim agent`` does first) imports neither the SDK nor
    the server: the cluster commands import theirs when they run."""
    script = (
        "import sys; from hyperpod_sim.cli.main import build_parser; build_parser(); "
        "ours = {'hyperpod_sim.' + p for p in ('sdk', 'api', 'domain', 'models', 'agents', 'infra')}; "
        "heavy = {m.split('.')[0] for m in sys.modules} & {'boto3', 'botocore', 'httpx', 'yaml', "
        "'fastapi', 'sqlalchemy', 'uvicorn', 'pydantic'} "
        "| {'.'.join(m.split('.')[:2]) for m in sys.modules} & ours; "
        "assert not heavy, sorted(heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_help_and_version_speak_to_the_user() -> None:
    shown = ok(hpsim(None, "--help"))
    assert "lazily" not in shown
    assert "thin shell" not in shown
    assert "serve" in shown
    assert "cluster" in shown
    assert ok(hpsim(None, "--version")) == "hyperpod-sim 0.1.0\n"


def test_required_arguments_and_flag_names(plane: str) -> None:
    # Without --file, argparse itself asks for the name and a group (usage, exit status 2).
    usage = hpsim(plane, "cluster", "create", "--instance-group", "workers:ml.g5.2xlarge:1")
    assert usage.returncode == 2
    assert usage.stderr.splitlines()[-1] == (
        "hyperpod-sim cluster create: error: the following arguments are required without --file: --name"
    )
    assert hpsim(plane, "cluster", "create").stderr.endswith("--file: --name, --instance-group\n")
    # The service's message names the flag that was missing, not the wire member.
    ok(hpsim(plane, "cluster", "create", "--name", "flags", "--instance-group", "w:ml.g5.2xlarge:1"))
    assert failed(hpsim(plane, "fault", "inject", "flags", "--type", "S3Latency")) == (
        "error: ValidationException: 1 validation error detected: Value null at --latency-ms failed to "
        "satisfy constraint: Member must not be null"
    )
    line = failed(hpsim(plane, "fault", "inject", "flags", "--type", "AgentHang", "--instance-id", "i-0"))
    assert "Value null at --duration failed" in line


def test_fault_database_shows_times_like_every_command(plane: str) -> None:
    started = ok(hpsim(plane, "fault", "database", "--duration", "1")).strip()
    assert re.fullmatch(
        r"f-[0-9a-f]{16} \(DatabaseOutage\) until \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", started
    )


def test_a_closed_pipe_ends_quietly(plane: str) -> None:
    """``hyperpod-sim cluster list | head``: the reader went away; no traceback, status 141."""
    child = subprocess.Popen(
        [sys.executable, "-m", "hyperpod_sim", "cluster", "list", "--endpoint-url", plane],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    child.stdout.close()  # before the command writes: its write fails with EPIPE
    _, err = child.communicate(timeout=120)
    assert child.returncode == 141
    assert err == ""


def test_serve_says_in_one_line_when_its_port_is_busy_or_invalid(tmp_path: Path) -> None:
    env = {"HPSIM_S3__EMBEDDED": "off", "HPSIM_PROVISIONING__MODE": "simulated"}
    invalid = hpsim(None, "serve", "--port", "99999", "--data-dir", str(tmp_path / "a"), env=env)
    assert invalid.returncode == 2
    assert invalid.stderr.splitlines()[-1] == (
        "hyperpod-sim serve: error: argument --port: 99999 is not a port: use 1..65535 (or 0: any free one)"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = hpsim(None, "serve", "--port", str(port), "--data-dir", str(tmp_path / "b"), env=env)
    # No banner: it comes only once the port is bound.
    assert busy.returncode == 1
    assert busy.stdout == ""
    assert busy.stderr == (
        f"hyperpod-sim serve: 127.0.0.1:{port} is in use (another serve?); choose another with --port "
        "or HPSIM_PORT\n"
    )
