"""Issue 23, finding 2 at the agents: a step is one save.

A shard sent with a save id (``Shard-Meta`` ``"save"``) is stored under it; a read that names a
checksum (``?checksum=``, what the SDK's reader sends, from the step's committed metadata) is
served only that copy, from whichever node holds it, never another save's; once a metadata shard
of a save is stored, every agent drops the other saves of the step. The drop route is an agents'
route: the cluster token only, so no trainer (nor a holder of the checkpoint token) can call it.
Raw HTTP against real agent processes.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import httpx
import pytest
import xxhash

from tests.conftest import ControlPlane, wait_for
from tests.tier import cluster, create_namespace, get, replicated, url

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


def checksum(data: bytes) -> str:
    return base64.b64encode(xxhash.xxh3_128(data).digest()).decode()


def put(agent: str, rank: int, step: int, data: bytes, save: str | None) -> httpx.Response:
    meta = {"checksum": checksum(data), "algorithm": "xxh3_128", **({"save": save} if save else {})}
    return httpx.post(
        f"{agent}/v1/cp/checkpoints/job/{rank}/{step}", content=data, headers={"Shard-Meta": json.dumps(meta)}
    )


def held(agent: str) -> str | None:
    """The checksum of the copy of rank 0's step 5 that ``agent``'s node holds, if any."""
    answer = httpx.get(f"{agent}/v1/fast/shards/job/0/5")
    return str(answer.json()["checksum"]) if answer.status_code == 200 else None


def test_a_read_by_checksum_never_gets_another_saves_copy(agent_plane: ControlPlane, sm: Any) -> None:
    agents = [url(n) for n in cluster(sm, agent_plane, "saves", 3)]
    a, b, _ = agents
    assert create_namespace(a, "job", 2).status_code == 201
    first, second = os.urandom(100_000), os.urandom(100_000)
    # Save "one" of step 5 on node a (never committed), then save "two" on node b; each is
    # replicated to its node's ring peer, where it takes the place of what was there.
    assert put(a, 0, 5, first, "one").status_code == 200
    wait_for(lambda: replicated(a), timeout=30, what="save one's replica")
    assert put(b, 0, 5, second, "two").status_code == 200
    wait_for(lambda: replicated(b), timeout=30, what="save two's replica")
    holders = {agent: held(agent) for agent in agents}
    (old,) = [agent for agent, found in holders.items() if found == checksum(first)]
    # Asked for save two's checksum through the node holding save one's copy: another node's
    # copy is served, save two's.
    response = httpx.get(f"{old}/v1/cp/checkpoints/job/0/5", params={"checksum": checksum(second)})
    assert response.status_code == 200, response.text
    assert response.content == second
    assert json.loads(response.headers["Shard-Meta"])["save"] == "two"
    # A checksum no copy has: 404, never a copy of another save.
    wanted = checksum(b"no such shard")
    missing = httpx.get(f"{old}/v1/cp/checkpoints/job/0/5", params={"checksum": wanted})
    assert missing.status_code == 404
    assert missing.json() == {
        "error": "ShardNotFound",
        "message": f"no good copy of rank 0 step 5 of 'job' with checksum {wanted}",
    }
    bad = httpx.get(f"{old}/v1/cp/checkpoints/job/0/5", params={"checksum": "not base64!"})
    assert bad.status_code == 400
    assert bad.json()["error"] == "InvalidParameter"
    # The library's read (no checksum) is served as before: that node's own copy.
    assert get(old, "job", 0, 5).content == first
    # Save two's metadata is stored: save one's shards of the step are gone from every node.
    assert put(b, 1, 5, b'{"metadata": 1}', "two").status_code == 200
    assert {held(agent) for agent in agents} <= {checksum(second), None}
    assert get(old, "job", 0, 5).content == second


def test_a_save_id_is_checked_and_the_drop_route_is_the_agents_only(
    agent_plane: ControlPlane, sm: Any
) -> None:
    (a,) = (url(n) for n in cluster(sm, agent_plane, "drop", 1))
    assert create_namespace(a, "job", 2).status_code == 201
    data = os.urandom(10_000)
    refused = put(a, 0, 5, data, "not/a save id")
    assert refused.status_code == 400
    assert refused.json()["error"] == "InvalidShardMeta"
    assert get(a, "job", 0, 5).status_code == 404  # nothing stored
    assert put(a, 0, 5, data, "one").status_code == 200
    checkpoint_token = httpx.get(f"{agent_plane.url}/clusters/drop/checkpoint-token").json()[
        "CheckpointToken"
    ]
    for headers in (
        {},
        {"Authorization": "Bearer not-the-token"},
        {"Authorization": f"Bearer {checkpoint_token}"},
    ):
        answer = httpx.post(f"{a}/v1/internal/saves/job/5", params={"save": "two"}, headers=headers)
        assert answer.status_code in (401, 403), answer.text
    assert get(a, "job", 0, 5).content == data
    token = agent_plane.services.clusters.agent_bootstrap(name="drop").token
    auth = {"Authorization": f"Bearer {token}"}
    assert httpx.post(f"{a}/v1/internal/saves/job/5", headers=auth).json()["error"] == "MissingParameter"
    assert httpx.post(f"{a}/v1/internal/saves/job/5", params={"save": "one"}, headers=auth).json() == {
        "dropped": []
    }
    dropped = httpx.post(f"{a}/v1/internal/saves/job/5", params={"save": "two"}, headers=auth)
    assert dropped.json() == {"dropped": [{"rank": 0, "step": 5}]}
    assert get(a, "job", 0, 5).status_code == 404
