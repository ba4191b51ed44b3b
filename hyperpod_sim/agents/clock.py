"""The agent's clocks, injected so that tests can drive time (the store takes ``wall`` the same way).

``wall`` dates what is reported or recorded (a shard's commit, a marker's ``committed_at``, the
replication and S3 lag); ``monotonic`` measures timeouts and deadlines; ``sleep`` waits between
retries and sweeps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Clock:
    wall: Callable[[], float] = time.time
    monotonic: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep


SYSTEM_CLOCK = Clock()
