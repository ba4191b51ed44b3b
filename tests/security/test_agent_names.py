"""Issue 23, finding d: a namespace name with a NUL was saved (201), and its steps' S3 persist then
failed forever as "temporary" (S3 keys cannot carry a control character), ``PendingSteps`` stuck.
A new namespace's name is now refused when it holds one; names the amzn-sagemaker-checkpointing
library uses go on working, and persist."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from sqlalchemy import select

from hyperpod_sim.models import CheckpointNamespace, Cluster
from tests.conftest import ControlPlane, wait_for
from tests.s3_checkpoints import CREDENTIALS, markers, set_policy
from tests.tier import cluster, create_namespace, put, url

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]


OLD = quote("old\x00name", safe="")  # a namespace an older control plane saved, in a URL


@pytest.fixture
def agent_settings(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)  # what the agents (children of this process) sign with
    return {"s3": {"endpoint_url": moto_url, "embedded": False}}


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


def test_a_control_character_in_a_namespace_name_is_refused_at_creation(
    agent_plane: ControlPlane,
    sm: Any,
    s3: Any,
    bucket: str,
) -> None:
    (node,) = cluster(sm, agent_plane, "names", 1)
    a = url(node)
    set_policy(agent_plane, sm, "names", S3BaseUri=f"s3://{bucket}/n", PersistEverySteps=1)
    bad = (("bad\x00name", "U+0000"), ("tab\tname", "U+0009"), ("del\x7f", "U+007F"), ("c1\x85", "U+0085"))
    for name, code in bad:
        path = f"{a}/v1/cp/namespaces/{quote(name, safe='')}"
        refused = httpx.post(path, params={"num_ranks": 1})
        assert refused.status_code == 400, (name, refused.text)
        assert refused.json()["error"] == "InvalidNamespace"
        assert f"control character {code}" in refused.json()["message"]
        # Nothing was saved, so no save can make a step that S3 would never take.
        assert httpx.get(path).status_code == 404
        shard = put(a, quote(name, safe=""), 0, 1, b"x")
        assert shard.status_code == 404, shard.text

    # What the library sends (a training job's name, or job-<time>) and other printable names
    # are created, and their steps persist: nothing is left pending.
    for name in ("job-1764662400", "llama-70b_run.2", "ünïcode name"):
        assert create_namespace(a, quote(name, safe=""), 1).status_code == 201, name
        assert put(a, quote(name, safe=""), 0, 1, name.encode() * 1000).status_code == 200
    wait_for(lambda: markers(s3, bucket, "n/job-1764662400/") == [1], timeout=60, what="step 1 on S3")

    def s3_tier() -> dict[str, Any] | None:
        details = httpx.get(f"{agent_plane.url}/clusters/names/nodes/{node['InstanceId']}").json()
        tier: dict[str, Any] | None = details["NodeDetails"]["AgentStatus"].get("S3Tier")
        return tier if tier and len(tier.get("LastPersistedSteps", {})) == 3 else None

    tier = wait_for(s3_tier, timeout=60, what="every namespace's step persisted")
    assert tier["PendingSteps"] == 0
    assert tier.get("LastError") is None


def test_a_namespace_named_before_the_check_gives_its_persists_up(
    agent_plane: ControlPlane,
    sm: Any,
    bucket: str,
) -> None:
    """A namespace with a NUL that an older control plane saved: its saves still work in memory,
    its persists fail as permanent (no S3 key can carry the name), and no step stays pending."""
    (node,) = cluster(sm, agent_plane, "older", 1)
    a = url(node)
    set_policy(agent_plane, sm, "older", S3BaseUri=f"s3://{bucket}/o", PersistEverySteps=1)
    with agent_plane.services.db.write() as session:
        cluster_id = session.scalars(select(Cluster.id).where(Cluster.name == "older")).one()
        session.add(
            CheckpointNamespace(
                cluster_id=cluster_id,
                name="old\x00name",
                num_ranks=1,
                steps_retained=3,
                created_at=datetime.now(UTC),
            )
        )
    data = b"saved before the rule" * 1000
    assert put(a, OLD, 0, 1, data).status_code == 200

    def given_up() -> dict[str, Any] | None:
        details = httpx.get(f"{agent_plane.url}/clusters/older/nodes/{node['InstanceId']}").json()
        tier: dict[str, Any] | None = details["NodeDetails"]["AgentStatus"].get("S3Tier")
        return tier if tier and tier.get("FailuresTotal") and tier.get("PendingSteps") == 0 else None

    tier = wait_for(given_up, timeout=60, what="the persist given up, nothing pending")
    assert "control character U+0000" in tier["LastError"]
    assert httpx.get(f"{a}/v1/cp/checkpoints/{OLD}/0/1").content == data
