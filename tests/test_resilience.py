"""What a training job sees after each node fault, through the SDK's ``load_latest``: a real control
plane with local agent processes, moto's S3 behind the test proxy, and a trainer that checkpoints
with ``dcp.save`` through ``TieredStorageWriter`` (world size 1, in this process, no process group).

The trainer's state at step n is ``training_state(n, 0)`` (tests/sdk_worker.py), so a restored state
is compared exactly with the one saved at the step ``load_latest`` reports. Every fault hits with a
save in flight (staged and not committed, or a shard stored without its metadata, or an S3 upload
without its commit marker), which must never be what comes back. Steps lost are counted as a
trainer counts them: the last step trained minus the step resumed from.
"""

from __future__ import annotations

import os
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from hyperpod_sim.infra.processes import find_agent_pids
from hyperpod_sim.sdk.client import HyperPodClient
from tests.conftest import SHARED_NETWORK, ControlPlane, wait_for
from tests.faults import descriptions, node_loss_timeline, node_status, restart_story, when
from tests.resilience import (
    EVERY,
    NS,
    RANK,
    agent_of,
    checkpoint,
    config_for,
    replaced,
    restarted_agent,
    resume,
    start_save,
    train,
)
from tests.s3_checkpoints import keys, markers, set_policy
from tests.s3proxy import FaultyS3Proxy
from tests.tier import cluster, replicated, url

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    # dcp.save and dcp.load without a process group say so; a job of world size 1 means it.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


@pytest.fixture
def agent_settings(s3_agent_settings: dict[str, Any], request: pytest.FixtureRequest) -> dict[str, Any]:
    """The S3 tier's agent settings (S3 through the proxy, tests/plugins/s3.py), with a test's own
    (indirect) on top."""
    extra: dict[str, Any] = getattr(request, "param", {})
    provisioning = {**SHARED_NETWORK["provisioning"], **extra.get("provisioning", {})}
    return {**s3_agent_settings, **extra, "provisioning": provisioning}


# ---------------------------------------------------------------------- the cluster


def injected(client: HyperPodClient, name: str, fault: dict[str, Any], what: str) -> str:
    """The injection event of ``fault``: the whole description (it ends with what was done)."""
    prefix = f"Fault {fault['FaultId']} injected: {fault['Type']} on node {fault['InstanceId']}"
    found = [t for t in descriptions(client, name) if t.startswith(prefix)]
    assert len(found) == 1, (prefix, descriptions(client, name))
    assert found[0].endswith(what), found[0]
    return found[0]


# ---------------------------------------------------------------------- the faults


def test_agent_crash_resumes_from_the_nodes_own_memory(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient
) -> None:
    """One node (no replica, no S3): whatever comes back after the crash was in that node's memory."""
    (node,) = cluster(sm, agent_plane, "crash", 1)
    victim, before = node["InstanceId"], url(node)
    last_saved = train(before, range(1, 8), save_every=EVERY)
    start_save(before, 8)  # in flight when the agent dies: step 8 is the last one trained
    (old_pid,) = find_agent_pids(victim)

    fault = client.inject_fault("crash", Type="AgentCrash", InstanceId=victim)
    injected(client, "crash", fault, f"agent pid {old_pid} killed with SIGKILL, its shared memory kept.")
    after = wait_for(
        lambda: restarted_agent(client, "crash", victim, other_than=before),
        timeout=60,
        what="the agent restarted on the same node",
        explain=lambda: restart_story(
            client, "crash", Path(agent_plane.services.settings.data_dir) / "agents" / victim
        ),
    )
    # The trainer on this node finds its agent again through the control plane.
    assert agent_of(agent_plane, "crash", victim) == after
    loaded = resume(after)
    assert loaded.step == last_saved == 6  # not the staged step 8: nothing of it was committed
    assert loaded.served_by == {RANK: "memory"}
    assert 8 - loaded.step <= EVERY  # steps lost: none saved, at most the checkpoint interval
    texts = descriptions(client, "crash")
    assert f"The agent of node {victim} exited unexpectedly; restarting it (restart 1 in a row)." in texts
    assert f"Agent re-registered at {after}." in texts
    assert not any(t.startswith(f"Node {victim} failed") for t in texts), texts
    assert [n["InstanceId"] for n in client.list_nodes("crash")] == [victim]


