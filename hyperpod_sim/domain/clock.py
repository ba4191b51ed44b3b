"""Injectable time and identifiers, so tests control transitions instead of sleeping."""

from __future__ import annotations

import secrets
import string
import uuid
from datetime import UTC, datetime
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime: ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)


class Ids:
    """AWS-format identifiers. Subclass or replace in tests for determinism."""

    _alnum = string.ascii_lowercase + string.digits

    def cluster_id(self) -> str:
        """12 lowercase alphanumerics, as in a HyperPod cluster ARN."""
        return "".join(secrets.choice(self._alnum) for _ in range(12))

    def node_id(self) -> str:
        """``i-`` and 17 hex digits, as an EC2 instance id."""
        return "i-" + secrets.token_hex(9)[:17]

    def token(self) -> str:
        """A cluster secret for the agent protocol."""
        return secrets.token_hex(32)

    def event_id(self) -> str:
        return str(uuid.uuid4())

    def fault_id(self) -> str:
        """``f-`` and 16 hex digits: an injected fault (hyperpod_sim/domain/faults.py)."""
        return "f-" + secrets.token_hex(8)

    def private_ip(self) -> str:
        return f"10.{secrets.randbelow(256)}.{secrets.randbelow(256)}.{1 + secrets.randbelow(254)}"
