"""examples/train_tiered.py end to end, as the README shows it: the real control plane
(``hyperpod-sim serve`` with its embedded S3 and local agents), a 2-rank job that checkpoints
every 2 steps to memory and every 4 to S3, dies mid-run, and resumes from its newest complete
checkpoint when started again."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hyperpod_sim.sdk.client import HyperPodClient
from tests.conftest import ServerProcess, kill_processes_under, wait_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def server(sqlite_url: str, tmp_path: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(sqlite_url, tmp_path).start()  # its shared memory goes with tmp_path
    try:
        yield process
    finally:
        process.stop()
        kill_processes_under(tmp_path)


def example(server: ServerProcess, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "examples/train_tiered.py", "--endpoint-url", server.url, "--ranks", "2", *args]
    # The trainers map the agents' shared memory under the server's root, as on its nodes.
    env = {
        **os.environ,
        "HPSIM_SIMULATION__SHM_ROOT": server.env["HPSIM_SIMULATION__SHM_ROOT"],
        "HPSIM_JOB_LOG_DIR": str(tmp_path / "jobs"),  # the job's log, not under HOME
    }
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_the_example_trains_fails_and_resumes(server: ServerProcess, tmp_path: Path) -> None:
    report = tmp_path / "report"
    first = example(server, tmp_path, "--steps", "8", "--s3-every", "4", "--fail-at", "7", "--no-auto-resume")
    assert first.returncode == 3, first.stdout + first.stderr  # every rank died after step 7
    assert "no checkpoint yet: starting from step 0" in first.stdout
    assert "simulated failure at step 7" in first.stdout
    # The save of step 6 may still have been in flight when the ranks died: the newest complete
    # step is 6 or 4, and the listing says which.
    listing = httpx.get(f"{server.url}/clusters/example/checkpoints").json()
    steps = next(n for n in listing["Namespaces"] if n["Namespace"] == "example-example-2")["Steps"]
    newest = max(s["Step"] for s in steps if s["Complete"])
    assert newest in (4, 6)
    second = example(server, tmp_path, "--steps", "10", "--s3-every", "4", "--report", str(report))
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resumed from step {newest}" in second.stdout
    assert f"done: steps {newest + 1}..10" in second.stdout
    for rank in (0, 1):
        summary = json.loads(Path(f"{report}.{rank}").read_text())
        assert summary["start"] == newest
        assert summary["resumed"]["step"] == newest
        assert set(summary["resumed"]["tiers"].values()) <= {"memory", "replica", "peer"}
    # The S3 tier persisted every 4th step: the newest, 8, is on S3 (the node details say so).

    def persisted() -> int | None:
        nodes = httpx.get(f"{server.url}/clusters/example/nodes").json()["ClusterNodeSummaries"]
        steps = [
            step
            for n in nodes
            for step in ((n.get("AgentStatus") or {}).get("S3Tier") or {})
            .get("LastPersistedSteps", {})
            .values()
        ]
        return max(steps) if steps else None

    assert wait_for(lambda: persisted() == 8, timeout=60, what="step 8 on S3")


def test_with_auto_resume_the_job_restarts_itself_and_resumes(server: ServerProcess, tmp_path: Path) -> None:
    """One command: the job's first attempt dies after step 5, `job run --auto-resume` starts it
    again, and every rank resumes from the newest complete checkpoint (step 4, or 2 if the save
    of 4 was still in flight) to the end."""
    done = example(server, tmp_path, "--steps", "8", "--fail-at", "5", "--cluster", "again")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[rank 0] simulated failure at step 5" in done.stdout
    assert "[job] attempt 1 ended: rank 0 exited with status 3; restarting (restart 1 of 3)" in done.stdout
    resumed = re.search(r"\[rank 0\] resumed from step (\d+)", done.stdout)
    assert resumed is not None, done.stdout
    assert int(resumed.group(1)) in (2, 4)
    assert f"[rank 0] done: steps {int(resumed.group(1)) + 1}..8" in done.stdout
    with HyperPodClient(server.url) as client:
        (job,) = client.list_jobs("again")
    assert [(a["Cause"], a["ExitCode"]) for a in job["Attempts"]] == [("RankExit", 3), ("Succeeded", 0)]
