"""Account limits: ResourceLimitExceeded, with nothing half-written."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx
import pytest
from sqlalchemy import select

from hyperpod_sim.contracts import limits
from hyperpod_sim.models import Node
from hyperpod_sim.settings import LimitSettings
from tests.clusters import error_of, in_service
from tests.conftest import ControlPlane, group, node_token, status_of


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {
        "limits": {
            "max_instances_per_cluster": 8,
            "max_clusters": 3,
            "max_namespaces_per_cluster": 3,
            "max_namespace_ranks": 100,
        }
    }


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


def test_namespace_limits_at_the_control_plane(control_plane: ControlPlane, sm: Any) -> None:
    """The agents' namespace route, as an agent calls it (its node token), on either database."""
    in_service(control_plane, sm, "ns", group("g", 1))
    with control_plane.services.db.read() as session:
        node_id = session.scalars(select(Node.id)).one()
    headers = {"Authorization": f"Bearer {node_token(control_plane, node_id)}"}

    def create(name: str, num_ranks: int = 2) -> httpx.Response:
        return httpx.post(
            f"{control_plane.url}/agent/v1/clusters/ns/namespaces/{quote(name, safe='')}",
            json={"num_ranks": num_ranks, "steps_retained": 3},
            headers=headers,
        )

    assert [create(f"job{n}").status_code for n in range(3)] == [201, 201, 201]
    assert create("job3").json() == {
        "error": "ResourceLimitExceeded",
        "message": "The cluster 'ns' already has 3 checkpoint namespaces, the limit is 3. "
        "Delete a namespace it no longer needs.",
    }
    assert create("job0").status_code == 409
    url = f"{control_plane.url}/agent/v1/clusters/ns/namespaces"
    assert httpx.delete(f"{url}/job0", headers=headers).status_code == 200
    assert create("job3", num_ranks=100).status_code == 201
    assert httpx.delete(f"{url}/job1", headers=headers).status_code == 200
    too_many = create("wide", num_ranks=101)
    assert (too_many.status_code, too_many.json()["error"]) == (400, "ValidationException")
    assert too_many.json()["message"].endswith("Member must have value less than or equal to 100")
    nul = create("bad\x00name")
    assert (nul.status_code, nul.json()["error"]) == (400, "InvalidNamespace")
    assert "control character U+0000" in nul.json()["message"]
    names = [n["namespace"] for n in httpx.get(url, headers=headers).json()["namespaces"]]
    assert names == ["job2", "job3"]
