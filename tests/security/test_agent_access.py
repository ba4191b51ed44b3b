"""Finding 2 of issue 12: checkpoints destroyed without credentials.

A cluster's checkpoint policy chooses who may write to its agents' checkpoint routes
(``AgentAccess``). Open (the default) serves anyone who reaches an agent, as HyperPod's daemon
trusts its pod network; Token makes saves, deletes, namespace changes, ``cluster/reset`` and every
``/v1/fast`` route need the cluster's checkpoint token. The attacks are raw HTTP against real
agent processes; after them the checkpoint saved before is still there, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import httpx
import pytest

from hyperpod_sim.sdk.agent import AgentClient, AgentError
from tests.conftest import ControlPlane
from tests.security.access import set_access
from tests.tier import cluster, create_namespace, get, latest, meta, put, url

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


# What an attacker on the network tries: every destructive or writing call of the protocol.
ATTACKS: list[tuple[str, str, dict[str, Any]]] = [
    ("DELETE", "/v1/cp/checkpoints/job/0/1", {}),
    ("DELETE", "/v1/cp/namespaces/job", {}),
    ("POST", "/v1/cp/cluster/reset", {}),
    ("POST", "/v1/cp/checkpoints/job/0/1", {"content": b"evil", "headers": {"Shard-Meta": meta(b"evil")}}),
    ("POST", "/v1/cp/namespaces/planted", {"params": {"num_ranks": 1}}),
    ("POST", "/v1/fast/reserve/job/0/5", {"params": {"size": 4}}),
    ("POST", "/v1/fast/commit/0123456789abcdef", {}),
    ("POST", "/v1/fast/abort/0123456789abcdef", {}),
    ("GET", "/v1/fast/shards/job/0/1", {}),
    ("POST", "/v1/fast/release/0123456789abcdef", {}),
]
# Peer-to-peer routes: the cluster token, whatever the access mode.
PEER_ATTACKS: list[tuple[str, str, dict[str, Any]]] = [
    ("DELETE", "/v1/internal/shards/job/0/1", {}),
    ("DELETE", "/v1/internal/namespaces/job", {}),
    ("POST", "/v1/internal/reset", {}),
    ("PUT", "/v1/internal/replicas/job/0/1", {"content": b"evil", "headers": {"Shard-Meta": meta(b"evil")}}),
    ("GET", "/v1/internal/shards/job/0/1", {}),
    # A forged report would make a home of the namespace index name copies that do not exist.
    ("PUT", "/v1/internal/catalog/job", {"content": b'{"node_id": "i-x", "steps": {"1": [0]}, "seq": 1}'}),
    ("GET", "/v1/internal/catalog/job", {"params": {"num_ranks": 2}}),
    ("GET", "/v1/internal/holders/job/1", {}),
]


def test_open_by_default_and_token_mode_refuses_writes_without_the_token(
    agent_plane: ControlPlane, sm: Any
) -> None:
    a, b = (url(n) for n in cluster(sm, agent_plane, "guarded", 2))
    assert httpx.get(f"{agent_plane.url}/clusters/guarded/checkpoint-policy").json()["AgentAccess"] == "Open"
    good = {rank: os.urandom(150_000 + rank) for rank in range(2)}
    assert create_namespace(a, "job", 2).status_code == 201
    for rank, data in good.items():
        assert put(a, "job", rank, 1, data).status_code == 200
    # Open (the default): the protocol serves anyone, deletes included, as documented.
    assert put(b, "job", 0, 2, b"scratch").status_code == 200
    assert httpx.delete(f"{a}/v1/cp/checkpoints/job/0/2").status_code == 200

    set_access(agent_plane, sm, "guarded", [a, b], "Token")
    answer = httpx.get(f"{agent_plane.url}/clusters/guarded/checkpoint-token").json()
    assert answer["AgentAccess"] == "Token"
    token = answer["CheckpointToken"]
    for agent in (a, b):
        # The agents' open policy document carries the token's hash, never the token.
        policy = httpx.get(f"{agent}/v1/policy").json()
        assert token not in json.dumps(policy)
        assert policy["checkpoint_access"]["token_sha256"] == hashlib.sha256(token.encode()).hexdigest()

    for agent in (a, b):
        for method, path, kwargs in ATTACKS:
            anonymous = httpx.request(method, f"{agent}{path}", **kwargs)
            assert anonymous.status_code == 401, (method, path, anonymous.text)
            assert anonymous.json()["error"] == "MissingToken"
            assert "checkpoint token" in anonymous.json()["message"]
            headers = {**kwargs.get("headers", {}), "Authorization": "Bearer not-the-token"}
            wrong = httpx.request(method, f"{agent}{path}", **{**kwargs, "headers": headers})
            assert wrong.status_code == 403, (method, path, wrong.text)
            assert wrong.json()["error"] == "InvalidToken"
        for method, path, kwargs in PEER_ATTACKS:
            anonymous = httpx.request(method, f"{agent}{path}", **kwargs)
            assert anonymous.status_code == 401, (method, path, anonymous.text)
            # The checkpoint token is not the cluster token: a trainer cannot act as a peer agent.
            headers = {**kwargs.get("headers", {}), "Authorization": f"Bearer {token}"}
            as_trainer = httpx.request(method, f"{agent}{path}", **{**kwargs, "headers": headers})
            assert as_trainer.status_code == 403, (method, path, as_trainer.text)

    # Nothing was destroyed or planted; reads stay open, on both agents.
    assert httpx.get(f"{a}/v1/cp/namespaces/planted").status_code == 404
    for agent in (a, b):
        assert latest(agent, "job") == [1]
        for rank, data in good.items():
            response = get(agent, "job", rank, 1)
            assert response.status_code == 200
            assert response.content == data

    # With the token a trainer saves, over HTTP (the SDK sends it) and over the same-host fast
    # path (raw here: the fast path's own checks are test_agent_fast_path's), and deletes.
    bearer = {"Authorization": f"Bearer {token}"}
    client = AgentClient(a, fast_path=False, checkpoint_token=token)
    try:
        client.put("job", 0, 2, good[0])
        reserved = httpx.post(f"{a}/v1/fast/reserve/job/1/2", params={"size": len(good[1])}, headers=bearer)
        assert reserved.status_code == 200, reserved.text
        with open(reserved.json()["path"], "r+b") as handle:
            handle.write(good[1])
        committed = httpx.post(f"{a}/v1/fast/commit/{reserved.json()['token']}", headers=bearer)
        assert committed.status_code == 200, committed.text
        assert client.latest("job") == [2, 1]
        assert client.get("job", 1, 2) == (good[1], "memory")
    finally:
        client.close()
    assert httpx.delete(f"{b}/v1/cp/checkpoints/job/0/2", headers=bearer).status_code == 200
    assert latest(a, "job") == [1]

    # The SDK without the token is refused, and says why.
    anonymous = AgentClient(b, fast_path=False)
    try:
        with pytest.raises(AgentError) as refused:
            anonymous.put("job", 0, 3, b"x")
        assert refused.value.status == 401
        assert refused.value.code == "MissingToken"
    finally:
        anonymous.close()

    # Back to Open: the library's protocol works without credentials again.
    set_access(agent_plane, sm, "guarded", [a, b], "Open")
    assert put(b, "job", 0, 4, b"open again").status_code == 200
    assert get(a, "job", 1, 1).content == good[1]
