"""What every domain service is built on: the database, the injected clock and ids, and the
callback that tells the reconciler something changed (a no-op by default).

A service is a keyword-only dataclass over these; one that needs more (a region, a limit, a
config) adds them as fields of its own::

    @dataclass(kw_only=True, eq=False)
    class AddNodesService(DomainService):
        region: str
        max_instances: int

The app builds each service once (hyperpod_sim/api/app.py: ``build_services``) and every request
shares it: a service holds no state of its own beyond these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hyperpod_sim.domain.clock import Clock, Ids
from hyperpod_sim.models import Database


def _nothing() -> None:
    return None


@dataclass(kw_only=True, eq=False)
class DomainService:
    db: Database
    clock: Clock
    ids: Ids
    on_change: Callable[[], None] = field(default=_nothing, repr=False)
