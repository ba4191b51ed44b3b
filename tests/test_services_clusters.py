"""ClusterService on its own: no HTTP, a real SQLite database, a manual clock (tests/service_fakes.py).
Create, update and delete with their statuses, generations and events; the semantic rules
and the conflicts they raise; the declared transitions."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from hyperpod_sim.domain import events
from hyperpod_sim.domain.clusters.service import ClusterService
from hyperpod_sim.domain.errors import (
    ConflictException,
    InternalFailure,
    ResourceInUse,
    ResourceLimitExceeded,
    ResourceNotFound,
    ValidationException,
)
from hyperpod_sim.domain.lifecycle import (
    ClusterStatus,
    GroupStatus,
    NodeStatus,
    bump_generation,
    check_transition,
)
from hyperpod_sim.models import Cluster, Database
from hyperpod_sim.models.groups import ResourceTag, TieredStorage
from tests.conftest import EKS, ManualClock, group_spec
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


@pytest.fixture
def service(db: Database, clock: ManualClock, ids: CountingIds) -> ClusterService:
    return cluster_service(db, clock, ids)


def in_service(db: Database, clock: ManualClock, ids: CountingIds) -> None:
    """Run the reconciler (simulated nodes, no launch delay) until every cluster is InService."""
    reconciler = make_reconciler(db, clock, ids, FakeProvisioner())
    reconciler.run_once()


def test_create_cluster_is_creating_with_its_groups_and_an_event(
    service: ClusterService, db: Database
) -> None:
    changes: list[None] = []
    service.on_change = lambda: changes.append(None)
    created = service.create_cluster(
        name="one",
        instance_groups=[group_spec("a", 2), group_spec("b", 1)],
        tags=[ResourceTag(key="team", value="ml")],
        orchestrator=EKS,
        tiered_storage=TieredStorage(mode="Enable"),
    )
    assert created.arn == f"arn:aws:sagemaker:us-east-1:123456789012:cluster/{created.id}"
    cluster = load(db, "one")
    assert (cluster.status, cluster.generation, cluster.node_recovery) == ("Creating", 1, "Automatic")
    assert [(g.name, g.status, g.target_count) for g in cluster.instance_groups] == [
        ("a", "Creating", 2),
        ("b", "Creating", 1),
    ]
    # The default memory share is filled in.
    assert cluster.tiered_storage == TieredStorage(mode="Enable", instance_memory_allocation_percentage=20)
    assert descriptions(db, "one") == ["Cluster creation started with 3 nodes in 2 instance groups."]
    assert changes == [None]  # the reconciler is woken


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({}, ValidationException, "CreateCluster needs at least one instance group"),
        (
            {"instance_groups": [group_spec("a"), group_spec("a")]},
            ValidationException,
            "Instance group name 'a' appears more than once",
        ),
        (
            {
                "instance_groups": [
                    group_spec("a", InstanceRequirements={"InstanceTypes": ["ml.p5.48xlarge"]})
                ]
            },
            ValidationException,
            "must specify exactly one of InstanceType or InstanceRequirements",
        ),
        ({"instance_groups": [group_spec("a", 17)]}, ResourceLimitExceeded, "over the account limit of 16"),
        (
            {"instance_groups": [group_spec("a")], "tiered_storage": TieredStorage(mode="Enable")},
            ValidationException,
            "requires an EKS-orchestrated cluster",
        ),
        (
            {
                "instance_groups": [group_spec("a")],
                "orchestrator": EKS,
                "tiered_storage": TieredStorage(mode="Enable", instance_memory_allocation_percentage=10),
            },
            ValidationException,
            "InstanceMemoryAllocationPercentage 10 is out of range",
        ),
    ],
)
def test_create_cluster_rules(
    service: ClusterService, db: Database, arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        service.create_cluster(name="bad", **arguments)
    with db.read() as session:
        assert session.scalars(select(Cluster)).all() == []  # nothing was written


def test_create_cluster_name_in_use_and_cluster_limit(service: ClusterService) -> None:
    service.create_cluster(name="one", instance_groups=[group_spec("a", 1)])
    with pytest.raises(ResourceInUse, match=r"Cluster with name 'one' already exists\."):
        service.create_cluster(name="one", instance_groups=[group_spec("a", 1)])
    service.create_cluster(name="two", instance_groups=[group_spec("a", 1)])
    service.create_cluster(name="three", instance_groups=[group_spec("a", 1)])
    with pytest.raises(ResourceLimitExceeded, match="already has 3 clusters, the limit is 3"):
        service.create_cluster(name="four", instance_groups=[group_spec("a", 1)])


def test_update_and_delete_conflict_until_in_service(service: ClusterService) -> None:
    service.create_cluster(name="one", instance_groups=[group_spec("a", 1)])
    with pytest.raises(ConflictException, match="is Creating; UpdateCluster is accepted only"):
        service.update_cluster(name="one", instance_groups=[group_spec("a", 2)])
    with pytest.raises(ConflictException, match="is Creating; DeleteCluster is accepted only"):
        service.delete_cluster(name="one")
    with pytest.raises(ResourceNotFound, match=r"Cluster 'nope' does not exist\."):
        service.update_cluster(name="nope", instance_groups=[group_spec("a", 2)])


def test_update_cluster_starts_a_rollout(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    service.create_cluster(name="one", instance_groups=[group_spec("a", 1), group_spec("b", 1)])
    in_service(db, clock, ids)
    assert load(db, "one").status == "InService"
    service.update_cluster(
        name="one", instance_groups=[group_spec("a", 3), group_spec("c", 1)], instance_groups_to_delete=["b"]
    )
    cluster = load(db, "one")
    assert (cluster.status, cluster.generation) == ("Updating", 2)
    assert {g.name: (g.status, g.target_count) for g in cluster.instance_groups} == {
        "a": ("Updating", 3),
        "b": ("Deleting", 1),
        "c": ("Creating", 1),
    }
    assert "Cluster update started; policy generation 2." in descriptions(db, "one")
    # The reconciler finishes it: b's node goes, a grows, c is made; all InService again.
    in_service(db, clock, ids)
    cluster = load(db, "one")
    assert cluster.status == "InService"
    assert {g.name: g.status for g in cluster.instance_groups} == {"a": "InService", "c": "InService"}
    assert sorted(n.group_name for n in cluster.nodes) == ["a", "a", "a", "c"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"instance_groups_to_delete": ["z"]},
            "InstanceGroupsToDelete names 'z', which is not an instance group",
        ),
        (
            {"instance_groups": [group_spec("a", 2)], "instance_groups_to_delete": ["a"]},
            "Instance group 'a' is both updated and deleted in one request.",
        ),
        (
            {"instance_groups": [group_spec("a", 1, "ml.g5.2xlarge")]},
            "the instance type of an existing group",
        ),
        ({"instance_groups": [group_spec("a", 20)]}, "over the account limit of 16"),
    ],
)
def test_update_cluster_rules(
    service: ClusterService,
    db: Database,
    clock: ManualClock,
    ids: CountingIds,
    arguments: dict[str, Any],
    message: str,
) -> None:
    service.create_cluster(name="one", instance_groups=[group_spec("a", 1)])
    in_service(db, clock, ids)
    with pytest.raises((ValidationException, ResourceLimitExceeded), match=message):
        service.update_cluster(name="one", **arguments)
    cluster = load(db, "one")
    assert (cluster.status, cluster.generation) == ("InService", 1)  # rolled back


def test_delete_cluster_moves_it_and_its_groups_to_deleting(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    service.create_cluster(name="one", instance_groups=[group_spec("a", 2)])
    in_service(db, clock, ids)
    service.delete_cluster(name="one")
    cluster = load(db, "one")
    assert cluster.status == "Deleting"
    assert [g.status for g in cluster.instance_groups] == ["Deleting"]
    assert "Cluster deletion started." in descriptions(db, "one")
    with pytest.raises(ConflictException, match="is Deleting"):
        service.delete_cluster(name="one")
    in_service(db, clock, ids)  # the reconciler removes it
    with db.read() as session:
        assert session.scalars(select(Cluster)).all() == []


def test_batch_delete_cluster_nodes_shuts_them_down_and_bumps_the_generation(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    service.create_cluster(name="one", instance_groups=[group_spec("a", 3)])
    in_service(db, clock, ids)
    victim = load(db, "one").nodes[0]
    by_id, _ = service.batch_delete_cluster_nodes(name="one", node_ids=[victim.id, "i-missing"])
    assert by_id.successful == [victim.id]
    assert by_id.failed == [("i-missing", "NodeIdNotFound", "Node i-missing is not part of cluster 'one'.")]
    cluster = load(db, "one")
    assert cluster.generation == 2
    assert cluster.instance_groups[0].target_count == 2
    assert {n.id: n.status for n in cluster.nodes}[victim.id] == "ShuttingDown"
    assert f"Node {victim.id} deleted by BatchDeleteClusterNodes." in descriptions(db, "one")
    again, _ = service.batch_delete_cluster_nodes(name="one", node_ids=[victim.id])
    assert again.failed == [(victim.id, "InvalidNodeStatus", f"Node {victim.id} is already shutting down.")]


def test_transitions_are_declared() -> None:
    assert check_transition("InService", ClusterStatus.UPDATING) is ClusterStatus.UPDATING
    assert check_transition("Running", NodeStatus.RUNNING) is NodeStatus.RUNNING  # staying is no move
    with pytest.raises(InternalFailure, match="illegal cluster transition Creating -> Deleting"):
        check_transition("Creating", ClusterStatus.DELETING)
    with pytest.raises(InternalFailure, match="illegal node transition ShuttingDown -> Running"):
        check_transition("ShuttingDown", NodeStatus.RUNNING)
    with pytest.raises(InternalFailure, match="illegal instance group transition Deleting -> InService"):
        check_transition("Deleting", GroupStatus.IN_SERVICE)


def test_move_checks_and_records_and_bump_generation(
    service: ClusterService, db: Database, clock: ManualClock, ids: CountingIds
) -> None:
    service.create_cluster(name="one", instance_groups=[group_spec("a", 1)])
    in_service(db, clock, ids)
    with db.write() as session:
        cluster = session.scalars(select(Cluster).where(Cluster.name == "one")).one()
        node = cluster.nodes[0]
        events.move(
            session,
            node,
            NodeStatus.SHUTTING_DOWN,
            ids=ids,
            now=clock.now(),
            cluster=cluster,
            description="Gone.",
        )
        with pytest.raises(InternalFailure):
            events.move(session, node, NodeStatus.RUNNING, ids=ids, now=clock.now())
        assert bump_generation(cluster) == 2
    assert "Gone." in descriptions(db, "one")
    assert load(db, "one").generation == 2
