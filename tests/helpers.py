"""Helpers the test files share: a training job as rank processes, bearer headers, the AWS CLI,
hyperpod-sim's own CLI.

Not fixtures (those are in conftest.py and tests/plugins/): plain functions a test calls with what it has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
AWS = Path(sys.executable).with_name("aws")


# ---------------------------------------------------------------------- training jobs


@dataclass(frozen=True)
class RankJob:
    """A finished job's rank processes: exit status, log and result file of each."""

    returncodes: list[int]
    logs: list[Path]
    outs: list[Path]

    def failed(self, tail: int = 4000) -> dict[int, str]:
        """The ranks that exited non-zero, with the end of their log."""
        return {
            rank: self.logs[rank].read_text(errors="replace")[-tail:]
            for rank, code in enumerate(self.returncodes)
            if code != 0
        }

    def log_texts(self) -> list[str]:
        return [log.read_text(errors="replace") for log in self.logs]

    def results(self) -> list[dict[str, Any]]:
        """Each rank's result file, after asserting every rank exited 0."""
        failed = self.failed()
        assert not failed, failed
        return [json.loads(out.read_text()) for out in self.outs]


def run_ranks(
    tmp_path: Path,
    worker: str,
    urls: list[str],
    world_size: int,
    namespace: str,
    *args: str,
    label: str | None = None,
    env: dict[str, str] | None = None,
    append_logs: bool = False,
    timeout: float = 180,
) -> RankJob:
    """One job of ``world_size`` processes of the worker module (``tests.dcp_worker``,
    ``tests.sdk_worker``), gloo on a free loopback port, rank r talking to ``urls[r % len(urls)]``,
    each with ``args`` after the common options; waits for all (killing any left after
    ``timeout``). Files: ``<label>-<rank>.json`` (removed first) and ``.log`` in ``tmp_path``,
    ``label`` defaulting to the namespace; ``append_logs`` keeps earlier logs of the same label."""
    label = label or namespace
    port = free_port()
    processes = []
    logs = [tmp_path / f"{label}-{rank}.log" for rank in range(world_size)]
    outs = [tmp_path / f"{label}-{rank}.json" for rank in range(world_size)]
    for rank in range(world_size):
        outs[rank].unlink(missing_ok=True)
        argv = [
            sys.executable, "-m", worker,
            "--rank", str(rank), "--world-size", str(world_size), "--master-port", str(port),
            "--agent-url", urls[rank % len(urls)], "--namespace", namespace,
            "--out", str(outs[rank]), *args,
        ]  # fmt: skip
        log = open(logs[rank], "ab" if append_logs else "wb")  # noqa: SIM115 - closed below
        processes.append(
            (subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env), log)
        )
    try:
        for process, log in processes:
            process.wait(timeout=timeout)
            log.close()
    finally:
        for process, log in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
    return RankJob([process.returncode for process, _ in processes], logs, outs)


# ---------------------------------------------------------------------- agents' bearer tokens


def bearer(token: str | None) -> dict[str, str]:
    """The Authorization header carrying ``token`` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


# ---------------------------------------------------------------------- the AWS CLI


def aws_cli(
    url: str,
    tmp_path: Path,
    *args: str,
    key: str = "testing",
    secret: str = "testing",
    max_attempts: int | None = None,
) -> subprocess.CompletedProcess[str]:
    """``aws sagemaker ARGS --endpoint-url URL --output json`` with this key, nothing from the
    machine's own AWS setup (config and credentials files in ``tmp_path``, no profile or session
    token), no pager; ``max_attempts`` sets ``AWS_MAX_ATTEMPTS``."""
    assert AWS.is_file(), f"{AWS} is missing: install the dev extra (awscli)"
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws-credentials"),
        "AWS_PAGER": "",
    }
    if max_attempts is not None:
        env["AWS_MAX_ATTEMPTS"] = str(max_attempts)
    env.pop("AWS_PROFILE", None)
    env.pop("AWS_SESSION_TOKEN", None)
    return subprocess.run(
        [str(AWS), "sagemaker", *args, "--endpoint-url", url, "--output", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# ---------------------------------------------------------------------- hyperpod-sim's CLI


def hpsim(
    endpoint: str | None, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``hyperpod-sim ARGS --endpoint-url ENDPOINT`` (no flag when ``endpoint`` is None)."""
    flags = ["--endpoint-url", endpoint] if endpoint else []
    return subprocess.run(
        [sys.executable, "-m", "hyperpod_sim", *args, *flags],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout
