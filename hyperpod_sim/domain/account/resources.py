"""What the services of the resources kept beside clusters share (cluster scheduler configs,
cluster extensions): the database, the clock and ids, the account and region their ARNs name,
and the CreationTime window their listings filter on."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement
from sqlalchemy.orm import InstrumentedAttribute

from hyperpod_sim.domain.service import DomainService


@dataclass(kw_only=True, eq=False)
class AccountResourceService(DomainService):
    """Base of a service of resources with ARNs of their own. Keyword-only arguments; raise
    AwsError subclasses; no HTTP."""

    region: str
    account_id: str

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
