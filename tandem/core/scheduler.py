"""Scheduler: decides which tokens of which requests run in the next step.

One step is three calls, `plan = schedule()`, `out = runner.execute(plan)`,
`finished = update(plan, out)`. The plan is a ledger of ints: for each scheduled request,
how many of its tokens to compute, starting where. Prefill and decode are not separate
modes: a request's new tokens are the lesser of what it still needs and the budget left, so
chunked prefill and mixed batches need no special case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.policy import FCFSQueue, PreemptionPolicy, PreemptNewest, WaitingQueue
from tandem.core.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step (= num_computed_tokens when scheduled)
    num_new_tokens: int
    sample: bool  # the chunk reaches the request's last known token: sample the next one

    @classmethod
    def of(cls, request: Request, start: int, num_new_tokens: int) -> ScheduledRequest:
        return cls(request, start, num_new_tokens, start + num_new_tokens == request.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Requests that ended since the previous plan: the runner drops any state it keeps for them.
    finished_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request.request_id: s.num_new_tokens for s in self.scheduled}

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def stop_status(request: Request, max_model_len: int) -> RequestStatus | None:
    """Why the request must stop after its latest token, if it must. Stop strings are the
    detokenizer's business (they need text)."""
    params, token = request.sampling_params, request.all_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in params.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        clock: Callable[[], float],
        waiting: WaitingQueue | None = None,
        preemption: PreemptionPolicy | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting = waiting or FCFSQueue()
        self.preemption = preemption or PreemptNewest()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []

    # ---- intake ------------------------------------------------------------------
    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request may ever hold: the model's limit or the whole pool."""
        return min(self.config.max_model_len, self.kv.num_usable_blocks * self.kv.block_size)

    def check_request(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Raise a ValueError naming the field if such a request could never run: its prompt
        leaves no room for output, or it could outgrow the whole KV pool (it would wait or be
        preempted forever)."""
        limit = self.config.max_model_len
        if num_prompt_tokens < 1:
            raise ValueError("prompt: must not be empty (it has no tokens)")
        if num_prompt_tokens >= limit:
            raise ValueError(
                f"prompt: {num_prompt_tokens} tokens is too long; max_model_len is {limit} "
                f"(prompt plus at least one output token)"
            )
        worst_case = min(num_prompt_tokens + (max_tokens or limit), limit)
        if worst_case > self.max_request_tokens:
            raise ValueError(
                f"max_tokens: prompt ({num_prompt_tokens}) + max_tokens ({max_tokens}) needs "
                f"{worst_case} tokens of KV cache but the pool holds {self.max_request_tokens}; "
                f"lower max_tokens or raise kv_cache_memory"
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.check_request(request.num_prompt_tokens, request.max_tokens)
        if request.max_tokens is None:
            request.max_tokens = self.config.max_model_len - request.num_prompt_tokens
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string). Unknown ids are ignored."""
        done = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            done.append(request)
        return done

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---- the step --------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_ids:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.kv.allocate_slots(req, n):
                out.scheduled.append(ScheduledRequest.of(req, req.num_computed_tokens, n))
                budget -= n
                i += 1
                continue
            # Short of blocks: preempt among those not yet scheduled, so no block written
            # this step is freed. If the asker itself is the victim, running[i] moves on.
            victim = self.preemption.pick_victim(self.running[i:])
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            prefix = self.kv.match_prefix(req)
            num_cached = len(prefix) * self.kv.block_size
            n = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(req, n, prefix):
                break
            self.waiting.pop()
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
                req.first_scheduled_time = self.clock()
                self.kv.record_lookup(req.num_prompt_tokens, num_cached)
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest.of(req, num_cached, n))
            budget -= n

    def update(self, plan: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance every scheduled request by its chunk; append sampled tokens; finish those
        that hit a stop condition. Returns the requests that finished in this step."""
        finished = []
        for s in plan.scheduled:
            req = s.request
            if req.is_finished:
                continue
            req.num_computed_tokens = s.start + s.num_new_tokens
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.append_token(token)
            status = stop_status(req, self.config.max_model_len)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
                finished.append(req)
        return finished

    # ---- helpers ---------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(req)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        # A request that failed mid-step may have published blocks whose KV was never written.
        self.kv.free(req, keep_cached=status != RequestStatus.FINISHED_ERROR)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    def check_invariants(self) -> None:
        live = list(self.running) + list(self.waiting)
        assert len(live) == len(self.requests), "a request is lost or counted twice"
        assert all(r.request_id in self.requests for r in live)
        assert len(self.running) <= self.config.max_num_seqs
        for r in self.waiting:
            assert not r.block_ids and r.num_computed_tokens == 0, f"waiting {r} holds KV"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
            assert len(r.block_ids) >= self.kv.blocks_for(r.num_computed_tokens)
        self.kv.check_invariants(self.running)
