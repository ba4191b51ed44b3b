"""The reconciler's phases, each on its own: no HTTP, a real SQLite database, a manual clock and a
fake provisioner (tests/service_fakes.py). Each phase runs in a transaction of the test's, on the
locked cluster as ``Reconciler.step`` would, and its Outcome says what it did."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TypeVar

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, selectinload

from hyperpod_sim.domain import events
from hyperpod_sim.domain.checkpoints.pushes import claim_pushes
from hyperpod_sim.domain.clusters.service import ClusterService
from hyperpod_sim.domain.lifecycle import ClusterStatus, GroupStatus, NodeStatus
from hyperpod_sim.domain.node_operations.reboot_replace import NodeOperations
from hyperpod_sim.domain.outcome import Outcome
from hyperpod_sim.domain.reconciler import Reconciler, Rollout
from hyperpod_sim.models import Cluster, Database, Node
from hyperpod_sim.models.groups import ResourceTag, TieredStorage
from tests.conftest import EKS, ManualClock, free_port, group_spec
from tests.service_fakes import (
    CountingIds,
    FakeProvisioner,
    clock,
    cluster_service,
    db,
    descriptions,
    ids,
    load,
    make_reconciler,
)

__all__ = ["clock", "db", "ids"]  # fixtures

T = TypeVar("T")


@pytest.fixture
def service(db: Database, clock: ManualClock, ids: CountingIds) -> ClusterService:
    return cluster_service(db, clock, ids)


@contextmanager
def locked(db: Database, name: str) -> Iterator[tuple[Session, Cluster]]:
    with db.write() as session:
        cluster = session.scalars(
            select(Cluster)
            .where(Cluster.name == name)
            .options(selectinload(Cluster.instance_groups), selectinload(Cluster.nodes))
            .with_for_update()
        ).one()
        yield session, cluster


def phase(db: Database, name: str, run: Callable[[Session, Cluster], T]) -> T:
    with locked(db, name) as (session, cluster):
        return run(session, cluster)


def statuses(db: Database, name: str) -> list[str]:
    return sorted(n.status for n in load(db, name).nodes)


def test_scale_groups_launches_to_the_target_and_brings_nodes_up(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    service.create_cluster(name="sim", instance_groups=[group_spec("a", 2)])
    provisioner = FakeProvisioner(ready=False)
    reconciler = make_reconciler(db, clock, ids, provisioner)
    outcome = phase(db, "sim", lambda s, c: reconciler.scale_groups(s, c, clock.now()))
    assert (outcome.changed, outcome.converged, outcome.launches) == (True, False, [])  # no agents
    assert outcome.due == clock.now()  # the launch delay (0 s) is over at once
    assert statuses(db, "sim") == ["Pending", "Pending"]
    provisioner.ready = True
    outcome = phase(db, "sim", lambda s, c: reconciler.scale_groups(s, c, clock.now()))
    assert (outcome.changed, outcome.converged) == (True, True)
    assert statuses(db, "sim") == ["Running", "Running"]


def test_scale_groups_with_agents_asks_for_launches(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    service.create_cluster(name="agents", instance_groups=[group_spec("a", 2)])
    reconciler = make_reconciler(db, clock, ids, FakeProvisioner(uses_agents=True))
    outcome = phase(db, "agents", lambda s, c: reconciler.scale_groups(s, c, clock.now()))
    nodes = load(db, "agents").nodes
    assert sorted(outcome.launches) == sorted(n.id for n in nodes)
    assert not outcome.converged  # nobody registered yet
    assert [n.slot for n in sorted(nodes, key=lambda n: n.slot)] == [0, 1]


def test_scale_down_shuts_down_failed_then_pending_then_newest(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    service.create_cluster(name="big", instance_groups=[group_spec("a", 4)])
    reconciler = make_reconciler(db, clock, ids, FakeProvisioner())
    reconciler.run_once()
    with locked(db, "big") as (session, cluster):
        oldest, _, _, newest = sorted(cluster.nodes, key=lambda n: n.id)
        events.move(session, oldest, NodeStatus.FAILURE, ids=ids, now=clock.now())
        cluster.instance_groups[0].target_count = 2
        newest.launch_time = clock.now() + timedelta(seconds=1)
        outcome = reconciler.scale_groups(session, cluster, clock.now())
    assert (outcome.changed, outcome.converged, outcome.again) == (True, False, True)
    shut = {n.id for n in load(db, "big").nodes if n.status == NodeStatus.SHUTTING_DOWN}
    assert shut == {oldest.id, newest.id}
    assert f"Node {newest.id} is shutting down (scale-down)." in descriptions(db, "big")


def test_remove_stopped_nodes_waits_for_the_agent(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    service.create_cluster(name="one", instance_groups=[group_spec("a", 2)])
    provisioner = FakeProvisioner()
    reconciler = make_reconciler(db, clock, ids, provisioner)
    reconciler.run_once()
    victim = load(db, "one").nodes[0].id
    service.batch_delete_cluster_nodes(name="one", node_ids=[victim])
    provisioner.still_running.add(victim)
    outcome = phase(db, "one", reconciler.remove_stopped_nodes)
    assert not outcome.changed
    assert provisioner.terminated == [victim]
    provisioner.still_running.clear()
    outcome = phase(db, "one", reconciler.remove_stopped_nodes)
    assert outcome.changed
    assert provisioner.terminated == [victim, victim]  # asked again each pass: idempotent
    assert victim not in {n.id for n in load(db, "one").nodes}


def test_drain_deleted_groups_then_remove_them(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    service.create_cluster(name="one", instance_groups=[group_spec("a", 1), group_spec("b", 2)])
    reconciler = make_reconciler(db, clock, ids, FakeProvisioner())
    reconciler.run_once()
    service.update_cluster(name="one", instance_groups_to_delete=["b"])
    outcome = phase(db, "one", lambda s, c: reconciler.drain_deleted_groups(s, c, clock.now()))
    assert (outcome.changed, outcome.again) == (True, True)
    cluster = load(db, "one")
    assert sorted((n.group_name, n.status) for n in cluster.nodes) == [
        ("a", "Running"),
        ("b", "ShuttingDown"),
        ("b", "ShuttingDown"),
    ]
    phase(db, "one", reconciler.remove_stopped_nodes)
    phase(db, "one", lambda s, c: reconciler.drain_deleted_groups(s, c, clock.now()))
    assert [g.name for g in load(db, "one").instance_groups] == ["a"]


def test_settle_status_only_when_converged(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    service.create_cluster(name="one", instance_groups=[group_spec("a", 1)])
    reconciler = make_reconciler(db, clock, ids, FakeProvisioner())
    settle = reconciler.settle_status
    assert phase(db, "one", lambda s, c: settle(s, c, clock.now(), converged=False)) == Outcome()
    assert load(db, "one").status == ClusterStatus.CREATING
    assert phase(db, "one", lambda s, c: settle(s, c, clock.now(), converged=True)).changed
    cluster = load(db, "one")
    assert (cluster.status, cluster.instance_groups[0].status) == ("InService", GroupStatus.IN_SERVICE)
    assert "Cluster is InService with 0 nodes." in descriptions(db, "one")


def test_finish_deletion_shuts_nodes_down_then_removes_the_cluster(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    service.create_cluster(
        name="one", instance_groups=[group_spec("a", 2)], tags=[ResourceTag(key="k", value="v")]
    )
    reconciler = make_reconciler(db, clock, ids, FakeProvisioner())
    reconciler.run_once()
    service.delete_cluster(name="one")
    outcome = phase(db, "one", lambda s, c: reconciler.finish_deletion(s, c, clock.now()))
    assert (outcome.changed, outcome.again, outcome.converged) == (True, True, False)
    assert statuses(db, "one") == ["ShuttingDown", "ShuttingDown"]
    phase(db, "one", reconciler.remove_stopped_nodes)
    phase(db, "one", lambda s, c: reconciler.finish_deletion(s, c, clock.now()))
    with db.read() as session:
        assert session.scalars(select(Cluster)).all() == []


def registered(db: Database, name: str, clock: ManualClock, *, acked: int = 1) -> list[Node]:
    """Every node of ``name`` as if its agent had registered and applied generation ``acked``."""
    with locked(db, name) as (_, cluster):
        for node in cluster.nodes:
            node.registered_at = node.last_heartbeat = clock.now()
            node.endpoint = f"http://127.0.0.1:{free_port()}"  # nobody listens there
            node.push_token = "push-token"
            node.token_hash = "registered"  # the digest of a node token it holds
            node.acked_generation = acked
    return load(db, name).nodes


def agents_cluster(service: ClusterService, db: Database, reconciler: Reconciler, **extra: object) -> None:
    service.create_cluster(name="one", instance_groups=[group_spec("a", 2)], orchestrator=EKS, **extra)  # type: ignore[arg-type]
    phase(db, "one", lambda s, c: reconciler.scale_groups(s, c, reconciler.clock.now()))


def test_detect_failures_fails_silent_nodes_and_replaces_them(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    reconciler = make_reconciler(db, clock, ids, FakeProvisioner(uses_agents=True))
    agents_cluster(service, db, reconciler)
    silent, _ = registered(db, "one", clock)
    clock.advance(5)
    with locked(db, "one") as (_, cluster):
        next(n for n in cluster.nodes if n.id != silent.id).last_heartbeat = clock.now()

    def detect(session: Session, cluster: Cluster) -> Outcome:
        return reconciler.health.detect_failures(
            session,
            cluster,
            clock.now(),
            back=clock.now() - timedelta(hours=1),
            restart_pending=set(),
            started_again_and_silent=lambda node: False,
        )

    outcome = phase(db, "one", detect)
    assert not outcome.changed
    assert outcome.due == silent.last_heartbeat + timedelta(seconds=10)  # its heartbeat deadline
    clock.advance(5)
    outcome = phase(db, "one", detect)
    assert (outcome.changed, outcome.again) == (True, True)
    cluster = load(db, "one")
    assert cluster.generation == 2  # the ring changed
    by_id = {n.id: n for n in cluster.nodes}
    assert by_id[silent.id].status == NodeStatus.SHUTTING_DOWN
    assert by_id[silent.id].status_message == "Node failed: no heartbeat from its agent for 10 s."
    (replacement,) = outcome.launches
    assert (by_id[replacement].status, by_id[replacement].slot) == ("Pending", silent.slot)
    texts = descriptions(db, "one")
    assert f"Node {silent.id} failed: no heartbeat from its agent for 10 s." in texts
    assert f"Node {silent.id} is replaced by {replacement} (NodeRecovery: Automatic)." in texts


def test_restart_crashed_agents_with_a_backoff(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    provisioner = FakeProvisioner(uses_agents=True, owns_agents=True)
    reconciler = make_reconciler(db, clock, ids, provisioner)
    agents_cluster(service, db, reconciler)
    crashed, _ = registered(db, "one", clock)
    provisioner.exited = {crashed.id}

    def restart(session: Session, cluster: Cluster) -> Outcome:
        return reconciler.health.restart_crashed_agents(session, cluster, clock.now())

    outcome = phase(db, "one", restart)
    assert (outcome.launches, outcome.restart_pending) == ([crashed.id], set())
    clock.advance(0.5)  # crashed again at once: it waits out its backoff (1 s), and is not failed
    outcome = phase(db, "one", restart)
    assert (outcome.launches, outcome.restart_pending) == ([], {crashed.id})
    assert outcome.due is not None
    clock.advance(0.5)
    outcome = phase(db, "one", restart)
    assert outcome.launches == [crashed.id]
    node = {n.id: n for n in load(db, "one").nodes}[crashed.id]
    assert node.agent_restarts == 2
    assert f"The agent of node {crashed.id} exited unexpectedly; restarting it (restart 2 in a row)." in (
        descriptions(db, "one")
    )


def test_claim_pushes_claims_each_behind_node_once(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    reconciler = make_reconciler(db, clock, ids, FakeProvisioner(uses_agents=True))
    agents_cluster(service, db, reconciler, tiered_storage=TieredStorage(mode="Enable"))
    behind, current = registered(db, "one", clock, acked=0)
    with locked(db, "one") as (_, cluster):
        next(n for n in cluster.nodes if n.id == current.id).acked_generation = 1
    outcome = phase(db, "one", lambda s, c: claim_pushes(s, c, clock.now(), reconciler.pusher.config))
    (push,) = outcome.pushes
    assert (push.node_id, push.token, push.policy.generation) == (behind.id, "push-token", 1)
    # Claimed: the next pass leaves it to the push in flight, until the claim runs out.
    outcome = phase(db, "one", lambda s, c: claim_pushes(s, c, clock.now(), reconciler.pusher.config))
    assert outcome.pushes == []
    assert outcome.due == clock.now() + timedelta(seconds=2)


def test_a_push_to_an_unreachable_agent_backs_off(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    reconciler = make_reconciler(db, clock, ids, FakeProvisioner(uses_agents=True))
    agents_cluster(service, db, reconciler)
    registered(db, "one", clock, acked=0)
    try:
        outcome = reconciler.reconcile(load(db, "one").id)
    finally:
        reconciler.pusher.close()
    assert len(outcome.pushes) == 2
    for node in load(db, "one").nodes:
        assert (node.push_attempts, node.push_claimed_until) == (1, None)
        assert node.next_push_at == clock.now() + timedelta(seconds=1)
        assert node.last_error is not None
        assert node.last_error.startswith("policy push of generation 1 failed: ConnectionRefusedError")


def test_adoption_at_start(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    provisioner = FakeProvisioner(uses_agents=True, owns_agents=True)
    first = make_reconciler(db, clock, ids, provisioner)
    agents_cluster(service, db, first)
    kept, gone = registered(db, "one", clock)
    provisioner.adoptable = {kept.id}
    restarted = make_reconciler(db, clock, ids, provisioner)
    restarted.run_once()
    assert provisioner.adopt_calls == [({kept.id, gone.id}, set())]
    assert provisioner.launched == [gone.id]  # started again; the other is adopted as it runs
    assert (
        "The control plane started: the agent of 1 node kept running and was adopted; the agent of 1 "
        "node was started again on their nodes (same node ids, same shared-memory directories)."
    ) in descriptions(db, "one")


def test_a_failed_start_is_tried_again_with_a_backoff_that_a_restart_resumes(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    missing = FileNotFoundError(2, "No such file or directory")
    provisioner = FakeProvisioner(uses_agents=True, launch_errors=[missing] * 4)
    reconciler = make_reconciler(db, clock, ids, provisioner, start_attempts=4)
    service.create_cluster(name="one", instance_groups=[group_spec("a", 1)], orchestrator=EKS)
    cluster_id = load(db, "one").id
    reconciler.reconcile(cluster_id)
    (node,) = load(db, "one").nodes
    assert (node.status, node.start_failures) == ("Pending", 1)
    assert node.next_start_at == clock.now() + timedelta(seconds=1)
    assert node.status_message == (
        "Its agent could not be started: [Errno 2] No such file or directory (attempt 1 of 4); "
        "starting it again in 1 s."
    )
    # A restarted control plane (a new reconciler on the same database) resumes the backoff: no
    # start before it is over, nor a failure for the node's silence.
    for delay in (1, 2):
        reconciler = make_reconciler(db, clock, ids, provisioner, start_attempts=4)
        outcome = reconciler.reconcile(cluster_id)
        assert provisioner.launched == [node.id] * delay
        assert outcome.due == load(db, "one").nodes[0].next_start_at
        clock.advance(delay)
        reconciler.reconcile(cluster_id)
        assert provisioner.launched == [node.id] * (delay + 1)
    assert load(db, "one").nodes[0].next_start_at == clock.now() + timedelta(seconds=4)
    clock.advance(4)
    reconciler.reconcile(cluster_id)
    (node,) = load(db, "one").nodes
    assert node.status == "Failure"
    assert node.status_message == (
        "Node failed: its agent could not be started: [Errno 2] No such file or directory (attempt 4 of 4)."
    )
    assert node.failed_in_a_row == 1  # it never registered: its slot's first failure in a row
    texts = descriptions(db, "one")
    assert [t for t in texts if "starting it again" in t] == [
        f"Node {node.id}: its agent could not be started: [Errno 2] No such file or directory "
        f"(attempt {n} of 4); starting it again in {d} s."
        for n, d in ((1, 1), (2, 2), (3, 4))
    ]


def stopped_update(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> tuple[Reconciler, FakeProvisioner]:
    """An InService cluster of one node updated to two, whose new nodes cannot start (launches
    raise EACCES; start_attempts 1, replace_limit 1), reconciled until its group's recovery stops."""
    provisioner = FakeProvisioner(uses_agents=True)
    reconciler = make_reconciler(db, clock, ids, provisioner, start_attempts=1, replace_limit=1)
    service.create_cluster(name="one", instance_groups=[group_spec("a", 1)], orchestrator=EKS)
    reconciler.run_once()
    registered(db, "one", clock, acked=100)  # current with every generation to come
    reconciler.run_once()
    assert load(db, "one").status == ClusterStatus.IN_SERVICE
    provisioner.launch_errors = [PermissionError(13, "Permission denied")] * 10
    service.update_cluster(name="one", instance_groups=[group_spec("a", 2)])
    reconciler.run_once()
    return reconciler, provisioner


