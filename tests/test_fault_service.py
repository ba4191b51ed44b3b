"""FaultService and the checkpoint policy at the service layer: real SQLite, no HTTP, no processes.

The services are built as hyperpod_sim/api/app.py builds them, over a migrated database; a cluster is brought
InService by the reconciler with simulated nodes on a manual clock. Node faults go to a provisioner
that records what it was asked to do to the agents. Requests go through hyperpod_sim/api/simulator_api.py's
dispatch (the model's validation, then the service) or straight to the service with typed
arguments.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from hyperpod_sim.api import simulator_api as extensions
from hyperpod_sim.domain.checkpoints.cluster_policy import CheckpointPolicy, S3Endpoint
from hyperpod_sim.domain.clock import Ids
from hyperpod_sim.domain.clusters.service import ClusterService, DomainConfig
from hyperpod_sim.domain.errors import ConflictException, ResourceNotFound, ValidationException
from hyperpod_sim.domain.faults import FAULT_TYPES, FaultService, FaultSpec
from hyperpod_sim.domain.provisioning import SimulatedProvisioner
from hyperpod_sim.domain.reconciler import Reconciler, ReconcilerConfig
from hyperpod_sim.models import Cluster, Database, Node
from hyperpod_sim.models.groups import InstanceGroupSpec
from tests.conftest import ROLE, ManualClock, wait_for


class RecordingProvisioner(SimulatedProvisioner):
    """Simulated nodes whose agents 'exist': each signal is recorded, pid 4242 answers."""

    owns_agents = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def kill_agent(self, node: Node, *, wipe_memory: bool) -> list[int]:
        self.calls.append(("kill+wipe" if wipe_memory else "kill", node.id))
        return [4242]

    def pause_agent(self, node: Node) -> list[int]:
        self.calls.append(("pause", node.id))
        return [4242]

    def resume_agent(self, node: Node) -> list[int]:
        self.calls.append(("resume", node.id))
        return [4242]

    def partition_agent(self, node: Node, *, fault_id: str, until: float) -> list[int]:
        self.calls.append(("partition", node.id))
        return [4242]

    def heal_agent(self, node: Node) -> bool:
        self.calls.append(("heal", node.id))
        return True


@dataclass
class Plane:
    db: Database
    clock: ManualClock
    clusters: ClusterService
    faults: FaultService
    provisioner: RecordingProvisioner
    node_id: str

    def cluster(self, name: str = "svc") -> Cluster:
        with self.db.read() as session:
            cluster = session.query(Cluster).filter_by(name=name).one()
            session.expunge(cluster)
            return cluster

    def descriptions(self, name: str = "svc") -> list[str]:
        _, page = self.clusters.list_cluster_events(
            name=name,
            instance_group_name=None,
            node_id=None,
            event_time_after=None,
            event_time_before=None,
            resource_type=None,
            sort_order="Ascending",
            max_results=100,
            next_token=None,
        )
        return [event.description for event in page.items]

    def dispatch(self, operation: str, body: object = None, **located: object) -> dict[str, Any]:
        return extensions.dispatch(self, operation, body or {}, located={"ClusterName": "svc", **located})


@pytest.fixture
def plane(sqlite_url: str) -> Iterator[Plane]:
    db = Database(sqlite_url)
    db.migrate()
    clock, ids = ManualClock(), Ids()
    clusters = ClusterService(
        db=db,
        clock=clock,
        ids=ids,
        config=DomainConfig(
            account_id="123456789012", region="us-east-1", max_instances_per_cluster=8, max_clusters=4
        ),
    )
    reconciler = Reconciler(
        db=db,
        clock=clock,
        ids=ids,
        provisioner=SimulatedProvisioner(),
        config=ReconcilerConfig(
            interval_s=1,
            node_ready_delay_s=0,
            heartbeat_timeout_s=30,
            launch_timeout_s=60,
            memory_scale=1.0,
            s3_endpoint=S3Endpoint(url=None, region="us-east-1"),
            push_workers=1,
            push_timeout_s=1,
            push_backoff_s=1,
            push_backoff_max_s=1,
        ),
    )
    provisioner = RecordingProvisioner()
    faults = FaultService(db=db, clock=clock, ids=ids, provisioner=provisioner, provisioning_mode="local")
    group = InstanceGroupSpec.from_wire(
        {"InstanceGroupName": "w", "InstanceType": "ml.t3.medium", "InstanceCount": 2, "ExecutionRole": ROLE}
    )
    clusters.create_cluster(name="svc", instance_groups=[group])
    for _ in range(10):
        reconciler.run_once()
        if clusters.describe_cluster(name="svc")[0].status == "InService":
            break
        clock.advance(1)
    cluster, _ = clusters.describe_cluster(name="svc")
    assert cluster.status == "InService"
    with db.read() as session:
        node_id = session.query(Node).filter_by(cluster_id=cluster.id).first().id  # type: ignore[union-attr]
    yield Plane(db, clock, clusters, faults, provisioner, node_id)
    db.dispose()


def test_the_model_lists_the_domain_fault_types() -> None:
    shape = extensions.input_shape("InjectFault")
    assert tuple(shape.members["Type"].enum) == FAULT_TYPES


@pytest.mark.parametrize(
    ("body", "signal"),
    [
        ({"Type": "AgentCrash"}, "kill"),
        ({"Type": "NodeLoss"}, "kill+wipe"),
        ({"Type": "AgentHang", "DurationSeconds": 30}, "pause"),
        ({"Type": "NetworkPartition", "DurationSeconds": 30}, "partition"),
    ],
)
def test_node_faults(plane: Plane, body: dict[str, Any], signal: str) -> None:
    answer = plane.dispatch("InjectFault", {**body, "InstanceId": plane.node_id})
    assert plane.provisioner.calls == [(signal, plane.node_id)]
    assert answer["ClusterName"] == "svc"
    assert answer["PolicyGeneration"] == 1  # node faults leave the node policy alone
    listed = plane.dispatch("ListFaults")["Faults"]
    injected = f"Fault {answer['FaultId']} injected: {body['Type']} on node {plane.node_id}"
    assert any(text.startswith(injected) for text in plane.descriptions())
    if body["Type"] == "AgentCrash":  # over once injected
        assert listed == []
        return
    assert [f["FaultId"] for f in listed] == [answer["FaultId"]]
    if body["Type"] == "NodeLoss":
        with pytest.raises(ValidationException, match="cannot be cleared"):
            plane.dispatch("ClearFault", FaultId=answer["FaultId"])
        return
    cleared = plane.dispatch("ClearFault", FaultId=answer["FaultId"])
    assert cleared["ClearedAt"] == plane.clock.now().timestamp()
    assert plane.provisioner.calls[-1] == ("resume" if signal == "pause" else "heal", plane.node_id)
    assert plane.dispatch("ListFaults")["Faults"] == []
    assert any(text.startswith(f"Fault {answer['FaultId']} ended") for text in plane.descriptions())


@pytest.mark.parametrize(
    "body",
    [
        {"Type": "S3Latency", "LatencyMs": 200, "DurationSeconds": 60},
        {"Type": "S3Errors", "ErrorRate": 0.25},
        {"Type": "S3Outage"},
    ],
)
def test_s3_faults_move_the_policy_generation(plane: Plane, body: dict[str, Any]) -> None:
    answer = plane.dispatch("InjectFault", body)
    assert answer["PolicyGeneration"] == plane.cluster().generation == 2
    if body["Type"] == "S3Errors":
        assert answer["ErrorKind"] == "Throttle"  # the default
    assert any(text.endswith("; policy generation 2.") for text in plane.descriptions())
    with pytest.raises(ConflictException, match="one S3 fault at a time"):
        plane.faults.inject_fault(name="svc", spec=FaultSpec(type="S3Outage"))
    if "DurationSeconds" in body:  # ends by itself, on the service's clock
        plane.clock.advance(61)
        assert plane.dispatch("ListFaults")["Faults"] == []
    cleared = (
        plane.dispatch("ClearFault", FaultId=answer["FaultId"]) if "DurationSeconds" not in body else None
    )
    if cleared is not None:
        assert cleared["PolicyGeneration"] == 3
        assert any(text.endswith("cleared. Policy generation 3.") for text in plane.descriptions())
    assert plane.provisioner.calls == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"Type": "Meteor"},
            "1 validation error detected: Value 'Meteor' at 'type' failed to satisfy constraint: Member "
            "must satisfy enum value set: [AgentCrash, NodeLoss, AgentHang, NetworkPartition, S3Latency, "
            "S3Errors, S3Outage, DeepHealthCheckFailure]",
        ),
        (
            {"Type": "S3Outage", "InstanceId": "i-1", "DurationSeconds": 0},
            "2 validation errors detected: Member 'InstanceId' does not apply to Type 'S3Outage', which "
            "takes DurationSeconds; Value '0' at 'durationSeconds' failed to satisfy constraint: Member "
            "must have value greater than or equal to 1",
        ),
        (
            {"Type": "S3Latency"},
            "1 validation error detected: Value null at 'latencyMs' failed to satisfy constraint: Member "
            "must not be null",
        ),
        (
            {"Type": "S3Errors", "ErrorRate": 0},
            "1 validation error detected: Value '0.0' at 'errorRate' failed to satisfy constraint: Member "
            "must have value greater than 0",
        ),
        (
            {"Type": "S3Outage", "Colour": "red"},
            "1 validation error detected: Unknown member 'Colour' at 'input': allowed members are Type, "
            "DurationSeconds",
        ),
    ],
)
def test_validation_errors(plane: Plane, body: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationException) as refused:
        plane.dispatch("InjectFault", body)
    assert refused.value.message == message
    assert plane.cluster().generation == 1
    assert plane.dispatch("ListFaults")["Faults"] == []


def test_unknown_cluster_node_and_fault(plane: Plane) -> None:
    with pytest.raises(ResourceNotFound, match="Cluster 'nope' does not exist"):
        plane.faults.list_faults(name="nope")
    with pytest.raises(ResourceNotFound, match="Node 'i-00000000000000000' does not exist"):
        plane.faults.inject_fault(
            name="svc", spec=FaultSpec(type="AgentCrash", instance_id="i-00000000000000000")
        )
    with pytest.raises(ResourceNotFound, match="Fault 'f-0' is not in force"):
        plane.faults.clear_fault(name="svc", fault_id="f-0")


def test_a_database_outage_is_recorded_in_the_events(plane: Plane) -> None:
    fault = plane.dispatch("InjectControlPlaneFault", {"Type": "DatabaseOutage", "DurationSeconds": 5})
    assert [f.wire() for f in plane.faults.list_control_plane_faults()] == [fault]
    cleared = plane.faults.clear_control_plane_fault(fault_id=fault["FaultId"])
    assert cleared.fault_id == fault["FaultId"]
    texts = plane.descriptions()
    assert any(text.startswith(f"Fault {fault['FaultId']} injected: DatabaseOutage") for text in texts)
    assert any(text.startswith(f"Fault {fault['FaultId']} ended: DatabaseOutage") for text in texts)


def test_an_outage_over_but_not_yet_reported_is_reported_before_the_next(plane: Plane) -> None:
    """The soak once injected a DatabaseHang between a DatabaseOutage's end and the reconciler's
    next pass: the outage's end was never recorded."""
    first = plane.dispatch("InjectControlPlaneFault", {"Type": "DatabaseOutage", "DurationSeconds": 1})
    wait_for(lambda: plane.faults.list_control_plane_faults() == [], timeout=30, what="the outage over")
    second = plane.dispatch("InjectControlPlaneFault", {"Type": "DatabaseOutage", "DurationSeconds": 600})
    plane.faults.clear_control_plane_fault(fault_id=second["FaultId"])
    texts = plane.descriptions()
    ended = f"Fault {first['FaultId']} ended: DatabaseOutage (every database request fails, for 1 s); its 1 s"
    assert any(text.startswith(ended) for text in texts), texts


