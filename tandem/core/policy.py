"""Scheduling policies: the order of the waiting queue and the choice of preemption victim.

Each is a small object the scheduler calls; a new policy is a new class here, not a branch
inside `Scheduler.schedule()`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Protocol

from tandem.core.request import Request


class WaitingQueue(Protocol):
    def push(self, request: Request) -> None: ...
    def push_front(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """First come, first served; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._q.append(request)

    def push_front(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PreemptionPolicy(Protocol):
    def pick_victim(self, candidates: list[Request]) -> Request:
        """candidates: running requests not yet scheduled this step, the asking one included."""
        ...


class PreemptNewest:
    """Least important first (largest priority value), then the latest arrival, as vLLM."""

    def pick_victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=lambda r: (r.priority, r.arrival_time))