def test_an_update_whose_new_nodes_cannot_start_ends_in_service_saying_why(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    reconciler, provisioner = stopped_update(service, db, clock, ids)
    cluster = load(db, "one")
    # The new node failed, its replacement too (replace_limit 1): the group keeps the failed one
    # and the update ends, InService, saying why.
    assert len(provisioner.launched) == 3
    assert (cluster.status, cluster.instance_groups[0].status) == ("InService", "InService")
    assert sorted(n.status for n in cluster.nodes) == ["Failure", "Running"]
    assert cluster.failure_message == (
        "Automatic node recovery of instance group 'a' stopped: the node in its slot 1 failed before "
        f"its agent registered 2 times in a row (1 replacement), the last time {provisioner.launched[-1]}: "
        "its agent could not be started: [Errno 13] Permission denied (attempt 1 of 1). UpdateCluster "
        "naming the group, or BatchReplaceClusterNodes of its failed nodes, resumes it."
    )
    assert cluster.failure_message in descriptions(db, "one")
    reconciler.run_once()
    assert len(provisioner.launched) == 3  # stopped: nothing more is launched
    provisioner.launch_errors = []
    service.update_cluster(name="one", instance_groups=[group_spec("a", 2)])
    reconciler.run_once()
    cluster = load(db, "one")
    assert cluster.failure_message is None
    assert len(provisioner.launched) == 4
    assert sorted(n.status for n in cluster.nodes) == ["Pending", "Running"]
    assert "Automatic node recovery of instance group 'a' resumes (UpdateCluster)." in descriptions(db, "one")


def test_replacing_the_failed_node_resumes_its_groups_recovery(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    reconciler, provisioner = stopped_update(service, db, clock, ids)
    failed = next(n for n in load(db, "one").nodes if n.status == NodeStatus.FAILURE)
    provisioner.launch_errors = []
    by_id, _ = NodeOperations(db=db, clock=clock, ids=ids).batch_replace(name="one", node_ids=[failed.id])
    assert by_id.successful == [failed.id]
    reconciler.run_once()
    cluster = load(db, "one")
    assert cluster.failure_message is None
    assert sorted(n.status for n in cluster.nodes) == ["Pending", "Running"]
    texts = descriptions(db, "one")
    assert "Automatic node recovery of instance group 'a' resumes (BatchReplaceClusterNodes)." in texts


def test_agents_started_by_a_launch_whose_transaction_fails_are_stopped_and_started_again(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    """Their launch secrets were never committed, so they could never register (issue 23: such an
    agent looped on 403 InvalidNodeSecret while its node stayed Running with a dead endpoint)."""
    provisioner = FakeProvisioner(uses_agents=True, owns_agents=True)
    provisioner.on_launch = lambda: db.begin_outage(fault_id="f-0123456789abcdef", duration_s=600)
    reconciler = make_reconciler(db, clock, ids, provisioner)
    service.create_cluster(name="one", instance_groups=[group_spec("a", 1)], orchestrator=EKS)
    cluster_id = load(db, "one").id
    with pytest.raises(OperationalError):
        reconciler.reconcile(cluster_id)  # the database went away before the launch committed
    db.end_outage()
    provisioner.on_launch = None
    (node,) = load(db, "one").nodes
    assert provisioner.unlaunched == [node.id]
    reconciler.reconcile(cluster_id)  # the next pass starts it again
    assert provisioner.launched == [node.id, node.id]
    (node,) = load(db, "one").nodes
    assert (node.status, node.start_failures, node.next_start_at) == ("Pending", 0, None)


def test_a_rollout_settles_without_another_pass_only_if_nothing_but_the_acknowledgements_changed(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    reconciler = make_reconciler(db, clock, ids, FakeProvisioner(uses_agents=True))
    agents_cluster(service, db, reconciler, tiered_storage=TieredStorage(mode="Enable"))
    registered(db, "one", clock, acked=1)
    with locked(db, "one") as (_, cluster):
        for node in cluster.nodes:
            node.status = NodeStatus.RUNNING
        cluster.status = ClusterStatus.IN_SERVICE
    service.update_cluster(name="one", tiered_storage=TieredStorage(mode="Enable", memory_percentage=40))
    # The pass that pushes the new generation: converged, but for both nodes behind.
    outcome = phase(db, "one", reconciler.step)
    assert (outcome.converged, len(outcome.behind), outcome.settled) == (True, 2, False)
    assert len(outcome.pushes) == 2
    cluster = load(db, "one")
    seen = Rollout(cluster.generation, ClusterStatus.UPDATING, 2)
    # One agent has applied it, the other not yet: not settled, nothing written.
    first, second = cluster.nodes
    with locked(db, "one") as (_, locked_cluster):
        next(n for n in locked_cluster.nodes if n.id == first.id).acked_generation = seen.generation
    assert not reconciler.settle_rollout(cluster.id, seen)
    assert load(db, "one").status == ClusterStatus.UPDATING
    # Both have, but the pass saw another number of nodes (one came or went since): not settled.
    with locked(db, "one") as (_, locked_cluster):
        next(n for n in locked_cluster.nodes if n.id == second.id).acked_generation = seen.generation
    assert not reconciler.settle_rollout(cluster.id, Rollout(seen.generation, seen.status, 3))
    # Nor with another generation than the pass pushed (a newer rollout began since).
    assert not reconciler.settle_rollout(cluster.id, Rollout(seen.generation - 1, seen.status, 2))
    assert load(db, "one").status == ClusterStatus.UPDATING
    # As the pass saw it, every node caught up: InService, its groups and its operation with it.
    assert reconciler.settle_rollout(cluster.id, seen)
    settled = load(db, "one")
    assert (settled.status, settled.instance_groups[0].status) == ("InService", GroupStatus.IN_SERVICE)
    assert settled.operation_id is None
    assert (
        f"Cluster is InService with 2 nodes; policy generation {seen.generation} applied on every node."
        in descriptions(db, "one")
    )
    assert not reconciler.settle_rollout(cluster.id, seen)  # settled already: not twice
