"""Scheduling policies: the order of the waiting queue, which requests a step takes in what
order and within what budget, and whom to preempt.

Each is a small object the scheduler calls; a new policy is a new class here (or beside it,
as slo_policy.py), not a branch inside `Scheduler.schedule()`.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from tandem.core.budget import StepBudget, TokenBudget
from tandem.core.request import Request

if TYPE_CHECKING:
    from tandem.core.scheduler import Scheduler


class WaitingQueue(Protocol):
    def push(self, request: Request) -> None: ...
    def push_front(self, request: Request) -> None: ...
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

    def remove(self, request: Request) -> None:
        if self._q and self._q[0] is request:
            self._q.popleft()
        else:
            self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Most urgent first (lowest priority value), then first come; a preempted request keeps
    its arrival order, so it goes before its class's later arrivals."""

    def __init__(self) -> None:
        self._items: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def push(self, request: Request) -> None:
        bisect.insort(
            self._items, (request.priority, request.arrival_time, next(self._seq), request)
        )

    push_front = push

    def remove(self, request: Request) -> None:
        for i, item in enumerate(self._items):
            if item[3] is request:
                del self._items[i]
                return
        raise ValueError("request not in the queue")

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return (item[3] for item in self._items)


class BatchPolicy(Protocol):
    """What a step takes: the candidates in order, the budget, and preemption victims."""

    admit_after_preemption: bool  # may a step that preempted still admit waiting requests?

    def new_queue(self) -> WaitingQueue: ...

    def prepare(self, sched: Scheduler) -> list[Request]:
        """Before the step: finish (and return) requests the policy sheds."""
        ...

    def budget(self, sched: Scheduler) -> StepBudget: ...

    def order(self, sched: Scheduler) -> list[Request]:
        """Running and waiting requests, in the order the step considers them."""
        ...

    def victim(self, asker: Request, unscheduled: list[Request]) -> Request | None:
        """Whom to preempt so `asker` gets blocks, among running requests not yet scheduled
        this step (a running asker is among them); None: the asker waits instead."""
        ...

    def seat_victim(self, asker: Request, unscheduled: list[Request]) -> Request | None:
        """Every batch seat (max_num_seqs) is taken: whom to preempt so the waiting `asker`
        runs now; None: it waits for a seat to free."""
        ...


class FCFSBatch:
    """vLLM's default: running requests first, in the order they started; then waiting ones
    first come, first served, while the token budget lasts. Short of blocks, the least
    important running request (largest priority value, latest arrival) is preempted, and a
    step that preempted admits nobody."""

    admit_after_preemption = False

    def new_queue(self) -> WaitingQueue:
        return FCFSQueue()

    def prepare(self, sched: Scheduler) -> list[Request]:
        return []

    def budget(self, sched: Scheduler) -> StepBudget:
        return TokenBudget(sched.config.max_num_batched_tokens)

    def order(self, sched: Scheduler) -> list[Request]:
        return [*sched.running, *sched.waiting]

    def victim(self, asker: Request, unscheduled: list[Request]) -> Request | None:
        if asker not in unscheduled:  # a waiting request does not preempt
            return None
        return max(unscheduled, key=rank)

    def seat_victim(self, asker: Request, unscheduled: list[Request]) -> Request | None:
        return None


class PriorityBatch(FCFSBatch):
    """Strict priority (lower value first, then arrival), across running and waiting alike.
    A waiting request short of blocks preempts a running one of a lower class."""

    admit_after_preemption = True

    def new_queue(self) -> WaitingQueue:
        return PriorityQueue()

    def order(self, sched: Scheduler) -> list[Request]:
        return sorted([*sched.running, *sched.waiting], key=rank)

    def victim(self, asker: Request, unscheduled: list[Request]) -> Request | None:
        if asker in unscheduled:  # the order put every unscheduled one at or below the asker
            return max(unscheduled, key=rank)
        lower = [r for r in unscheduled if r.priority > asker.priority]
        return max(lower, key=rank) if lower else None


def rank(r: Request) -> tuple:
    """Lower ranks matter more: priority value first, then arrival."""
    return (r.priority, r.arrival_time)
