"""What the handlers of the resources kept beside clusters share (api/scheduler_configs.py,
api/cluster_extensions.py): the input as the registry hands it over, and their service, made
from the cluster service's database, clock, ids, account and region."""

from __future__ import annotations

from typing import Any, TypeVar

from hyperpod_sim.domain.account_resources import AccountResourceService
from hyperpod_sim.domain.clusters import ClusterService

Params = dict[str, Any]
S = TypeVar("S", bound=AccountResourceService)


def service_of(kind: type[S], svc: ClusterService) -> S:
    """A ``kind`` service over what ``svc`` runs on."""
    return kind(
        db=svc.db, clock=svc.clock, ids=svc.ids, region=svc.config.region, account_id=svc.config.account_id
    )
