"""Clocks. The engine passes a wall clock, tests and the simulator a fake one; the scheduler
cannot tell them apart."""

from __future__ import annotations

import time


class WallClock:
    def __call__(self) -> float:
        return time.monotonic()


class FakeClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
