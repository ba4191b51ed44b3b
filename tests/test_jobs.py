"""``hyperpod-sim job run``: a multi-node job on a cluster's nodes, with torchrun's environment,
that rides out a lost node by itself with ``--auto-resume`` (issue 26)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hyperpod_sim.sdk.client import ClusterError, HyperPodClient
from tests.conftest import ControlPlane, ServerProcess, kill_processes_under, wait_for
from tests.faults import descriptions
from tests.helpers import ROOT
from tests.job_runs import WORKER, job_argv, job_env, lose_a_node_mid_run, rank_lines, run_job
from tests.tier import cluster

pytestmark = pytest.mark.usefixtures("no_job_left")


@pytest.mark.parametrize("per_node", [1, 2])
def test_a_two_node_job_computes_across_its_nodes(
    agent_plane: ControlPlane, tmp_path: Path, per_node: int
) -> None:
    nodes = cluster(agent_plane.client(), agent_plane, "train", 2)
    done = run_job(
        agent_plane,
        tmp_path,
        "--cluster",
        "train",
        "--nodes",
        "2",
        "--procs-per-node",
        str(per_node),
        "--name",
        "sum",
        command=[*WORKER, "allreduce"],
    )
    assert done.returncode == 0, done.stdout + done.stderr
    world = 2 * per_node
    reports = {rank: json.loads(lines[-1]) for rank, lines in rank_lines(done.stdout).items()}
    assert sorted(reports) == list(range(world))
    assert {r["sum"] for r in reports.values()} == {world * (world + 1) / 2}
    by_node = {n["InstanceId"] for n in nodes}
    assert {r["node"] for r in reports.values()} == by_node  # both nodes took part
    for rank, report in reports.items():
        assert report["group_rank"] == rank // per_node
        assert report["local_rank"] == rank % per_node
    with HyperPodClient(agent_plane.url) as client:
        first = client.describe_node("train", reports[0]["node"])
        assert {r["master"] for r in reports.values()} == {first["PrivatePrimaryIp"]}
        job = client.describe_job("train", "sum")
        assert job["Status"] == "Succeeded"
        assert job["ExitCode"] == 0
        assert [a["Status"] for a in job["Attempts"]] == ["Succeeded"]
        assert [j["JobName"] for j in client.list_jobs("train")] == ["sum"]
        assert any(
            t.startswith(f"Job sum ({job['JobId']}) attempt 1 succeeded")
            for t in descriptions(client, "train")
        )


def test_a_failing_rank_ends_a_job_without_auto_resume(agent_plane: ControlPlane, tmp_path: Path) -> None:
    cluster(agent_plane.client(), agent_plane, "fail", 2)
    failing = "import os, sys, time; sys.exit(7) if os.environ['RANK'] == '1' else time.sleep(600)"
    done = run_job(
        agent_plane, tmp_path, "--cluster", "fail", "--name", "once", command=[sys.executable, "-c", failing]
    )
    assert done.returncode == 7, done.stdout + done.stderr
    with HyperPodClient(agent_plane.url) as client:
        job = client.describe_job("fail", "once")
    assert job["Status"] == "Failed"
    assert [(a["Cause"], a["CauseRank"], a["ExitCode"]) for a in job["Attempts"]] == [("RankExit", 1, 7)]


def test_max_restarts_exhausted_ends_with_the_failures_status(
    agent_plane: ControlPlane, tmp_path: Path
) -> None:
    cluster(agent_plane.client(), agent_plane, "retry", 1)
    done = run_job(
        agent_plane,
        tmp_path,
        "--cluster",
        "retry",
        "--auto-resume",
        "--max-restarts",
        "2",
        "--name",
        "flaky",
        command=[sys.executable, "-c", "import sys; sys.exit(3)"],
    )
    assert done.returncode == 3, done.stdout + done.stderr
    with HyperPodClient(agent_plane.url) as client:
        job = client.describe_job("retry", "flaky")
        texts = descriptions(client, "retry")
    assert (job["Status"], job["Restarts"], len(job["Attempts"])) == ("Failed", 2, 3)
    assert any("no restart left (--max-restarts 2)" in t for t in texts), texts


@pytest.mark.parametrize("recovery", ["Automatic", "None"])
def test_a_lost_node_restarts_the_job_which_resumes_from_its_newest_step(
    agent_plane: ControlPlane, tmp_path: Path, recovery: str
) -> None:
    # Automatic: the job waits for the replacement; None: a third node is the healthy spare.
    nodes = cluster(
        agent_plane.client(), agent_plane, "resume", 2 if recovery == "Automatic" else 3, recovery=recovery
    )
    stdout, victim, progress = lose_a_node_mid_run(
        agent_plane.url, tmp_path, steps=6, pause_at=3, timeout=400
    )
    with HyperPodClient(agent_plane.url) as client:
        job = client.describe_job("resume", "llm")
        texts = descriptions(client, "resume")
    told = f"{job}\n{stdout[-4000:]}"
    assert job["Status"] == "Succeeded", told
    assert len(job["Attempts"]) == 2, told
    first, second = job["Attempts"]
    assert (first["Cause"], first["CauseNodeId"]) == ("NodeFailure", victim)
    assert second["Nodes"][0] == first["Nodes"][0]  # the surviving node keeps rank 0
    assert second["Nodes"][1] != victim
    if recovery == "Automatic":  # rank 1 on the victim's replacement, a new node
        assert second["Nodes"][1] not in {n["InstanceId"] for n in nodes}
    else:  # rank 1 on the spare the job did not use
        assert second["Nodes"][1] in {n["InstanceId"] for n in nodes} - set(first["Nodes"])
    assert second["Cause"] == "Succeeded"
    # Steps 1-3 once, then 4-6 by the second attempt, which resumed after step 3.
    assert progress.read_text().split("\n")[:-1] == ["1 1", "1 2", "1 3", "2 4", "2 5", "2 6"]
    assert "attempt 2 resumes after step 3" in "\n".join(rank_lines(stdout)[0])
    # The events in order: submitted, started, ended by the node, restarted, succeeded.
    jobs = [t for t in texts if t.startswith("Job llm")]
    assert [t.split(":")[0].split(") ")[-1] for t in jobs] == [
        "submitted",
        "attempt 1 started on " + ", ".join(first["Nodes"]) + ".",
        "attempt 1 ended",
        "attempt 2 started on " + ", ".join(second["Nodes"]) + ".",
        "attempt 2 succeeded",
    ], jobs
    assert f"node {victim} failed" in jobs[2]


def test_jobs_need_the_local_provisioner(control_plane: ControlPlane) -> None:
    with HyperPodClient(control_plane.url) as client, pytest.raises(ClusterError) as refused:
        client.create_job("any", Command=["true"])
    assert refused.value.code in ("ValidationException", "ResourceNotFound")


def test_a_restart_of_serve_neither_loses_nor_duplicates_ranks(database_url: str, tmp_path: Path) -> None:
    env = {"HPSIM_PROVISIONING__MODE": "local", "HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "0.2"}
    data_dir = tmp_path / "data"
    first = ServerProcess(database_url, data_dir, env).start()
    starts, gate = tmp_path / "starts", tmp_path / "gate"
    gate.touch()
    # Each rank says it started, then waits for the gate to go: the serve restart happens meanwhile.
    waits = (
        "import os, time, pathlib; "
        f"open({str(starts)!r}, 'a').write(os.environ['RANK'] + ' ' + str(os.getpid()) + '\\n'); "
        f"gate = pathlib.Path({str(gate)!r}); deadline = time.monotonic() + 300\n"
        "while gate.exists() and time.monotonic() < deadline: time.sleep(0.1)"
    )
    try:
        cluster(first.client(), first, "keep", 2)
        submitted = subprocess.run(
            job_argv(
                first.url,
                tmp_path,
                "--cluster",
                "keep",
                "--procs-per-node",
                "2",
                "--name",
                "long",
                "--detach",
                command=[sys.executable, "-c", waits],
            ),
            cwd=ROOT,
            env=job_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert submitted.returncode == 0, submitted.stderr
        wait_for(
            lambda: starts.exists() and len(starts.read_text().splitlines()) == 4, timeout=120, what="4 ranks"
        )
        first.kill()  # SIGKILL: the ranks, their supervisor and the agents run on
        second = ServerProcess(database_url, data_dir, env, port=first.port).start()
        try:
            gate.unlink()
            with HyperPodClient(second.url) as client:
                job = wait_for(
                    lambda: (
                        (j := client.describe_job("keep", "long"))["Status"] in ("Succeeded", "Failed") and j
                    ),
                    timeout=180,
                    what="the job to end",
                )
        finally:
            second.stop()
    finally:
        first.kill()
        kill_processes_under(tmp_path)
    assert job["Status"] == "Succeeded", job
    assert len(job["Attempts"]) == 1  # not restarted
    lines = starts.read_text().splitlines()
    assert sorted(int(line.split()[0]) for line in lines) == [0, 1, 2, 3]  # each rank once
