"""Integers as they appear on an agent's wire: in paths (ranks, steps), query parameters (sizes,
limits, rank counts) and ``Content-Length``.

Each one has exactly one spelling: ASCII digits, no sign, no ``_``, no whitespace, no leading zero
(except ``0`` itself), at most :data:`INT64_MAX`. So ``+1``, `` 1``, ``1_000``, ``٣`` and ``007``
are refused instead of naming shard 1, 1000, 3 or 7 under another spelling, and a 5,000-digit
number is refused before Python is asked to convert it.
"""

from __future__ import annotations

INT64_MAX = 2**63 - 1
_MAX_DIGITS = len(str(INT64_MAX))  # 19
ECHO_CHARS = 40  # how much of a refused value a message repeats


def echo(text: str) -> str:
    """``text`` for an error message: quoted, and cut with an ellipsis when it is long."""
    return repr(text) if len(text) <= ECHO_CHARS else f"{text[:ECHO_CHARS]!r}..."


def canonical_int(text: str, *, what: str, maximum: int = INT64_MAX) -> int:
    """The value of a canonical non-negative decimal; ValueError (naming ``what``) otherwise."""
    if not text or len(text) > _MAX_DIGITS or not (text.isascii() and text.isdigit()):
        raise ValueError(
            f"{what} must be a decimal integer of ASCII digits from 0 to {maximum}, got {echo(text)}"
        )
    if len(text) > 1 and text[0] == "0":
        raise ValueError(f"{what} must be written without leading zeros, got {echo(text)}")
    value = int(text)
    if value > maximum:
        raise ValueError(f"{what} must be at most {maximum}, got {echo(text)}")
    return value
