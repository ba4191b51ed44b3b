"""What the services of the resources kept beside clusters share (cluster scheduler configs,
cluster extensions): the database, the clock and ids, the account and region their ARNs name,
and the CreationTime window their listings filter on."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnElement
from sqlalchemy.orm import InstrumentedAttribute

from hyperpod_sim.domain.clock import Clock, Ids
from hyperpod_sim.models import Database


class AccountResourceService:
    """Base of a service of resources with ARNs of their own. Keyword-only arguments; raise
    AwsError subclasses; no HTTP."""

    def __init__(self, *, db: Database, clock: Clock, ids: Ids, region: str, account_id: str) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.region = region
        self.account_id = account_id

    def arn(self, resource: str) -> str:
        """The ARN of ``resource`` (``cluster-scheduler-config/<id>``, ...) in this account and region."""
        return f"arn:aws:sagemaker:{self.region}:{self.account_id}:{resource}"


def created_between(
    column: InstrumentedAttribute[datetime], after: datetime | None, before: datetime | None
) -> list[ColumnElement[bool]]:
    """The conditions of a listing's CreationTime window: created strictly after ``after`` and
    before ``before`` (None: unbounded), for ``query.where(*...)``."""
    conditions = []
    if after is not None:
        conditions.append(column > after)
    if before is not None:
        conditions.append(column < before)
    return conditions
