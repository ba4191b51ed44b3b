"""What serve's children inherit (issue 23, finding g): a real ``serve`` with credentials, a
password in a database URL and an unrelated secret in its environment starts its embedded
SeaweedFS and a node's agent; their environments, as the kernel shows them to their owner in
``/proc/<pid>/environ``, hold none of those, and the agent still comes up with what it needs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from hyperpod_sim.infra.processes import pids_mentioning
from tests.conftest import ServerProcess, group, kill_processes_under, wait_for

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

KEY, SECRET = "AKIDCHILDENV", "control-plane-secret-0123456789"
ADMIN, ADMIN_SECRET = "AKIDCHILDADMIN", "admin-secret-0123456789"
DB_PASSWORD = "database-password-0123456789"
UNRELATED = "unrelated-secret-0123456789"


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def weed_pids(data_dir: Path) -> list[int]:
    return pids_mentioning(data_dir.resolve() / "s3", "weed")


def test_agents_and_seaweedfs_get_none_of_serves_secrets(database_url: str, tmp_path: Path) -> None:
    env = {
        "HPSIM_PROVISIONING__MODE": "local",
        "HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "0.2",
        "HPSIM_AUTH__CREDENTIALS": f'{{"{KEY}": "{SECRET}"}}',
        "HPSIM_AUTH__ADMIN_CREDENTIALS": f'{{"{ADMIN}": "{ADMIN_SECRET}"}}',
        # In serve's environment, overridden by its --database-url flag: still nothing a child needs.
        "HPSIM_DATABASE__URL": f"postgresql+psycopg://hpsim:{DB_PASSWORD}@127.0.0.1:1/hpsim",
        "SOME_OTHER_SERVICE_TOKEN": UNRELATED,
    }
    server = ServerProcess(database_url, tmp_path, env).start()
    try:
        sm: Any = boto3.client(
            "sagemaker",
            endpoint_url=server.url,
            region_name="us-east-1",
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            config=Config(retries={"max_attempts": 1}),
        )
        sm.create_cluster(ClusterName="env", InstanceGroups=[group(count=1)])
        wait_for(
            lambda: sm.describe_cluster(ClusterName="env")["ClusterStatus"] == "InService",
            timeout=90,
            what="the cluster's agent to come up",
        )
        (agent_pid,) = pids_mentioning(tmp_path / "agents", "agent")
        (weed_pid,) = weed_pids(tmp_path)
        for what, pid in (("agent", agent_pid), ("weed", weed_pid)):
            environ = environ_of(pid)
            leaked = sorted(
                key
                for key, value in environ.items()
                if key.startswith(("HPSIM_AUTH__", "HPSIM_DATABASE__"))
                or any(secret in value for secret in (SECRET, ADMIN_SECRET, DB_PASSWORD, UNRELATED))
            )
            assert leaked == [], (what, leaked)
            assert "SOME_OTHER_SERVICE_TOKEN" not in environ, what
        agent_env = environ_of(agent_pid)
        # What the agent needs is there: this package, its launch secret, the embedded S3's keys.
        assert agent_env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")
        assert agent_env["HPSIM_AGENT_TOKEN"]
        assert agent_env["AWS_ACCESS_KEY_ID"].startswith("HPSIM")
        # weed takes its settings from its flags alone: no AWS_* (it would make an identity of them).
        assert not [key for key in environ_of(weed_pid) if key.startswith("AWS_")]
    finally:
        server.stop()
        kill_processes_under(tmp_path)
