"""Node identity, attacked the way a process on the same machine would: raw HTTP against a real
control plane whose nodes are real agent processes (local provisioner).

A fake agent that holds the bootstrap token (or even the cluster token) races the agents the
provisioner launched for their nodes: every registration is refused, and the real agents' nodes
come up Running. A node that failed and was replaced keeps none of its credentials: its launch
secret, its node token and the replacement's spent secret are all refused.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from hyperpod_sim.infra.processes import find_agent_pids
from tests.agents import create_tiered, event_texts, nodes
from tests.conftest import ControlPlane, free_port, group, launch_secret, node_token, wait_for
from tests.helpers import bearer
from tests.tier import create_namespace, get, put, replicated, url

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


def register(plane: ControlPlane, cluster: str, token: str | None, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{plane.url}/agent/v1/clusters/{cluster}/register",
        json={"endpoint": f"http://127.0.0.1:{FAKE_PORT}", "pid": os.getpid(), **body},
        headers=bearer(token),
        timeout=10,
    )


def launch_secret_of(node_id: str) -> str:
    """What the provisioner handed the node's agent process (its environment, readable by its owner)."""
    (pid,) = find_agent_pids(node_id)
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(item.split(b"=", 1)[1].decode() for item in environ if item.startswith(b"HPSIM_AGENT_TOKEN="))


FAKE_PORT = free_port()


def test_a_fake_agent_cannot_claim_a_launched_node(agent_plane: ControlPlane, sm: Any) -> None:
    create_tiered(sm, "race", 2)
    bootstrap = httpx.get(f"{agent_plane.url}/clusters/race/agent-bootstrap").json()["BootstrapToken"]
    # The worst case: the fake agent has the cluster token too (the agents' shared token).
    cluster_token = agent_plane.services.clusters.agent_bootstrap(name="race").token
    answers: list[httpx.Response] = []

    def race() -> bool:
        """One round of the attack: every node the cluster lists, with every token at hand."""
        listed = sm.list_cluster_nodes(ClusterName="race")["ClusterNodeSummaries"]
        answers.append(register(agent_plane, "race", bootstrap, node_id=None))
        for summary in listed:
            for token in (bootstrap, cluster_token, None):
                answers.append(register(agent_plane, "race", token, node_id=summary["InstanceId"]))
        return bool(sm.describe_cluster(ClusterName="race")["ClusterStatus"] == "InService")

    wait_for(race, timeout=90, what="race to be InService while the fake agent tries")
    assert answers
    refusals = {(a.status_code, a.json()["error"]) for a in answers}
    assert refusals <= {(403, "BootstrapNotAccepted"), (403, "InvalidNodeSecret"), (401, "MissingToken")}
    assert (403, "InvalidNodeSecret") in refusals  # it did try the launched nodes themselves
    secret_refusal = next(a for a in answers if a.json()["error"] == "InvalidNodeSecret").json()["message"]
    assert "registers only with the launch secret" in secret_refusal

    # Every node is its real agent's: Running, at the endpoint its own process listens on.
    details = nodes(agent_plane, "race")
    assert len(details) == 2
    for node in details:
        assert node["InstanceStatus"]["Status"] == "Running"
        assert node["AgentStatus"]["Endpoint"] != f"http://127.0.0.1:{FAKE_PORT}"
        health = httpx.get(f"{url(node)}/health", timeout=10).json()
        assert (health["node_id"], health["registered"]) == (node["InstanceId"], True)
    assert not [text for text in event_texts(sm, "race") if str(FAKE_PORT) in text]

    # A checkpoint saved through the real agents loads byte for byte.
    first = url(details[0])
    assert create_namespace(first, "job", 1).status_code == 201
    data = os.urandom(200_000)
    assert put(first, "job", 0, 1, data).status_code == 200
    assert get(url(details[1]), "job", 0, 1).content == data


