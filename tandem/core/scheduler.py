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

from tandem.core.budget import StepBudget, limit_adapters
from tandem.core.cost_model import StepShape
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.kv_load import KVLoad, KVLoadSource
from tandem.core.policy import BatchPolicy, FCFSBatch
from tandem.core.request import Request, RequestStatus
from tandem.spec.stats import SpecDecodeStats


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    max_loras: int | None = None  # most LoRA adapters in one step (None: LoRA is off)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 4x (one per row per step)
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step (= num_computed_tokens when scheduled)
    num_new_tokens: int  # draft tokens included
    sample: bool  # the chunk reaches the request's last known token: sample the next one
    # Proposed tokens after the last known one, computed in the same row: the runner samples
    # at each of them too and returns the prefix the model agrees with, plus one token.
    draft_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(
        cls, request: Request, start: int, num_new_tokens: int, drafts: tuple[int, ...] = ()
    ) -> ScheduledRequest:
        end = start + num_new_tokens - len(drafts)
        return cls(request, start, num_new_tokens, end == request.num_tokens, tuple(drafts))

    @property
    def token_ids(self) -> list[int]:
        """The row's input tokens: its known ones from `start`, then its drafts."""
        known = self.request.all_token_ids[self.start : self.start + self.num_new_tokens]
        return known + list(self.draft_token_ids) if self.draft_token_ids else known


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Requests that ended since the previous plan: the runner drops any state it keeps for them.
    finished_ids: list[str] = field(default_factory=list)
    # Requests this schedule() finished because they could no longer meet their SLO.
    shed: list[Request] = field(default_factory=list)
    # KV tiers: prefixes to load into requests' blocks (those requests wait, LOADING_KV), and
    # (block id, hash) of blocks published this step, to copy down the tiers once computed.
    kv_loads: list[KVLoad] = field(default_factory=list)
    kv_stores: list[tuple[int, bytes]] = field(default_factory=list)
    _shape: StepShape | None = field(default=None, repr=False, compare=False)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request.request_id: s.num_new_tokens for s in self.scheduled}

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def shape(self) -> StepShape:
        """What the cost model reads of this plan (computed once: core, runner and online
        fit all ask)."""
        if self._shape is None:
            self._shape = StepShape.of(self.scheduled)
        return self._shape


