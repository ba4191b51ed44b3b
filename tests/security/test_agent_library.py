"""The real amzn-sagemaker-checkpointing library (1.1.3) in each AgentAccess mode.

Open (the default): it saves and loads through the agents unmodified. Token: the library sends
no credentials, so its saves are refused (401 MissingToken; without an S3 tier of its own the
save fails with SageMakerInMemoryTierError "In-memory write failed") while its reads stay open:
it still restores the steps saved before, byte for byte. Back to Open, it saves again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ControlPlane
from tests.helpers import run_ranks
from tests.jobs import agents, run_job
from tests.security.access import set_access

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


def failing_save(tmp_path: Path, urls: list[str], world_size: int, namespace: str, step: int) -> list[str]:
    """A save of ``step`` that is expected to fail on every rank; each rank's log."""
    job = run_ranks(
        tmp_path, "tests.dcp_worker", urls, world_size, namespace, "--steps", str(step), label="refused"
    )
    assert all(code != 0 for code in job.returncodes)
    return job.log_texts()


def test_library_saves_in_open_mode_and_only_restores_in_token_mode(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path
) -> None:
    urls = agents(sm, agent_plane, "lib", 2)
    # Open, the default: the library saves and loads unmodified.
    results = run_job(tmp_path, urls, 2, "job", "1,2")
    assert all(r["equal"] and r["loaded_step"] == 2 for r in results), results

    set_access(agent_plane, sm, "lib", urls, "Token")
    logs = failing_save(tmp_path, urls, 2, "job", 3)
    assert any("SageMakerInMemoryTierError" in log for log in logs), logs[0][-3000:]
    assert any('"error": "MissingToken"' in log for log in logs), logs[0][-3000:]  # what the agent said
    # Nothing of step 3 was stored; the library still restores the newest step saved before.
    assert httpx.get(f"{urls[0]}/v1/cp/checkpoints/job/latest").json() == [2, 1]
    again = run_job(tmp_path, urls, 2, "job", "", extra=("--expect-step", "2"))
    assert all(r["equal"] and r["loaded_step"] == 2 for r in again), again

    set_access(agent_plane, sm, "lib", urls, "Open")
    results = run_job(tmp_path, urls, 2, "job", "4")
    assert all(r["equal"] and r["loaded_step"] == 4 for r in results), results
