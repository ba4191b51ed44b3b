"""ClientToken idempotency, one mechanism for every operation that takes a token
(BatchAddClusterNodes, CreateClusterExtension; MoveClusterNodes's model says the same).

The model's rule, as those operations document it: a token is valid for 8 hours; a retry with
the same token and the same parameters within them answers what the first request answered and
does nothing again; the same token with other parameters fails. A token is scoped to its cluster
and operation and kept in the ``client_tokens`` table, so a retry after a restart of the control
plane is answered the same; past its validity it is forgotten and the request runs anew.

Call order, in the request's write transaction (with the cluster row locked, so two retries in
flight serialize): :func:`earlier` first (its result, or None: go on), then, once the request's
work is done, :func:`remember` with what it answered. An answer that no longer stands (what
it made is gone) is dropped with :func:`forget`.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from hyperpod_sim.domain.errors import AwsError
from hyperpod_sim.models import ClientToken, Cluster

VALIDITY = timedelta(hours=8)


def earlier(
    session: Session,
    *,
    cluster: Cluster,
    operation: str,
    token: str | None,
    parameters: dict[str, Any],
    now: datetime,
    mismatch: type[AwsError],
) -> ClientToken | None:
    """The record of the request with ``token`` (what it answered: ``.result``), or None: no
    token, or none used within its validity (an expired one is forgotten here). ``parameters``: those of
    this request that a retry must repeat, JSON values; others raise ``mismatch`` (the error the
    operation's model lists for it)."""
    if token is None:
        return None
    row = session.scalars(
        select(ClientToken).where(
            ClientToken.cluster_id == cluster.id,
            ClientToken.operation == operation,
            ClientToken.token == token,
        )
    ).one_or_none()
    if row is None:
        return None
    if now - row.creation_time >= VALIDITY:
        forget(session, row)
        return None
    if row.parameters != parameters:
        raise mismatch(f"ClientToken '{token}' was used with different parameters.")
    return row


def remember(
    session: Session,
    *,
    cluster: Cluster,
    operation: str,
    token: str | None,
    parameters: dict[str, Any],
    result: dict[str, Any],
    now: datetime,
) -> None:
    """Keep what the request with ``token`` asked and answered (nothing without a token), and
    drop every token past its validity (boto3 sends one with every call: the table stays the
    size of 8 hours' requests)."""
    session.execute(delete(ClientToken).where(ClientToken.creation_time <= now - VALIDITY))
    if token is not None:
        session.add(
            ClientToken(
                cluster_id=cluster.id,
                operation=operation,
                token=token,
                parameters=parameters,
                result=result,
                creation_time=now,
            )
        )


def forget(session: Session, row: ClientToken) -> None:
    """Drop a token whose answer no longer stands (expired, or what it made is gone), flushed
    at once so that the request may keep the same token again."""
    session.delete(row)
    session.flush()
