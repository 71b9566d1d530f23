"""The proposer interface: after each step, guess the tokens that follow each sampling row's
new ones. The scheduler decides how many of the guesses the next step verifies (its token
budget, the request's max_tokens); the runner verifies them. A proposer only guesses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tandem.core.request import Request


@dataclass(frozen=True)
class ProposeRow:
    request: Request  # its all_token_ids do not yet hold new_token_ids
    new_token_ids: list[int]  # this step's tokens: accepted drafts, then one more
    num_drafted: int  # drafts this step verified (so len(new_token_ids) - 1 were accepted)

    @property
    def num_accepted(self) -> int:
        return len(self.new_token_ids) - 1


class Proposer(Protocol):
    def propose(self, rows: list[ProposeRow]) -> dict[str, list[int]]:
        """Request id -> the tokens guessed to follow its new ones (absent or empty: none)."""
        ...

    def forget(self, request_ids: list[str]) -> None:
        """The requests ended: drop what is kept for them."""
        ...


class Backoff:
    """How many tokens to draft for one request, adapted to how its drafts fare: twice as
    many after a fully accepted draft (up to k), what was accepted plus one after a partial
    one, half after a miss, and after three misses in a row a pause that doubles with each
    further miss (up to `max_pause` steps), so a workload where guesses keep failing costs
    almost nothing. A verified draft token costs a few percent of a step where a model's
    weights dominate, an accepted one saves a whole step: drafting stays eager."""

    def __init__(self, k: int, max_pause: int = 16) -> None:
        self.max_k, self.k, self.max_pause = k, k, max_pause
        self.misses, self.pause = 0, 0

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        if num_accepted == num_drafted:
            self.k, self.misses = min(self.max_k, 2 * self.k), 0
        elif num_accepted > 0:
            self.k, self.misses = num_accepted + 1, 0
        else:
            self.k, self.misses = max(1, self.k // 2), self.misses + 1
            if self.misses >= 3:
                self.pause = min(self.max_pause, 2 ** (self.misses - 2))

    def allowed(self) -> int:
        """Tokens to draft this step (0 while paused)."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.k
