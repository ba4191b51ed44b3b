"""Account limits: ResourceLimitExceeded, with nothing half-written."""

from __future__ import annotations

from typing import Any

import pytest

from hyperpod_sim.contracts import limits
from hyperpod_sim.settings import LimitSettings
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


def test_the_namespace_limits_default_to_the_contracts() -> None:
    """settings cannot import contracts (one layer): the defaults are written twice, held equal."""
    fields = LimitSettings.model_fields
    assert fields["max_namespaces_per_cluster"].default == limits.DEFAULT_MAX_NAMESPACES_PER_CLUSTER
    assert fields["max_namespace_ranks"].default == limits.DEFAULT_MAX_NAMESPACE_RANKS
    assert LimitSettings(max_namespace_ranks=limits.MAX_RANKS).max_namespace_ranks == limits.MAX_RANKS
    with pytest.raises(ValueError, match="less than or equal to 1000000"):
        LimitSettings(max_namespace_ranks=limits.MAX_RANKS + 1)
