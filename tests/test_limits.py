"""Account limits: ResourceLimitExceeded, with nothing half-written."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import ControlPlane, group, status_of
from tests.test_semantics import error_of, in_service


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"limits": {"max_instances_per_cluster": 8, "max_clusters": 3}}


def test_instance_limit(control_plane: ControlPlane, sm: Any) -> None:
    assert error_of(sm.create_cluster, ClusterName="big", InstanceGroups=[group("a", 5), group("b", 4)]) == (
        "ResourceLimitExceeded",
        "The cluster would have 9 instances, over the account limit of 8 instances per cluster.",
    )
    in_service(control_plane, sm, "c", group("a", 5))
    assert error_of(sm.update_cluster, ClusterName="c", InstanceGroups=[group("b", 4)]) == (
        "ResourceLimitExceeded",
        "The cluster would have 9 instances, over the account limit of 8 instances per cluster.",
    )
    assert status_of(sm, "c") == "InService"


def test_cluster_limit(sm: Any) -> None:
    for name in ("a", "b", "c"):
        sm.create_cluster(ClusterName=name, InstanceGroups=[group("g", 1)])
    assert error_of(sm.create_cluster, ClusterName="d", InstanceGroups=[group("g", 1)]) == (
        "ResourceLimitExceeded",
        "The account already has 3 clusters, the limit is 3.",
    )