def test_node_loss_resumes_from_the_replica_on_the_peer(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient
) -> None:
    nodes = cluster(sm, agent_plane, "lost", 2)
    victim, peer = nodes[0]["InstanceId"], nodes[1]["InstanceId"]
    trainer = url(nodes[0])
    last_saved = train(trainer, range(1, 8), save_every=EVERY)
    # Step 8's save was under way: rank 0's shard stored (and replicated), its metadata never.
    config_for(trainer).client().put(NS, RANK, 8, os.urandom(4096))
    wait_for(lambda: replicated(trainer), timeout=30, what="the replicas on the peer")

    fault = client.inject_fault("lost", Type="NodeLoss", InstanceId=victim)
    injected(client, "lost", fault, "killed with SIGKILL, its shared memory wiped.")
    current = wait_for(lambda: replaced(client, "lost", {victim}, 2), timeout=90, what="the node replaced")
    (replacement,) = set(current) - {peer}

    # The job's pod is rescheduled onto the replacement node; its own memory is empty.
    loaded = resume(agent_of(agent_plane, "lost", replacement))
    assert loaded.step == last_saved == 6  # step 8 is incomplete everywhere, replica included
    assert loaded.served_by == {RANK: "replica"}  # the copy on the lost node's replica peer
    assert 8 - loaded.step <= EVERY
    # What the user sees: the only copies left are the peer's replicas; step 8 lacks its metadata.
    (view,) = client.checkpoints("lost")["Namespaces"]
    steps = {s["Step"]: s for s in view["Steps"]}
    assert steps[8] == {"Step": 8, "Memory": {}, "Replica": {"0": [peer]}, "S3": False, "Complete": False}
    assert steps[6] == {
        "Step": 6,
        "Memory": {},
        "Replica": {"0": [peer], "1": [peer]},
        "S3": False,
        "Complete": True,
    }
    node_loss_timeline(client, "lost", fault, replacement=f"{replacement} (NodeRecovery: Automatic).")


def test_losing_a_node_and_its_replica_peer_resumes_from_s3(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient, s3: Any, bucket: str, proxy: FaultyS3Proxy
) -> None:
    """Two nodes are each other's replica peer: losing both leaves only S3."""
    nodes = cluster(sm, agent_plane, "both", 2)
    lost = {n["InstanceId"] for n in nodes}
    trainer = url(nodes[0])
    s3_every = 4
    set_policy(agent_plane, sm, "both", S3BaseUri=f"s3://{bucket}/both", PersistEverySteps=s3_every)
    for step in range(1, 9):
        checkpoint(trainer, step)  # in memory every step
        if step % s3_every == 0:
            wait_for(lambda s=step: s in markers(s3, bucket, "both/job/"), timeout=60, what=f"step {step}")
    # Steps 9 to 12 in memory; step 12's persist is under way: rank 0's object is on S3, the upload
    # of its metadata hangs, so no commit marker is written.
    proxy.fault = lambda method, path: "hold" if method == "PUT" and "/step_12/metadata" in path else "pass"
    for step in range(9, 13):
        checkpoint(trainer, step)
    wait_for(
        lambda: proxy.count("hold") >= 1 and "both/job/rank_0/step_12/checkpoint.pt" in keys(s3, bucket),
        timeout=60,
        what="step 12 half on S3",
    )

    faults = [client.inject_fault("both", Type="NodeLoss", InstanceId=n) for n in sorted(lost)]
    proxy.fault = lambda method, path: "pass"
    proxy.release()  # the held upload's agent is dead; its connection is dropped
    current = wait_for(lambda: replaced(client, "both", lost, 2), timeout=90, what="both nodes replaced")

    loaded = resume(agent_of(agent_plane, "both", current[0]))
    assert loaded.step == 8  # the newest step with a commit marker, not the half-uploaded step 12
    assert loaded.served_by == {RANK: "s3"}
    assert 12 - loaded.step <= s3_every  # steps lost: at most the policy's S3 interval
    assert markers(s3, bucket, "both/job/") == [4, 8]
    assert "both/job/rank_0/step_12/checkpoint.pt" in keys(s3, bucket)  # there, and never loaded
    (view,) = client.checkpoints("both")["Namespaces"]
    assert [(s["Step"], s["S3"], s["Complete"], s["Memory"]) for s in view["Steps"]] == [
        (8, True, True, {}),
        (4, True, True, {}),
    ]
    texts = descriptions(client, "both")
    for fault in faults:
        node = fault["InstanceId"]
        injected(client, "both", fault, "killed with SIGKILL, its shared memory wiped.")
        assert f"Node {node} failed: no heartbeat from its agent for 3 s." in texts
        assert any(t.startswith(f"Node {node} is replaced by i-") for t in texts), texts
        assert any(t.startswith(f"Fault {fault['FaultId']} ended: NodeLoss on node {node}") for t in texts)


