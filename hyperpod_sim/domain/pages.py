"""Pages of a list operation: ``MaxResults`` and the opaque ``NextToken`` that resumes it."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from sqlalchemy import Select
from sqlalchemy.orm import Session

from hyperpod_sim.domain.errors import ValidationException

DEFAULT_MAX_RESULTS = 100

T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    next_token: str | None


def _encode_token(offset: int, scope: str) -> str:
    raw = json.dumps({"o": offset, "s": scope}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_token(token: str | None, scope: str) -> int:
    if not token:
        return 0
    # Tokens come back from clients: anything but the exact shape we wrote is refused, however it
    # fails to decode (not base64, not JSON, nested deep, a float like 1e400, a huge integer).
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()), parse_float=_no_float)
        offset = data["o"]
        if (
            not isinstance(offset, int)
            or isinstance(offset, bool)
            or not 0 <= offset <= _MAX_OFFSET
            or data["s"] != scope
        ):
            raise ValueError
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
        raise ValidationException(
            "Invalid NextToken: pass the NextToken of the previous page of the same request."
        ) from exc
    return offset


_MAX_OFFSET = 2**31


def _no_float(text: str) -> float:
    raise ValueError(text)


def paginate(items: Sequence[T], *, max_results: int | None, token: str | None, scope: str) -> Page[T]:
    offset = _decode_token(token, scope)
    size = max_results or DEFAULT_MAX_RESULTS
    page = list(items[offset : offset + size])
    more = offset + size < len(items)
    return Page(page, _encode_token(offset + size, scope) if more else None)


def paginate_query(
    session: Session, query: Select[T], *, max_results: int | None, token: str | None, scope: str
) -> Page[T]:
    """``paginate`` with the page cut in the database (``query`` ordered, one row more than the page
    read to know whether another follows): a page of a 1,024-node listing reads its rows, not all."""
    offset = _decode_token(token, scope)
    size = max_results or DEFAULT_MAX_RESULTS
    rows = list(session.scalars(query.offset(offset).limit(size + 1)))
    more = len(rows) > size
    return Page(rows[:size], _encode_token(offset + size, scope) if more else None)
