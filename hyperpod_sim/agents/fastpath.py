"""The same-host fast path's bookkeeping: open writes (a reservation a trainer on this host maps
and writes into, until it commits) and read leases (a shard file a trainer maps, kept from reuse
until it releases it). Either one not ended within ``timeout_s`` is given back: its trainer died.
At most ``max_entries`` of each are held at once (issue 23: 40,000 locates without a release grew
an agent by 27 MB until their leases expired); past that a caller is refused until some end.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hyperpod_sim.agents.clock import Clock
from hyperpod_sim.agents.store import Reservation
from hyperpod_sim.agents.tiermodel import Namespace, TierError
from hyperpod_sim.contracts.limits import DEFAULT_MAX_FAST_LEASES

log = logging.getLogger("hyperpod_sim.agents.tier")

SWEEP_S = 1.0  # how often expired writes and leases are looked for, while there are any


@dataclass(frozen=True)
class FastWrite:
    reservation: Reservation
    namespace: Namespace
    deadline: float  # the clock's monotonic time

    def give_back(self) -> None:
        """Abort the write; a write reserved ahead leaves its file as the rank's spare (a file of
        its rotation: retention + 1, and the one ahead)."""
        if self.reservation.ahead:
            self.reservation.abort(keep_as_spare=self.namespace.steps_retained + 1)
        else:
            self.reservation.abort()


class FastPath:
    def __init__(
        self,
        *,
        clock: Clock,
        timeout_s: float,
        spawn: Callable[[Awaitable[None]], None],
        max_entries: int = DEFAULT_MAX_FAST_LEASES,
    ) -> None:
        self._clock = clock
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self._spawn = spawn
        self._writes: dict[str, FastWrite] = {}  # token -> an open same-host write
        self._leases: dict[str, tuple[Callable[[], None], float]] = {}  # lease -> (unpin, deadline)

    def check_room(self, *, leases: bool) -> None:
        """TierError 429 ``ResourceLimitExceeded`` when this agent holds ``max_entries`` leases
        (``leases``) or open writes already: nothing is reserved or pinned for the call."""
        held, what, ends = (
            (len(self._leases), "read leases", "released (POST /v1/fast/release/{lease})")
            if leases
            else (len(self._writes), "open fast-path writes", "committed or aborted")
        )
        if held >= self.max_entries:
            raise TierError(
                429,
                "ResourceLimitExceeded",
                f"this agent holds {held} {what}, its limit is {self.max_entries}: retry once some are "
                f"{ends} or have expired (after {self.timeout_s:g} s)",
                limit=self.max_entries,
            )

    def open_write(self, reservation: Reservation, namespace: Namespace) -> str:
        """A token for a new write; it is aborted if not taken back within ``timeout_s``."""
        token = uuid.uuid4().hex
        self._writes[token] = FastWrite(reservation, namespace, self._clock.monotonic() + self.timeout_s)
        self._start_sweeping()
        return token

    def take_write(self, token: str) -> FastWrite | None:
        """The open write of ``token``, no longer open (None if there is none: expired?)."""
        return self._writes.pop(token, None)

    def lease(self, unpin: Callable[[], None]) -> str:
        """A lease on a pinned file: ``unpin`` is called at its release or after ``timeout_s``."""
        lease = uuid.uuid4().hex
        self._leases[lease] = (unpin, self._clock.monotonic() + self.timeout_s)
        self._start_sweeping()
        return lease

    def release(self, lease: str) -> bool:
        held = self._leases.pop(lease, None)
        if held is not None:
            held[0]()
        return held is not None

    def _start_sweeping(self) -> None:
        if len(self._writes) + len(self._leases) == 1:
            self._spawn(self._expire())

    async def _expire(self) -> None:
        """Give back reservations never committed and leases never released (their trainer died)."""
        while self._writes or self._leases:
            await self._clock.sleep(SWEEP_S)
            now = self._clock.monotonic()
            for lease, (unpin, deadline) in list(self._leases.items()):
                if deadline < now:
                    del self._leases[lease]
                    unpin()
            for token, write in list(self._writes.items()):
                if write.deadline < now:
                    del self._writes[token]
                    write.give_back()
                    log.warning("a fast-path write of %s was never committed", write.reservation.key)