def test_checkpoint_policy(plane: Plane) -> None:
    got = plane.dispatch("GetCheckpointPolicy")
    assert (got["InMemoryRetention"], got["S3BaseUri"], got["PolicyGeneration"]) == (3, None, 1)
    with pytest.raises(ValidationException) as refused:
        plane.dispatch("PutCheckpointPolicy", {"S3BaseUri": "s3://bucket/x", "ReplicationFactor": 9})
    assert refused.value.message == (
        "1 validation error detected: Value '9' at 'replicationFactor' failed to satisfy constraint: "
        "Member must have value less than or equal to 3"
    )
    with pytest.raises(ValidationException, match="PersistEverySteps or PersistEverySeconds"):
        plane.clusters.put_checkpoint_policy(name="svc", policy=CheckpointPolicy(s3_base_uri="s3://bucket/x"))
    assert plane.cluster().generation == 1
    put = plane.dispatch("PutCheckpointPolicy", {"S3BaseUri": "s3://bucket/x", "PersistEverySteps": 10})
    assert (put["PersistEverySteps"], put["InMemoryRetention"], put["PolicyGeneration"]) == (10, 3, 2)
    assert plane.cluster().status == "Updating"
    assert any("Checkpoint policy changed" in text for text in plane.descriptions())


def test_a_spec_holds_what_its_type_requires(plane: Plane) -> None:
    """Callers other than the API get the model's required members checked too."""
    with pytest.raises(ValidationException) as refused:
        plane.faults.inject_fault(name="svc", spec=FaultSpec(type="AgentHang", instance_id=plane.node_id))
    assert refused.value.message == (
        "1 validation error detected: Value null at 'durationSeconds' failed to satisfy constraint: "
        "Member must not be null"
    )
    # A type or error kind outside the model's enums is refused as the API refuses it, not stored.
    with pytest.raises(ValidationException, match=r"at 'type' failed .* enum value set: \[AgentCrash, "):
        FaultSpec(type="Meteor")  # type: ignore[arg-type]
    with pytest.raises(ValidationException, match=r"at 'errorKind' failed .* \[Throttle, InternalError\]"):
        FaultSpec(type="S3Errors", error_rate=0.5, error_kind="Slow")  # type: ignore[arg-type]
    assert plane.provisioner.calls == []
