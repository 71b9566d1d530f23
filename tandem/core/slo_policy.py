"""SLO-aware batching: each step, the most urgent work first, inside a latency budget.

In the spirit of xLLM's SLO-aware dynamic batching. Every step:
1. shed or demote (as each request's class says) waiting requests whose TTFT target can no
   longer be met, even if their prompt ran at once;
2. set the step's latency limit from the tightest TPOT among running requests, and at most
   half the tightest TTFT target in the system (`ttft_step_share`: a request arriving
   mid-step waits for the step in flight), predicted with the cost model (`TimeBudget`):
   every running decode is in (or, with `decode_wait_steps`, those whose next token can
   wait run only if they fit), and prefill chunks get what keeps the predicted step
   inside it;
3. order candidates by class (priority, raised one class per `aging_s` of waiting, so a
   lower class is never starved), decodes before prefills within a class, then by slack to
   their deadline (TTFT for a prompt, the next token's TPOT deadline for a decode);
4. short of blocks, a request preempts a running one of a lower class (PriorityBatch);
5. a prompt of a higher class that would miss its TTFT beside every running decode (its
   chunks squeezed by their rows, or no batch seat free) makes lower-class decodes yield:
   they sit out steps while their own TPOT allows, and one gives up its seat (preempted,
   recomputed later from its cached prefix) when no seat would free in time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tandem.core.budget import StepBudget, TimeBudget
from tandem.core.cost_model import StepShape
from tandem.core.policy import FCFSQueue, PriorityBatch, WaitingQueue
from tandem.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from tandem.core.scheduler import Scheduler

DEMOTED_PRIORITY = 2**31  # best effort: below every class


@dataclass(frozen=True)
class SLOPolicyConfig:
    aging_s: float = 30.0  # a waiting request rises one class per this many seconds
    min_prefill_tokens: int = 32  # prompts progress at least this much a step, however tight
    tpot_margin: float = 0.9  # the step limit is this share of the tightest TPOT (or TTFT) left
    # If set, no step runs longer than this (predicted): a request that arrives mid-step waits
    # for the step in flight. Off by default: measured, a 250 ms cap cost ~20% of throughput
    # at saturation for no attainment gain (docs/scheduling.md).
    max_step_s: float | None = None
    # While requests with a TTFT target are in the system, no step runs longer than this
    # share of the tightest such target: one that arrives mid-step still has time after it.
    ttft_step_share: float | None = 0.5
    # If set, a decode whose next token is still due later than this many step limits from
    # now may sit out the step (it runs only if it fits): a loose-TPOT batch decode yields
    # its row to a tight TPOT. Off by default: in process it raised interactive TPOT
    # attainment at saturation (4 and 1 of 9 requests to 7 and 8), but through the server it
    # lowered it in two rounds of each (docs/scheduling.md).
    decode_wait_steps: float | None = None
    # A higher-class prompt at risk of missing its TTFT makes lower-class decodes yield
    # (sit out steps, or give up a batch seat): the rule of 5. above.
    preempt_for_ttft: bool = True


class SLOBatch(PriorityBatch):
    admit_after_preemption = True

    def __init__(self, cost_model, config: SLOPolicyConfig = SLOPolicyConfig()) -> None:
        self.cost, self.config = cost_model, config
        # Set by each step's budget() for that step's order and victims (5. above): the
        # prompts at risk of missing their TTFT, and the class lower decodes yield to.
        self._at_risk: set[str] = set()
        self._rescue: int | None = None
        self._now = 0.0

    def new_queue(self) -> WaitingQueue:
        return FCFSQueue()  # order() ranks afresh each step

    # ---- 1. overload ---------------------------------------------------------
    def prepare(self, sched: Scheduler) -> list[Request]:
        now, shed = sched.clock(), []
        for req in list(sched.waiting):
            if req.num_output_tokens or not self._misses_ttft(req, now):
                continue
            if req.slo.on_overload == "shed":
                shed += sched.finish_requests([req.request_id], RequestStatus.FINISHED_SHED)
            elif req.slo.on_overload == "demote":
                req.priority = DEMOTED_PRIORITY
                req.slo = replace(req.slo, ttft_ms=None, tpot_ms=None)
        return shed

    def _misses_ttft(self, req: Request, now: float) -> bool:
        if req.slo.ttft_ms is None:
            return False
        deadline = req.arrival_time + req.slo.ttft_ms / 1000
        return now + self._prefill_seconds(req) > deadline

    def _prefill_seconds(self, req: Request) -> float:
        return (req.num_tokens - req.num_computed_tokens) * self.cost.seconds_per_prefill_token

    # ---- 2. budget -------------------------------------------------------------
    def budget(self, sched: Scheduler) -> StepBudget:
        targets = [r.slo.tpot_ms for r in sched.running if r.slo.tpot_ms is not None]
        limits = [t / 1000 * self.config.tpot_margin for t in targets]
        if self.config.max_step_s is not None:
            limits.append(self.config.max_step_s)
        share = self.config.ttft_step_share
        ttfts = [r.slo.ttft_ms for r in (*sched.running, *sched.waiting) if r.slo.ttft_ms]
        if share is not None and ttfts:
            limits.append(min(ttfts) / 1000 * share)
        limit = min(limits, default=math.inf)
        now = self._now = sched.clock()
        running = [r for r in sched.running if not r.is_prefill]
        self._find_at_risk(sched, running, limit, now)
        decodes = [r for r in running if self._due(r, limit, now) and not self._yields(r, limit)]

        def ttft_left(req: Request) -> float | None:
            if req.slo.ttft_ms is None or req.num_output_tokens:
                return None
            return (req.arrival_time + req.slo.ttft_ms / 1000 - now) * self.config.tpot_margin

        return TimeBudget(
            self.cost,
            limit,
            sched.config.max_num_batched_tokens,
            decodes,
            self.config.min_prefill_tokens,
            ttft_left,
        )

    def _due(self, req: Request, limit: float, now: float) -> bool:
        """Whether a running decode must run this step: it has no TPOT target, or waiting
        `decode_wait_steps` step limits more would bring its next token past its deadline."""
        wait = self.config.decode_wait_steps
        if wait is None or req.slo.tpot_ms is None or math.isinf(limit):
            return True
        last = req.last_token_time if req.last_token_time is not None else now
        return last + req.slo.tpot_ms / 1000 - now <= wait * limit

    # ---- 5. yield to a prompt that would miss its TTFT ---------------------------------
    def _find_at_risk(self, sched: Scheduler, decodes: list[Request], limit: float, now: float):
        """Which prompts with a TTFT target, of a class above some running decode's, would
        miss it beside every running decode; and the class lower decodes yield to."""
        self._at_risk, self._rescue = set(), None
        if not self.config.preempt_for_ttft or not decodes:
            return
        lowest = max(self._class(r, now) for r in decodes)
        shape = StepShape(0, len(decodes), sum(r.num_computed_tokens for r in decodes))
        tokens = sched.config.max_num_batched_tokens - len(decodes)
        no_seat = len(sched.running) >= sched.config.max_num_seqs
        seat_steps = min(r.max_tokens - r.num_output_tokens for r in decodes)
        for req in (*sched.running, *sched.waiting):
            cls = self._class(req, now)
            if req.slo.ttft_ms is None or req.num_output_tokens or cls >= lowest:
                continue
            first, step = self._first_token_beside(req, shape, limit, tokens, now)
            if no_seat and req.status != RequestStatus.RUNNING:
                first += seat_steps * step  # the soonest a seat surely frees
            if first > req.arrival_time + req.slo.ttft_ms / 1000:
                self._at_risk.add(req.request_id)
                self._rescue = cls if self._rescue is None else max(self._rescue, cls)

    def _first_token_beside(self, req, decodes: StepShape, limit, tokens, now) -> tuple:
        """When req's prompt completes if every step runs the `decodes` and gives the prompt
        one chunk of what the step limit leaves (at least min_prefill_tokens), and how long
        such a step takes."""
        start, left = req.num_computed_tokens, req.num_tokens - req.num_computed_tokens
        cap = max(1, min(left, tokens))

        def step(n: int) -> float:
            return self.cost.predict(decodes.with_row(req, start, n))

        chunk = cap
        if step(cap) > limit:
            lo, hi = min(cap, self.config.min_prefill_tokens), cap
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if step(mid) <= limit else (lo, mid)
            chunk = max(1, lo)
        seconds = step(chunk)
        return now + math.ceil(left / chunk) * seconds, seconds

    def _yields(self, req: Request, limit: float) -> bool:
        """A running decode of a class below an at-risk prompt's sits out the step (it runs
        only if the step has room) while its own next token can wait one more step."""
        if self._rescue is None or self._class(req, self._now) <= self._rescue:
            return False
        if req.slo.tpot_ms is None or math.isinf(limit):
            return True
        last = req.last_token_time if req.last_token_time is not None else self._now
        return last + req.slo.tpot_ms / 1000 - self._now > 2 * limit

    def seat_victim(self, asker: Request, unscheduled: list[Request]) -> Request | None:
        """No batch seat is free: an at-risk prompt takes the seat of the least urgent
        running decode of a lower class not yet scheduled this step."""
        if asker.request_id not in self._at_risk:
            return None
        cls = self._class(asker, self._now)
        lower = [r for r in unscheduled if not r.is_prefill and self._class(r, self._now) > cls]
        return max(lower, key=lambda r: self._urgency(r, self._now)) if lower else None

    def _class(self, req: Request, now: float) -> int:
        """Its priority, raised one class per aging_s of waiting since it arrived."""
        return req.priority - int((now - req.arrival_time) / self.config.aging_s)

    # ---- 3. order --------------------------------------------------------------
    def order(self, sched: Scheduler) -> list[Request]:
        now = sched.clock()
        return sorted([*sched.running, *sched.waiting], key=lambda r: self._urgency(r, now))

    def _urgency(self, req: Request, now: float) -> tuple:
        eff_class = self._class(req, now)
        decoding = req.status == RequestStatus.RUNNING and not req.is_prefill
        if decoding:
            target = req.slo.tpot_ms
            last = req.last_token_time if req.last_token_time is not None else now
            slack = last + target / 1000 - now if target is not None else math.inf
        else:
            target = req.slo.ttft_ms
            deadline = req.arrival_time + target / 1000 if target is not None else math.inf
            slack = deadline - now - self._prefill_seconds(req)
        return (eff_class, not decoding, slack, req.arrival_time)
