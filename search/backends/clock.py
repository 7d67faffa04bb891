"""Time, behind one small protocol, so the scheduler runs the same code on the box and in `--simulate`.

Every deadline, allotment, heartbeat and poll in `search` reads `clock.now()` and waits with `clock.sleep()`.
`WallClock` is the real time; `VirtualClock` advances only when someone sleeps on it, so a 7.5-hour study against
`SimulatedBackend` runs in seconds and its timeline is deterministic.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the Unix epoch (or a virtual origin)."""

    def sleep(self, seconds: float) -> None:
        """Wait `seconds`; a virtual clock jumps instead."""


class WallClock:
    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class VirtualClock:
    """Simulated time: `sleep` moves `now` forward at once; nothing else does."""

    def __init__(self, start: float = 0.0):
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._now += seconds
