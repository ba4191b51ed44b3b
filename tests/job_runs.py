"""Jobs through ``hyperpod-sim job run`` (docs/jobs.md), for the tests of jobs and of the console:
the command line, an environment that marks every process of the test's jobs (ended when the
test ends, also on failure) and the ranks' output by rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ControlPlane, ServerProcess
from tests.helpers import ROOT

WORKER = [sys.executable, "-m", "tests.job_worker"]


def job_argv(endpoint: str, tmp_path: Path, *flags: str, command: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hyperpod_sim",
        "job",
        "run",
        "--endpoint-url",
        endpoint,
        "--log-dir",
        str(tmp_path / "logs"),
        *flags,
        "--",
        *command,
    ]


def run_job(
    plane: ControlPlane | ServerProcess, tmp_path: Path, *flags: str, command: list[str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        job_argv(plane.url, tmp_path, *flags, command=command),
        cwd=ROOT,
        env=job_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def rank_lines(stdout: str) -> dict[int, list[str]]:
    """The ranks' output lines by rank (``[rank N] ...``)."""
    found: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        if line.startswith("[rank "):
            rank, _, text = line[len("[rank ") :].partition("] ")
            found.setdefault(int(rank), []).append(text)
    return found


MARK = "HPSIM_TEST_JOBS"  # in the environment of this test's CLI, supervisors and ranks


def job_env(tmp_path: Path) -> dict[str, str]:
    # A supervisor gives up on a control plane gone for 30 s (the test's ends with the test).
    return {**os.environ, MARK: str(tmp_path), "HPSIM_JOB_PATIENCE_S": "30"}


def lose_a_node_mid_run(
    url: str, tmp_path: Path, *, steps: int, pause_at: int, timeout: float
) -> tuple[str, str, Path]:
    """A job ``llm`` on cluster ``resume`` with --auto-resume on 2 nodes, training ``steps`` steps
    (tests/job_worker.py); its first attempt waits after step ``pause_at`` until a NodeLoss of
    rank 1's node ends it. Its output once it has ended with exit 0, the lost node and the
    progress file (``attempt step`` per saved step)."""
    from hyperpod_sim.sdk.client import HyperPodClient
    from tests.conftest import wait_for

    progress = tmp_path / "progress"
    Path(str(progress) + ".hold").touch()
    command = [*WORKER, "train", "--namespace", "job", "--steps", str(steps), "--progress", str(progress)]
    command += ["--pause-at", str(pause_at)]
    flags = ["--cluster", "resume", "--auto-resume", "--nodes", "2", "--name", "llm"]
    submitted = subprocess.Popen(
        job_argv(url, tmp_path, *flags, command=command),
        cwd=ROOT,
        env=job_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: progress.exists() and f"1 {pause_at}" in progress.read_text().split("\n"),
            timeout=180,
            what=f"step {pause_at}",
        )
        with HyperPodClient(url) as client:
            victim = str(client.describe_job("resume", "llm")["Attempts"][0]["Nodes"][1])
            client.inject_fault("resume", Type="NodeLoss", InstanceId=victim)
        stdout, stderr = submitted.communicate(timeout=timeout)
        assert submitted.returncode == 0, stdout + stderr
        return stdout, victim, progress
    finally:
        if submitted.poll() is None:
            submitted.kill()
            submitted.communicate()
