"""Clocks the tests of the memory tier drive by hand."""

from __future__ import annotations

import asyncio

from hyperpod_sim.agents.clock import Clock


class StepClock:
    """A clock that moves one second each time it is read: each commit gets a later time."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class ManualClock:
    """Monotonic time that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)

    def clock(self) -> Clock:
        return Clock(wall=self.monotonic, monotonic=self.monotonic, sleep=self.sleep)
