"""The node operations' values (hyperpod_sim/models/software_update.py) store the JSON their columns
held before the values existed: rows written then load, and rows written now read the same."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, Integer, create_engine, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from hyperpod_sim.models.software_update import (
    CapacitySize,
    DeploymentConfig,
    GroupRelease,
    HealthCheckConfiguration,
    OperationDetails,
    ScalingCounts,
    ScalingDetail,
    SoftwareUpdate,
)
from hyperpod_sim.models.values import ValueJSON


class _Base(DeclarativeBase):
    pass


class _Row(_Base):
    __tablename__ = "rows"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    update: Mapped[SoftwareUpdate | None] = mapped_column(ValueJSON(SoftwareUpdate))
    details: Mapped[OperationDetails | None] = mapped_column(ValueJSON(OperationDetails))


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    engine = create_engine(f"sqlite:///{tmp_path / 'v.db'}")
    _Base.metadata.create_all(engine)
    return engine


def _stored(
    engine: Engine, update: SoftwareUpdate | None = None, details: OperationDetails | None = None
) -> tuple[Any, Any]:
    """The JSON text the columns hold for the values (once read back as the same values)."""
    with Session(engine) as session:
        row = _Row(update=update, details=details)
        session.add(row)
        session.commit()
        row_id = row.id
    with Session(engine) as session:
        loaded = session.get(_Row, row_id)
        assert loaded is not None
        assert (loaded.update, loaded.details) == (update, details)
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT [update], details FROM rows WHERE id = :id"), {"id": row_id}).one()
    return stored[0], stored[1]


# A rollout as UpdateClusterSoftware stored it (no RollingUpdatePolicy: MaximumBatchSize null), once
# its first batch started (DoneAt null), and once that batch was done.
CREATED = {
    "Versions": {"workers": "1.1.0"},
    "Batches": [["i-1"], ["i-2"]],
    "Batch": -1,
    "WaitIntervalInSeconds": 0,
    "NextBatchAt": 1700000000.25,
    "MaximumBatchSize": None,
    "BatchSize": 1,
    "Alarms": [],
}
STARTED = {**CREATED, "Batch": 0, "DoneAt": None}
DONE = {**STARTED, "DoneAt": 1700000030.5, "NextBatchAt": 1700000090.5}


def test_a_rollout_is_stored_as_before_at_each_step(engine: Engine) -> None:
    created = SoftwareUpdate(
        versions={"workers": "1.1.0"},
        batches=[["i-1"], ["i-2"]],
        batch=-1,
        wait_interval_in_seconds=0,
        next_batch_at=1700000000.25,
        maximum_batch_size=None,
        batch_size=1,
        alarms=[],
    )
    started = created.model_copy(update={"batch": 0, "done_at": None})
    done = started.model_copy(update={"done_at": 1700000030.5, "next_batch_at": 1700000090.5})
    for value, before in ((created, CREATED), (started, STARTED), (done, DONE)):
        assert SoftwareUpdate.from_wire(before) == value
        stored, _ = _stored(engine, update=value)
        assert stored == json.dumps(before)


def test_an_older_rollout_without_batch_size_and_alarms_keeps_its_shape(engine: Engine) -> None:
    older = {k: v for k, v in CREATED.items() if k not in ("BatchSize", "Alarms")}
    older["MaximumBatchSize"] = {"Type": "CAPACITY_PERCENTAGE", "Value": 50}
    value = SoftwareUpdate.from_wire(older)
    assert (value.batch_size, value.alarms, value.maximum_batch_size) == (
        None,
        None,
        CapacitySize(type="CAPACITY_PERCENTAGE", value=50),
    )
    stored, _ = _stored(engine, update=value)
    assert stored == json.dumps(older)


def test_operation_details_are_stored_as_before(engine: Engine) -> None:
    assert _stored(engine, details=OperationDetails())[1] == "{}"
    scaling = ScalingDetail(
        instance_group_name="workers",
        status="InProgress",
        original=ScalingCounts(target_count=2, current_count=1, min_count=1),
        desired=ScalingCounts(target_count=4),
    )
    checks = HealthCheckConfiguration(
        instance_group_name="workers", instance_ids=[], deep_health_checks=["InstanceStress"]
    )
    details = OperationDetails(
        scaling_details=[scaling], deep_health_check_details=[checks], move={"Request": {"InstanceCount": 1}}
    )
    _, stored = _stored(engine, details=details)
    assert stored == json.dumps(
        {
            "ScalingDetails": [
                {
                    "InstanceGroupName": "workers",
                    "Status": "InProgress",
                    "Original": {"TargetCount": 2, "CurrentCount": 1, "MinCount": 1},
                    "Desired": {"TargetCount": 4},
                }
            ],
            "DeepHealthCheckDetails": [
                {"InstanceGroupName": "workers", "InstanceIds": [], "DeepHealthChecks": ["InstanceStress"]}
            ],
            "Move": {"Request": {"InstanceCount": 1}},
        }
    )


def test_the_requests_read_back_as_they_were_sent() -> None:
    config = {
        "RollingUpdatePolicy": {"MaximumBatchSize": {"Type": "INSTANCE_COUNT", "Value": 2}},
        "WaitIntervalInSeconds": 60,
        "AutoRollbackConfiguration": [{"AlarmName": "a"}],
    }
    value = DeploymentConfig.from_wire(config)
    assert value.rolling_update_policy is not None
    assert value.rolling_update_policy.maximum_batch_size == CapacitySize(type="INSTANCE_COUNT", value=2)
    assert value.wire() == config
    assert GroupRelease.from_wire({"InstanceGroupName": "workers"}).image_release_version is None
    sent = {"InstanceGroupName": "workers", "DeepHealthChecks": ["Connectivity"]}
    assert HealthCheckConfiguration.from_wire(sent).wire() == sent
