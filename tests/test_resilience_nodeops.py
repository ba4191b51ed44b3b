"""What a training job sees after BatchRebootClusterNodes and BatchReplaceClusterNodes, as
tests/test_resilience.py shows it for faults (the same trainer, the same control plane with local
agent processes, moto's S3 behind the test proxy).

A reboot keeps the node (its id, its slot) and clears its memory; a replace gives the slot a new
node. Both stop the agent gracefully first, so it persists its newest complete step to S3 before it
goes, where S3 is configured: that is what a fault (a crash, a lost node) cannot do.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from hyperpod_sim.sdk.client import ClusterError, HyperPodClient
from tests.conftest import EKS, ROLE, SHARED_NETWORK, ControlPlane, wait_for
from tests.faults import descriptions, when
from tests.resilience import (
    EVERY,
    RANK,
    agent_of,
    checkpoint,
    replaced,
    restarted_agent,
    resume,
    start_save,
    train,
)
from tests.s3_checkpoints import markers, set_policy
from tests.tier import cluster, members, replicated, url

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


@pytest.fixture
def agent_settings(s3_agent_settings: dict[str, Any]) -> dict[str, Any]:
    """S3 through the test proxy (tests/plugins/s3.py), on the shared network, as in
    tests/test_resilience.py (these tests tell an agent started again by its new endpoint)."""
    return {**s3_agent_settings, **SHARED_NETWORK}


def steps_view(client: HyperPodClient, name: str) -> dict[int, dict[str, Any]]:
    (view,) = client.checkpoints(name)["Namespaces"]
    return {s["Step"]: s for s in view["Steps"]}


# ---------------------------------------------------------------------- reboot


def test_a_rebooted_node_keeps_its_id_and_the_job_resumes_from_the_replica(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient
) -> None:
    nodes = cluster(sm, agent_plane, "reboot", 2)
    victim, peer = nodes[0]["InstanceId"], nodes[1]["InstanceId"]
    before = url(nodes[0])
    last_saved = train(before, range(1, 8), save_every=EVERY)
    start_save(before, 8)  # staged, never committed: the reboot hits with it in flight
    wait_for(lambda: replicated(before), timeout=30, what="the replicas on the peer")

    answer = sm.batch_reboot_cluster_nodes(ClusterName="reboot", NodeIds=[victim])
    assert (answer["Successful"], answer["Failed"]) == ([victim], [])
    after = wait_for(
        lambda: restarted_agent(client, "reboot", victim, other_than=before),
        timeout=60,
        what="the node back with a new agent",
    )
    # The same node: its id, and the trainer on it finds its agent again through the control plane.
    assert sorted(n["InstanceId"] for n in client.list_nodes("reboot")) == sorted([victim, peer])
    assert agent_of(agent_plane, "reboot", victim) == after
    # Its memory was cleared: step 6 comes back from the copy on its replica peer.
    loaded = resume(after)
    assert loaded.step == last_saved == 6
    assert loaded.served_by == {RANK: "replica"}
    assert 8 - loaded.step <= EVERY
    # Exactly what is left: every step's copies on the peer, none on the rebooted node, no step 8.
    assert steps_view(client, "reboot") == {
        step: {
            "Step": step,
            "Memory": {},
            "Replica": {"0": [peer], "1": [peer]},
            "S3": False,
            "Complete": True,
        }
        for step in (6, 4, 2)
    }
    texts = descriptions(client, "reboot")
    for text in (
        f"Node {victim} is rebooting (BatchRebootClusterNodes): its agent stops (after persisting its "
        "unpersisted steps to S3), its shared memory is cleared, and it starts again with the same node id.",
        f"Node {victim} rebooted: its agent stopped and its shared memory was cleared; the agent is "
        "starting again.",
        f"Agent registered at {after}.",
    ):
        assert text in texts, texts
    assert not any(t.startswith(f"Node {victim} failed") for t in texts), texts
    assert not any("exited unexpectedly" in t for t in texts), texts


def test_a_reboot_drains_to_s3_first_so_a_lone_node_loses_nothing(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient, s3: Any, bucket: str
) -> None:
    """One node, no replica peer: after the reboot only S3 is left, and the graceful stop put the
    newest complete step there (S3 every 4 steps would have left step 8)."""
    (node,) = cluster(sm, agent_plane, "drain", 1)
    victim, before = node["InstanceId"], url(node)
    set_policy(agent_plane, sm, "drain", S3BaseUri=f"s3://{bucket}/drain", PersistEverySteps=4)
    for step in range(1, 11):
        checkpoint(before, step)
    wait_for(lambda: 8 in markers(s3, bucket, "drain/job/"), timeout=60, what="step 8 on S3")

    sm.batch_reboot_cluster_nodes(ClusterName="drain", NodeIds=[victim])
    after = wait_for(
        lambda: restarted_agent(client, "drain", victim, other_than=before),
        timeout=60,
        what="the node back",
    )
    assert 10 in markers(s3, bucket, "drain/job/")  # persisted by the agent as it stopped
    loaded = resume(after)
    assert loaded.step == 10
    assert loaded.served_by == {RANK: "s3"}  # its memory was cleared, and it has no peer
    assert steps_view(client, "drain")[10]["Memory"] == {}


# ---------------------------------------------------------------------- replace


def test_a_replaced_node_is_new_and_the_job_resumes_from_the_replica(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient
) -> None:
    nodes = cluster(sm, agent_plane, "swap", 2)
    victim, peer = nodes[0]["InstanceId"], nodes[1]["InstanceId"]
    trainer = url(nodes[0])
    last_saved = train(trainer, range(1, 8), save_every=EVERY)
    start_save(trainer, 8)
    wait_for(lambda: replicated(trainer), timeout=30, what="the replicas on the peer")

    answer = sm.batch_replace_cluster_nodes(ClusterName="swap", NodeIds=[victim])
    assert (answer["Successful"], answer["Failed"]) == ([victim], [])
    current = wait_for(lambda: replaced(client, "swap", {victim}, 2), timeout=90, what="the node replaced")
    (replacement,) = set(current) - {peer}

    # The job's pod goes to the new node: fresh hardware, nothing in its memory.
    loaded = resume(agent_of(agent_plane, "swap", replacement))
    assert loaded.step == last_saved == 6
    assert loaded.served_by == {RANK: "replica"}
    assert 8 - loaded.step <= EVERY
    texts = descriptions(client, "swap")
    assert f"Node {replacement} launched in group workers." in texts
    assert not any(t.startswith(f"Node {victim} failed") for t in texts), texts
    assert sm.describe_cluster(ClusterName="swap")["InstanceGroups"][0]["CurrentCount"] == 2


def test_replacing_a_node_and_its_peer_resumes_from_what_they_drained_to_s3(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient, s3: Any, bucket: str
) -> None:
    """Both nodes of the ring replaced: no memory and no replica is left, only S3, where each agent
    put its newest complete step as it stopped (where a NodeLoss of both leaves the last interval's)."""
    nodes = cluster(sm, agent_plane, "both", 2)
    old = {n["InstanceId"] for n in nodes}
    trainer = url(nodes[0])
    set_policy(agent_plane, sm, "both", S3BaseUri=f"s3://{bucket}/both", PersistEverySteps=4)
    for step in range(1, 11):
        checkpoint(trainer, step)
    wait_for(lambda: 8 in markers(s3, bucket, "both/job/"), timeout=60, what="step 8 on S3")

    answer = sm.batch_replace_cluster_nodes(ClusterName="both", NodeIds=sorted(old))
    assert sorted(answer["Successful"]) == sorted(old)
    current = wait_for(lambda: replaced(client, "both", old, 2), timeout=90, what="both nodes replaced")
    loaded = resume(agent_of(agent_plane, "both", current[0]))
    assert loaded.step == 10
    assert loaded.served_by == {RANK: "s3"}
    assert 10 in markers(s3, bucket, "both/job/")
    # What is left: S3 only (step 8 from the interval, step 10 from the drain; whether the
    # retention pass after the drain removed step 4 before the agent exited is a race).
    view = steps_view(client, "both")
    assert list(view)[:2] == [10, 8]
    assert all(
        s == {"Step": step, "Memory": {}, "Replica": {}, "S3": True, "Complete": True}
        for step, s in view.items()
    ), view


# ---------------------------------------------------------------------- rolling software update


def test_a_rolling_software_update_keeps_the_job_on_s3(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient, s3: Any, bucket: str
) -> None:
    """Two nodes, each the other's replica peer: they are updated one at a time (never together),
    but the second batch clears the replicas the first node's steps had left, so no copy in memory
    survives the whole update; what carries the job through is the graceful stop of each agent,
    which persists its newest complete step to S3 first."""
    nodes = cluster(sm, agent_plane, "patch", 2)
    a, b = nodes[0]["InstanceId"], nodes[1]["InstanceId"]
    before = url(nodes[0])
    set_policy(agent_plane, sm, "patch", S3BaseUri=f"s3://{bucket}/patch", PersistEverySteps=4)
    for step in range(1, 11):
        checkpoint(before, step)
    wait_for(lambda: 8 in markers(s3, bucket, "patch/job/"), timeout=60, what="step 8 on S3")
    wait_for(lambda: replicated(before), timeout=30, what="the replicas on the peer")

    sm.update_cluster_software(ClusterName="patch")
    assert sm.describe_cluster(ClusterName="patch")["ClusterStatus"] == "SystemUpdating"
    wait_for(
        lambda: sm.describe_cluster(ClusterName="patch")["ClusterStatus"] == "InService",
        timeout=120,
        what="the update to finish",
    )
    texts = descriptions(client, "patch")
    assert "Software update started: workers to 1.1.0; 2 nodes in 2 batches." in texts
    # One node per batch (each is the other's replica peer); the second went down only once the
    # first was back.
    (one,) = [
        n for n in (a, b) if f"Node {n} is updating to image release 1.1.0 (batch 1 of 2)" in " ".join(texts)
    ]
    (two,) = {a, b} - {one}
    # (In the same pass, so at the same time: the listing orders those by event id.)
    back = when(client, "patch", f"Node {one} is Running on image release 1.1.0.")
    down = when(client, "patch", f"Node {two} is updating to image release 1.1.0")
    assert back <= down, texts
    assert not [t for t in texts if t.startswith("Node ") and " failed: " in t], texts
    after = agent_of(agent_plane, "patch", a)
    assert after != before
    loaded = resume(after)
    assert loaded.step == 10  # drained to S3 by a's agent as it stopped: no step lost
    assert loaded.served_by == {RANK: "s3"}
    view = steps_view(client, "patch")
    assert all(s["Memory"] == {} and s["Replica"] == {} for s in view.values()), view
    assert sorted(n["InstanceId"] for n in client.list_nodes("patch")) == sorted([a, b])


# ---------------------------------------------------------------------- added nodes


def test_an_added_node_gets_an_agent_and_joins_the_ring(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient
) -> None:
    sm.create_cluster(
        ClusterName="grow",
        InstanceGroups=[
            {
                "InstanceGroupName": "workers",
                "InstanceType": "ml.p5.48xlarge",
                "InstanceCount": 1,
                "ExecutionRole": ROLE,
            }
        ],
        NodeProvisioningMode="Continuous",
    )
    wait_for(
        lambda: sm.describe_cluster(ClusterName="grow")["ClusterStatus"] == "InService",
        timeout=90,
        what="InService",
    )
    (first,) = [n["InstanceId"] for n in client.list_nodes("grow")]
    answer = sm.batch_add_cluster_nodes(
        ClusterName="grow", NodesToAdd=[{"InstanceGroupName": "workers", "IncrementTargetCountBy": 1}]
    )
    (added,) = answer["Successful"]
    current = wait_for(lambda: replaced(client, "grow", set(), 2), timeout=60, what="the added node running")
    (new,) = set(current) - {first}
    details = sm.describe_cluster_node(ClusterName="grow", NodeId=new)["NodeDetails"]
    assert details["NodeLogicalId"] == added["NodeLogicalId"]
    assert sm.describe_cluster(ClusterName="grow")["ClusterStatus"] == "InService"


# ---------------------------------------------------------------------- moved nodes


def continuous_cluster(sm: Any, name: str, count: int, percentage: int) -> list[str]:
    """An EKS cluster with NodeProvisioningMode Continuous and tiered storage, InService; its node ids."""
    sm.create_cluster(
        ClusterName=name,
        InstanceGroups=[
            {
                "InstanceGroupName": "workers",
                "InstanceType": "ml.p5.48xlarge",
                "InstanceCount": count,
                "ExecutionRole": ROLE,
            }
        ],
        Orchestrator=EKS,
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": percentage},
        NodeProvisioningMode="Continuous",
    )
    wait_for(
        lambda: sm.describe_cluster(ClusterName=name)["ClusterStatus"] == "InService",
        timeout=90,
        what=f"{name} InService",
    )
    return sorted(n["InstanceId"] for n in sm.list_cluster_nodes(ClusterName=name)["ClusterNodeSummaries"])


def member_ids(plane: ControlPlane, name: str) -> list[str]:
    return [n["InstanceId"] for n in members(plane, name)]


def test_a_moved_node_drains_to_the_source_s3_and_serves_the_target_policy(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient, s3: Any, bucket: str
) -> None:
    """A trainer saves on a node of ``src`` (no replicas: ReplicationFactor 0, S3 every 4 steps);
    the node moves to ``dst``. Its agent stopped gracefully first, so the source's S3 has the newest
    step, which a trainer on the other source node resumes from; the node, same id, runs an agent
    of ``dst`` with ``dst``'s policy, in ``dst``'s replica ring and no longer in ``src``'s."""
    moved, other = continuous_cluster(sm, "src", 2, percentage=20)
    (resident,) = continuous_cluster(sm, "dst", 1, percentage=30)
    set_policy(
        agent_plane, sm, "src", S3BaseUri=f"s3://{bucket}/src", PersistEverySteps=4, ReplicationFactor=0
    )
    set_policy(
        agent_plane, sm, "dst", S3BaseUri=f"s3://{bucket}/dst", PersistEverySteps=2, InMemoryRetention=2
    )
    before = agent_of(agent_plane, "src", moved)
    for step in range(1, 11):
        checkpoint(before, step)
    wait_for(lambda: 8 in markers(s3, bucket, "src/job/"), timeout=60, what="step 8 on S3")

    answer = sm.move_cluster_nodes(
        SourceClusterArn=sm.describe_cluster(ClusterName="src")["ClusterArn"],
        SourceInstanceGroupName="workers",
        TargetClusterArn=sm.describe_cluster(ClusterName="dst")["ClusterArn"],
        TargetInstanceGroupName="workers",
        NodeIds=[moved],
    )
    assert answer["Successful"] == [moved]

    def arrived() -> str | None:
        try:
            return restarted_agent(client, "dst", moved, other_than=before)
        except ClusterError:  # still detaching in src
            return None

    after = wait_for(
        arrived,
        timeout=90,
        what="the node Running in dst with a new agent",
    )
    # The source: the node is gone from its ring; its newest step is on its S3, put there by the
    # graceful stop (the interval would have left step 8), and a trainer there resumes from it.
    assert member_ids(agent_plane, "src") == [other]
    assert 10 in markers(s3, bucket, "src/job/")
    loaded = resume(agent_of(agent_plane, "src", other))
    assert loaded.step == 10
    assert loaded.served_by == {RANK: "s3"}
    assert moved not in {node for s in steps_view(client, "src").values() for node in s["Memory"].values()}
    # The target: the same node (id, logical id), in its ring, running its policy.
    assert agent_of(agent_plane, "dst", moved) == after
    assert sorted(member_ids(agent_plane, "dst")) == sorted([resident, moved])
    policy = httpx.get(f"{after}/v1/policy").json()
    assert policy["cluster_name"] == "dst"
    assert policy["s3"]["base_uri"] == f"s3://{bucket}/dst"
    assert policy["in_memory_retention"] == 2
    details = client.describe_node("dst", moved)
    assert (
        details["AgentStatus"]["AppliedPolicyGeneration"] == details["AgentStatus"]["DesiredPolicyGeneration"]
    )
    texts = descriptions(client, "dst")
    assert any(t.startswith(f"Node {moved} is attaching to group workers from group workers") for t in texts)
    assert not any(t.startswith(f"Node {moved} failed") for t in descriptions(client, "src")), texts
