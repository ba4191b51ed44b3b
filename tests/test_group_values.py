"""The cluster's typed values (models/groups.py) store and answer what their dicts did before."""

from __future__ import annotations

from pydantic import TypeAdapter

from hyperpod_sim.models.groups import CheckpointPolicy, InstanceGroupSpec, SchedulerVersion


def stored(value: object) -> object:
    """What a ValueJSON column writes for ``value`` (models/values.py)."""
    return TypeAdapter(type(value)).dump_python(value, mode="json", by_alias=True, exclude_none=True)


def test_a_group_spec_keeps_the_members_it_does_not_name() -> None:
    sent = {
        "InstanceGroupName": "workers",
        "InstanceCount": 2,
        "InstanceRequirements": {"InstanceTypes": ["ml.g5.2xlarge", "ml.g5.4xlarge"]},
        "ExecutionRole": "arn:aws:iam::123456789012:role/r",
        "LifeCycleConfig": {"SourceS3Uri": "s3://b/lc", "OnCreate": "on_create.sh"},
    }
    spec = InstanceGroupSpec.from_wire(sent)
    assert (spec.first_instance_type, spec.instance_types) == (
        "ml.g5.2xlarge",
        ("ml.g5.2xlarge", "ml.g5.4xlarge"),
    )
    assert stored(spec) == sent
    assert stored(spec.model_copy(update={"instance_count": 3})) == {**sent, "InstanceCount": 3}


def test_the_checkpoint_policy_names_every_member_null_where_unset() -> None:
    defaults = {
        "S3BaseUri": None,
        "PersistEverySteps": None,
        "PersistEverySeconds": None,
        "S3Retention": None,
        "InMemoryRetention": 3,
        "ReplicationFactor": 1,
        "AgentAccess": "Open",
    }
    assert stored(CheckpointPolicy()) == CheckpointPolicy().wire() == defaults
    with_layout = CheckpointPolicy(s3_base_uri="s3://b/x", persist_every_steps=10, s3_layout="Flat")
    assert with_layout.wire() == {
        **defaults,
        "S3BaseUri": "s3://b/x",
        "PersistEverySteps": 10,
        "S3Layout": "Flat",
    }
    # A request's own members (ClusterName) are not the policy's.
    assert CheckpointPolicy.from_wire({"ClusterName": "c", **defaults, "ReplicationFactor": 2}).wire() == {
        **defaults,
        "ReplicationFactor": 2,
    }


def test_a_scheduler_config_version_keeps_its_null_description() -> None:
    version = SchedulerVersion(
        version=1, scheduler_config={"FairShare": "Enabled"}, description=None, time=1.5
    )
    row = {"Version": 1, "SchedulerConfig": {"FairShare": "Enabled"}, "Description": None, "Time": 1.5}
    assert stored(version) == row
    assert SchedulerVersion.from_wire(row) == version