@pytest.mark.parametrize(
    "agent_settings",
    [{"provisioning": {"restart_agents": False, "heartbeat_timeout_s": 3.0}}],
    indirect=True,
)
def test_a_replaced_nodes_credentials_are_refused(agent_plane: ControlPlane, sm: Any) -> None:
    create_tiered(sm, "swap", 2)
    wait_for(
        lambda: sm.describe_cluster(ClusterName="swap")["ClusterStatus"] == "InService",
        timeout=90,
        what="swap to be InService",
    )
    first, second = nodes(agent_plane, "swap")
    victim, keeper = first["InstanceId"], second["InstanceId"]
    assert create_namespace(url(first), "job", 1).status_code == 201
    data = os.urandom(150_000)
    assert put(url(first), "job", 0, 1, data).status_code == 200
    wait_for(lambda: replicated(url(first)), timeout=30, what="the replica on the other node")

    # What an attacker could have taken from the victim: its launch secret and its node token
    # (the test plays its agent for the token; the victim's agent is killed right after).
    secret = launch_secret_of(victim)
    stolen = node_token(agent_plane, victim)
    for pid in find_agent_pids(victim):
        os.kill(pid, signal.SIGKILL)

    def replaced() -> str | None:
        listed = {n["InstanceId"]: n for n in nodes(agent_plane, "swap")}
        fresh = [n for n in listed if n not in (victim, keeper)]
        if victim in listed or len(fresh) != 1:
            return None
        return fresh[0] if listed[fresh[0]]["InstanceStatus"]["Status"] == "Running" else None

    replacement = wait_for(replaced, timeout=90, what="the victim to be replaced by a Running node")
    api = f"{agent_plane.url}/agent/v1/clusters/swap"

    # The old node token: it acts for nothing any more.
    heartbeat = httpx.post(
        f"{api}/nodes/{victim}/heartbeat", json={"applied_generation": 2}, headers=bearer(stolen)
    )
    assert heartbeat.status_code == 404  # the victim's node is gone: that is what its agent hears
    for method, path, body in (
        ("POST", f"/nodes/{replacement}/heartbeat", {"applied_generation": 2}),
        ("GET", f"/nodes/{replacement}/policy", None),
        ("POST", "/events", {"level": "Error", "message": "forged"}),
        ("GET", "/members", None),
        ("GET", "/namespaces/job", None),
        ("DELETE", "/namespaces/job", None),
    ):
        refused = httpx.request(method, f"{api}{path}", json=body, headers=bearer(stolen), timeout=10)
        assert (refused.status_code, refused.json()["error"]) == (403, "InvalidToken"), (path, refused.text)

    # The old launch secret registers neither the old node nor its replacement; nor does the
    # replacement's own secret, spent once its agent heartbeated with its node token.
    assert register(agent_plane, "swap", secret, node_id=victim).status_code == 404
    reused = register(agent_plane, "swap", secret, node_id=replacement)
    assert (reused.status_code, reused.json()["error"]) == (403, "InvalidNodeSecret")
    spent = register(agent_plane, "swap", launch_secret_of(replacement), node_id=replacement)
    assert (spent.status_code, spent.json()["error"]) == (403, "InvalidNodeSecret")
    assert "none is outstanding" in spent.json()["message"]

    # The replacement is its own agent's, and the checkpoint loads byte for byte through it.
    by_id = {n["InstanceId"]: n for n in nodes(agent_plane, "swap")}
    assert by_id[replacement]["InstanceStatus"]["Status"] == "Running"
    assert get(url(by_id[replacement]), "job", 0, 1).content == data
    assert get(url(by_id[keeper]), "job", 0, 1).content == data
    assert "forged" not in event_texts(sm, "swap")


def test_a_late_heartbeat_of_a_crashed_agent_cannot_lock_its_successor_out(
    agent_plane: ControlPlane, sm: Any
) -> None:
    """Bad luck on a loaded machine: an agent's heartbeat waits in the control plane's queue while
    an AgentCrash kills the agent and the provisioner launches its successor. That late heartbeat
    carries the dead agent's node token; had it still been valid, it would have spent the
    successor's launch secret, and the successor could never register (its node Running with a
    dead endpoint until it was failed for silence)."""
    create_tiered(sm, "late", 1)
    wait_for(
        lambda: sm.describe_cluster(ClusterName="late")["ClusterStatus"] == "InService",
        timeout=90,
        what="late to be InService",
    )
    (node,) = nodes(agent_plane, "late")
    victim = node["InstanceId"]
    held = node_token(agent_plane, victim)  # the token the crashed agent held (the test plays it)
    secret = launch_secret(agent_plane, victim)  # the successor's launch, as the provisioner does it
    api = f"{agent_plane.url}/agent/v1/clusters/late"
    late = httpx.post(
        f"{api}/nodes/{victim}/heartbeat", json={"applied_generation": 1}, headers=bearer(held), timeout=10
    )
    assert (late.status_code, late.json()["error"]) == (403, "InvalidToken")
    # The successor registers with its secret, and its own first heartbeat spends it.
    registered = register(agent_plane, "late", secret, node_id=victim)
    assert registered.status_code == 200, registered.text
    token = registered.json()["node_token"]
    beat = httpx.post(
        f"{api}/nodes/{victim}/heartbeat", json={"applied_generation": 1}, headers=bearer(token), timeout=10
    )
    assert beat.status_code == 200, beat.text
    again = register(agent_plane, "late", secret, node_id=victim)
    assert (again.status_code, again.json()["error"]) == (403, "InvalidNodeSecret")


def test_a_caller_without_credentials_cannot_tell_a_missing_cluster_from_an_existing_one(
    control_plane: ControlPlane,
) -> None:
    """Issue 23 (e): ``/agent/v1`` is open to anyone who reaches the port, and without a token it
    answered 401 for an existing cluster and 404 for a missing one: a list of cluster names could
    be checked without any credential. Every route now answers the two alike, without a token and
    with a forged one."""
    control_plane.client().create_cluster(ClusterName="present", InstanceGroups=[group()])
    stranger = "i-0123456789abcdef0"  # a node id of neither cluster
    routes: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", "/members", None),
        ("GET", "/namespaces", None),
        ("GET", "/namespaces/job", None),
        ("POST", "/namespaces/job", {"num_ranks": 2, "steps_retained": 1}),
        ("DELETE", "/namespaces/job", None),
        ("POST", "/namespaces-reset", None),
        ("POST", "/events", {"level": "Info", "message": "hello"}),
        ("POST", f"/nodes/{stranger}/heartbeat", {"applied_generation": 1}),
        ("GET", f"/nodes/{stranger}/policy", None),
        ("POST", "/register", {"endpoint": "http://127.0.0.1:9", "pid": 1}),
        ("POST", "/register", {"endpoint": "http://127.0.0.1:9", "pid": 1, "node_id": stranger}),
    ]
    for token in (None, "forged-token"):
        for method, path, body in routes:
            answers = [
                httpx.request(
                    method,
                    f"{control_plane.url}/agent/v1/clusters/{name}{path}",
                    json=body,
                    headers=bearer(token),
                    timeout=10,
                )
                for name in ("present", "absent")
            ]
            present, absent = (
                (a.status_code, a.text.replace(name, "NAME"))
                for a, name in zip(answers, ("present", "absent"), strict=True)
            )
            assert present == absent, (method, path, token, present, absent)
            assert present[0] in (401, 403, 404), (method, path, token, present)