def test_a_hung_agent_is_replaced_and_the_job_resumes_from_the_replica(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient
) -> None:
    nodes = cluster(sm, agent_plane, "hang", 2)
    victim, peer = nodes[0]["InstanceId"], nodes[1]["InstanceId"]
    trainer = url(nodes[0])
    last_saved = train(trainer, range(1, 8), save_every=EVERY)
    start_save(trainer, 8)  # in flight when the agent hangs
    wait_for(lambda: replicated(trainer), timeout=30, what="the replicas on the peer")
    (pid,) = find_agent_pids(victim)

    fault = client.inject_fault("hang", Type="AgentHang", InstanceId=victim, DurationSeconds=600)
    injected(client, "hang", fault, f"agent pid {pid} stopped with SIGSTOP, its shared memory kept.")
    current = wait_for(lambda: replaced(client, "hang", {victim}, 2), timeout=90, what="the node replaced")
    (replacement,) = set(current) - {peer}
    # The hung agent was stopped (SIGTERM and SIGCONT) and is gone; the fault ended with its node.
    wait_for(lambda: not find_agent_pids(victim), timeout=30, what="the hung agent to exit")
    assert client.list_faults("hang") == []

    loaded = resume(agent_of(agent_plane, "hang", replacement))
    assert loaded.step == last_saved == 6
    assert loaded.served_by == {RANK: "replica"}
    assert 8 - loaded.step <= EVERY
    texts = descriptions(client, "hang")
    injected_at = when(client, "hang", f"Fault {fault['FaultId']} injected: AgentHang on node {victim}")
    failed = when(client, "hang", f"Node {victim} failed: no heartbeat from its agent for 3 s.")
    replacing = when(client, "hang", f"Node {victim} is replaced by {replacement} (NodeRecovery: Automatic).")
    ended = when(
        client,
        "hang",
        f"Fault {fault['FaultId']} ended: AgentHang on node {victim} (for 600 s); the node is shutting down.",
    )
    assert injected_at < failed <= replacing <= ended, texts


# The agents here die as soon as they start, before they register (a crash loop at startup): the
# control plane gives such an agent the launch timeout to register, and its node stays up through
# the backoff (longer than the 3 s heartbeat timeout before the 3rd restart).
def test_an_agent_that_keeps_crashing_is_restarted_with_growing_delays(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient
) -> None:
    (node,) = cluster(sm, agent_plane, "loop", 1)
    victim, first = node["InstanceId"], url(node)
    last_saved = train(first, range(1, 6), save_every=EVERY)
    start_save(first, 6)  # in flight when the agent first dies
    seen: set[int] = set()
    crashes = 4
    for crash in range(1, crashes + 1):
        # As soon as the agent is back (its process exists), it dies again.
        (pid,) = wait_for(
            lambda: [p for p in find_agent_pids(victim) if p not in seen],
            timeout=30,
            what=f"the agent's process before crash {crash}",
        )
        seen.add(pid)
        fault = client.inject_fault("loop", Type="AgentCrash", InstanceId=victim)
        injected(client, "loop", fault, f"agent pid {pid} killed with SIGKILL, its shared memory kept.")
    after = wait_for(
        lambda: restarted_agent(client, "loop", victim, other_than=first),
        timeout=60,
        what="the agent to run again after the last crash",
    )

    restarts = [
        when(
            client,
            "loop",
            f"The agent of node {victim} exited unexpectedly; restarting it (restart {n} in a row).",
        )
        for n in range(1, crashes + 1)
    ]
    assert restarts == sorted(restarts)
    gaps = [later - earlier for earlier, later in pairwise(restarts)]
    assert all(shorter < longer for shorter, longer in pairwise(gaps)), gaps  # each wait longer than the last
    texts = descriptions(client, "loop")
    assert not any(t.startswith(f"Node {victim} failed") for t in texts), texts
    assert node_status(client, "loop", victim) == "Running"
    # The node kept its id and its memory through every crash: the job resumes from it.
    loaded = resume(after)
    assert loaded.step == last_saved == 4  # not the staged step 6
    assert loaded.served_by == {RANK: "memory"}


def test_an_agent_that_crashes_after_registering_is_restarted_not_replaced(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient
) -> None:
    """The crash loop of a daemon that gets as far as registering each time (3 s heartbeat timeout)."""
    (node,) = cluster(sm, agent_plane, "again", 1)
    victim, endpoint = node["InstanceId"], url(node)
    last_saved = train(endpoint, range(1, 6), save_every=EVERY)

    def back(other_than: str) -> str | None:
        texts = descriptions(client, "again")
        assert not any(t.startswith(f"Node {victim} failed") for t in texts), texts
        return restarted_agent(client, "again", victim, other_than=other_than)

    for crash in range(1, 5):
        # The agent is back and registered (it answers at its new endpoint); it dies again.
        client.inject_fault("again", Type="AgentCrash", InstanceId=victim)
        endpoint = wait_for(lambda e=endpoint: back(e), timeout=30, what=f"the restart after crash {crash}")
    texts = descriptions(client, "again")
    assert f"The agent of node {victim} exited unexpectedly; restarting it (restart 4 in a row)." in texts
    loaded = resume(endpoint)
    assert loaded.step == last_saved
    assert loaded.served_by == {RANK: "memory"}