def stop_status(request: Request, max_model_len: int) -> RequestStatus | None:
    """Why the request must stop after its latest token, if it must. Stop strings are the
    detokenizer's business (they need text)."""
    params, token = request.sampling_params, request.all_token_ids[-1]
    num_tokens = len(request.all_token_ids)
    num_output = num_tokens - request.num_prompt_tokens
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token in params.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if num_output >= request.max_tokens or num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        clock: Callable[[], float],
        batch: BatchPolicy | None = None,
        cost_model=None,
        kv_source: KVLoadSource | None = None,
    ) -> None:
        self.config = config
        self.kv_source = kv_source  # KV tiers to load prefixes from, if any
        self.kv = kv
        self.clock = clock
        self.batch = batch or FCFSBatch()  # which requests, in what order, within what budget
        self.cost_model = cost_model  # predicts step seconds (core/cost_model.py), if any
        self.waiting = self.batch.new_queue()
        self.running: list[Request] = []
        self.reserved: dict[str, Request] = {}  # waiting for their KV (reserve / commit)
        self.loading: dict[str, Request] = {}  # loading a prefix from a KV tier (finish_load)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()
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
        self._intake(request)
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def _intake(self, request: Request) -> None:
        """Refuse what could never run; resolve max_tokens=None to what max_model_len allows."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.check_request(request.num_prompt_tokens, request.max_tokens)
        if request.max_tokens is None:
            request.max_tokens = self.config.max_model_len - request.num_prompt_tokens

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string). Unknown ids are ignored."""
        done = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            elif self.reserved.pop(rid, None) is None and self.loading.pop(rid, None) is None:
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
        return (
            bool(self.running) or len(self.waiting) > 0 or bool(self.reserved) or bool(self.loading)
        )

    @property
    def num_seated(self) -> int:
        """Requests holding a seat of max_num_seqs: running, reserved or loading."""
        return len(self.running) + len(self.reserved) + len(self.loading)

    # ---- KV from elsewhere (prefill/decode disaggregation) -----------------------------
    def reserve(self, request: Request) -> int | None:
        """Take a request whose prompt KV another instance computes: match its prompt in the
        radix cache, and allocate blocks for the rest without publishing them (no request may
        match KV that has not arrived). Returns how many prompt tokens are already held here
        (the sender sends the rest), or None when there is no room (batch slots or blocks).

            |<----------------- prompt ------------------>|
            |<- num_cached: held here ->|<- to receive ->|
        """
        self._intake(request)
        if self.num_seated >= self.config.max_num_seqs:
            return None
        prefix = self.kv.match_prefix(request)
        num_cached = len(prefix) * self.kv.block_size
        if not self.kv.allocate_slots(request, request.num_tokens - num_cached, prefix, False):
            return None
        self._start(request, num_cached)
        request.status = RequestStatus.WAITING_FOR_KV
        self.requests[request.request_id] = self.reserved[request.request_id] = request
        return num_cached

    def commit(self, request_id: str, first_token: int) -> Request:
        """The prompt's KV has arrived, and the token the sender sampled after it: publish the
        blocks and run the request from its next token. It may finish right here (the token
        is EOS, or max_tokens is 1); check `is_finished`."""
        req = self.reserved.pop(request_id)
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.publish(req, req.num_prompt_tokens)
        req.append_token(first_token)
        req.last_token_time = self.clock()
        status = stop_status(req, self.config.max_model_len)
        if status is not None:
            self._finish(req, status)
        else:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        return req

    def release(self, request_id: str) -> None:
        """Give up a reservation (the transfer failed or timed out); its blocks go back."""
        self.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)

    # ---- the step --------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        out.shed = self.batch.prepare(self)  # may shed or demote requests past their SLO
        self._fill(out, limit_adapters(self.batch.budget(self), self.config.max_loras))
        if self.kv.hasher is not None:
            out.kv_stores = self.kv.take_stores()
        return out

    def _fill(self, out: SchedulerOutput, budget: StepBudget) -> None:
        """Walk the batch policy's candidates (running and waiting) in its order: a running
        request gets room for its next chunk, a waiting one is admitted with its cached
        prefix. Short of blocks, the policy names a victim among the running requests not yet
        scheduled this step (so no block written this step is freed); none, and the asker
        waits. After a failed admission nothing more is admitted (no request overtakes)."""
        candidates = self.batch.order(self)
        unscheduled = [r for r in candidates if r.status == RequestStatus.RUNNING]
        admitting = True
        for req in candidates:
            if budget.exhausted:
                break
            if req.status == RequestStatus.RUNNING:
                if req in unscheduled:  # not preempted meanwhile
                    self._schedule_running(out, req, budget, unscheduled)
            elif admitting and req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                if out.preempted_ids and not self.batch.admit_after_preemption:
                    admitting = False
                elif not self._admit(out, req, budget, unscheduled):
                    admitting = False

    def _schedule_running(self, out, req: Request, budget: StepBudget, unscheduled) -> None:
        drafts = self._drafts(req)
        while True:
            known = req.num_tokens - req.num_computed_tokens
            n = budget.fit(req, req.num_computed_tokens, known + len(drafts))
            if n <= 0:
                return
            drafts = drafts[: max(0, n - known)]  # the budget may cut drafts, never known tokens
            if self.kv.allocate_slots(req, n, num_unverified=len(drafts)):
                unscheduled.remove(req)
                out.scheduled.append(ScheduledRequest.of(req, req.num_computed_tokens, n, drafts))
                budget.spend(req, req.num_computed_tokens, n)
                return
            if drafts:  # speculation never preempts anyone: try again without it
                drafts = ()
                continue
            victim = self.batch.victim(req, unscheduled)
            if victim is None:
                return
            self._preempt_for(out, victim, budget, unscheduled)
            if victim is req:
                return

    def _drafts(self, req: Request) -> tuple[int, ...]:
        """The request's proposed tokens worth verifying now: only right after its last token
        (not mid-prompt), and no more than max_tokens and max_model_len leave room for (the
        step yields the accepted drafts plus one token)."""
        if not req.draft_token_ids or req.num_tokens - req.num_computed_tokens != 1:
            return ()
        room = min(
            req.max_tokens - req.num_output_tokens, self.config.max_model_len - req.num_tokens
        )
        return tuple(req.draft_token_ids[: max(0, room - 1)])

    def _admit(self, out, req: Request, budget: StepBudget, unscheduled) -> bool:
        if self.num_seated >= self.config.max_num_seqs:
            # The policy may have a running request give up its seat (SLO: an at-risk
            # prompt's, which the step then surely admits: it comes first in the order).
            seat = self.batch.seat_victim(req, unscheduled)
            if seat is None:
                return False
            self._preempt_for(out, seat, budget, unscheduled)
        prefix = self.kv.match_prefix(req)
        num_cached = len(prefix) * self.kv.block_size
        num_loadable = self.num_loadable(req, num_cached)
        if num_loadable:
            return self._admit_loading(out, req, prefix, num_loadable, budget, unscheduled)
        n = budget.fit(req, num_cached, req.num_tokens - num_cached)
        if n <= 0:
            return False
        while not self.kv.allocate_slots(req, n, prefix):
            victim = self.batch.victim(req, unscheduled)
            if victim is None:
                return False
            self._preempt_for(out, victim, budget, unscheduled)
        self.waiting.remove(req)
        self._start(req, num_cached)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.scheduled.append(ScheduledRequest.of(req, num_cached, n))
        budget.spend(req, num_cached, n)
        return True

    # ---- KV loaded from a tier (core/kv_load.py) -------------------------------------------
    def num_loadable(self, req: Request, num_cached: int) -> int:
        """Tokens after the first num_cached whose KV a tier can load (0: none, or no tiers)."""
        if self.kv_source is None or not self.kv.hasher.covers(req.lora_id):
            return 0
        bs = self.kv.block_size
        end = (req.num_tokens - 1) // bs * bs  # the last token is computed, for its logits
        return self.kv_source.num_loadable(req, num_cached, end) if end > num_cached else 0

    def _admit_loading(self, out, req, prefix, num_loadable, budget, unscheduled) -> bool:
        """Admit a request whose next num_loadable tokens' KV a tier holds: it holds blocks
        for them (unpublished: no request may match KV that has not arrived) and waits for
        the load, costing this step nothing."""
        while not self.kv.allocate_slots(req, num_loadable, prefix, publish=False):
            victim = self.batch.victim(req, unscheduled)
            if victim is None:
                return False
            self._preempt_for(out, victim, budget, unscheduled)
        num_cached = len(prefix) * self.kv.block_size
        self.waiting.remove(req)
        self._start(req, num_cached)
        req.status = RequestStatus.LOADING_KV
        self.loading[req.request_id] = req
        out.kv_loads.append(self.kv_load(req, num_cached, num_loadable))
        return True

    def kv_load(self, req: Request, start: int, num_tokens: int) -> KVLoad:
        """The load of the request's tokens [start, start + num_tokens) into its blocks."""
        bs = self.kv.block_size
        first, last = start // bs, (start + num_tokens) // bs
        hashes = self.kv.hasher.hashes(req, last)[first:]
        return KVLoad(req.request_id, start, req.block_ids[first:last], hashes)

    def finish_load(self, request_id: str, num_loaded: int) -> Request | None:
        """A load ended with its first num_loaded tokens in place (all, some or none): the
        request runs on from there, and the loaded blocks are published. None if the request
        is gone (aborted while loading)."""
        req = self.loading.pop(request_id, None)
        if req is None:
            return None
        req.num_computed_tokens += num_loaded
        if req.num_preemptions == 0:
            req.num_cached_tokens += num_loaded  # reported as cached, as a device hit is
        self.kv.publish(req, req.num_computed_tokens, store=False)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return req

    def _start(self, req: Request, num_cached: int) -> None:
        """The request holds blocks from now on, the first num_cached of them cached."""
        if req.num_preemptions == 0:  # a recompute after preemption is not a new lookup
            req.num_cached_tokens = num_cached
            req.first_scheduled_time = self.clock()
            self.kv.record_lookup(req.num_prompt_tokens, num_cached)
        req.num_computed_tokens = num_cached

    def _preempt_for(self, out, victim: Request, budget: StepBudget, unscheduled) -> None:
        unscheduled.remove(victim)
        budget.release(victim)
        self._preempt(victim)
        out.preempted_ids.append(victim.request_id)

    def update(
        self,
        plan: SchedulerOutput,
        sampled: dict[str, list[int]],
        drafts: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Advance every scheduled request by its chunk; append its new tokens (one, or the
        accepted drafts and one more); finish those that hit a stop condition (tokens after
        the stop are dropped). `drafts` are the proposals for each request's next step.
        Returns the requests that finished in this step."""
        finished, now, proposals = [], self.clock(), drafts or {}
        for s in plan.scheduled:
            req = s.request
            if req.is_finished:
                continue
            tokens = sampled.get(req.request_id) or []
            req.num_computed_tokens = s.start + s.num_new_tokens
            if s.draft_token_ids:
                accepted = max(0, len(tokens) - 1)
                self.spec_stats.record(len(s.draft_token_ids), accepted)
                req.num_computed_tokens -= len(s.draft_token_ids) - accepted
            if req.draft_token_ids or proposals:
                req.draft_token_ids = proposals.get(req.request_id) or []
            for token in tokens:
                req.append_token(token)
                req.last_token_time = now
                status = stop_status(req, self.config.max_model_len)
                if status is not None:
                    self.running.remove(req)
                    self._finish(req, status)
                    finished.append(req)
                    break
            else:
                if s.draft_token_ids:  # the rejected drafts' slots go back
                    self.kv.trim(req, req.num_tokens)
        return finished

    def preempt_running(self) -> list[str]:
        """Send every running request back to wait with its KV dropped, to be computed anew
        (after a weight update that asks for it); -> their ids."""
        victims = list(reversed(self.running))  # each goes to the front: order kept
        for req in victims:
            self._preempt(req)
        return [r.request_id for r in victims]

    # ---- helpers ---------------------------------------------------------------
    def observe_step(self, plan: SchedulerOutput, seconds: float) -> None:
        """A step's measured time, for a cost model that learns online."""
        observe = getattr(self.cost_model, "observe", None)
        if observe is not None and plan.scheduled:
            observe(plan.shape, seconds)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []
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
        loading = list(self.loading.values())
        live = list(self.running) + list(self.waiting) + list(self.reserved.values()) + loading
        assert len(live) == len(self.requests), "a request is lost or counted twice"
        assert all(r.request_id in self.requests for r in live)
        assert self.num_seated <= self.config.max_num_seqs
        for r in self.waiting:
            assert not r.block_ids and r.num_computed_tokens == 0, f"waiting {r} holds KV"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
            assert len(r.block_ids) >= self.kv.blocks_for(r.num_computed_tokens)
            # nobody holds slots past its tokens and drafts (rejected drafts' slots went back)
            most = self.kv.blocks_for(r.num_tokens + len(r.draft_token_ids))
            assert len(r.block_ids) <= most, f"{r} holds KV past its tokens"
        for r in self.reserved.values():
            assert r.status == RequestStatus.WAITING_FOR_KV
            assert len(r.block_ids) == self.kv.blocks_for(r.num_prompt_tokens)
        for r in loading:
            assert r.status == RequestStatus.LOADING_KV
            assert len(r.block_ids) * self.kv.block_size < r.num_tokens, f"{r} holds too much"
        self.kv.check_invariants([*self.running, *self.reserved.values(), *loading])
