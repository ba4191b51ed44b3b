"""The agents' one retry mechanism: capped exponential backoff, with jitter unless asked otherwise.

The agent loop retries the control plane with it, the memory tier its replicas, the S3 tier its
persists; each caller decides what is temporary (retry after ``next_delay()``) and what is permanent.
"""

from __future__ import annotations

import random


class Backoff:
    """Capped exponential backoff with jitter (each delay drawn in [delay/2, delay]), so that many
    agents retrying against a restarted control plane spread out."""

    def __init__(
        self, *, initial_s: float, max_s: float, rng: random.Random | None = None, jitter: bool = True
    ) -> None:
        """``jitter=False``: the delays exactly (initial, doubled each time, up to max)."""
        self._initial_s = initial_s
        self._jitter = jitter
        self._max_s = max_s
        self._rng = rng or random.Random()
        self._next_s = initial_s

    def reset(self) -> None:
        self._next_s = self._initial_s

    def next_delay(self) -> float:
        delay = self._next_s
        self._next_s = min(self._next_s * 2, self._max_s)
        return delay * (0.5 + 0.5 * self._rng.random()) if self._jitter else delay
