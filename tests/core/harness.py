"""A scheduler test harness: the real scheduler and KV manager over N fake blocks, a fake
clock, and a fake model that "samples" a fixed token. No torch anywhere."""

from __future__ import annotations

import itertools

from tandem.core.block_hash import BlockHasher
from tandem.core.clock import FakeClock
from tandem.core.cost_model import StepShape
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

EOS = 2


class FakeTiers:
    """A KV tier over the harness's fake KV: it keeps each stored block's slots (the token
    prefixes written there) under the block's hash, and a load writes them back into the
    loading request's blocks, so a load of the wrong blocks shows as wrong KV."""

    def __init__(self, block_size: int, min_tokens: int = 0) -> None:
        self.hasher = BlockHasher(b"test-model", block_size)
        self.min_tokens = min_tokens
        self.blocks: dict[bytes, list] = {}
        self.num_asked = 0

    def num_loadable(self, request, start: int, end: int) -> int:
        self.num_asked += 1
        bs = self.hasher.block_size
        hashes = self.hasher.hashes(request, end // bs)[start // bs :]
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n * bs if n * bs >= self.min_tokens else 0


class Harness:
    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 64,
        max_model_len: int = 1024,
        prefix_caching: bool = True,
        batch=None,
        cost_model=None,
        tiers: FakeTiers | None = None,
        max_pinned_fraction: float = 0.5,
        events=None,
    ) -> None:
        self.clock = FakeClock()
        hasher = tiers.hasher if tiers else None
        self.kv = KVCacheManager(
            num_blocks, block_size, prefix_caching, hasher=hasher,
            max_pinned_fraction=max_pinned_fraction, events=events,
        )  # fmt: skip
        cfg = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len)
        self.sched = Scheduler(cfg, self.kv, self.clock, batch, cost_model, kv_source=tiers)
        self.tiers = tiers
        self.loads = []  # KVLoads planned and not finished yet
        # Each step takes what the cost model predicts for it (0.01 s without one).
        self.cost_model = cost_model
        self._ids = itertools.count()
        self.next_token = 7  # what the fake model samples
        # The fake KV: for each (block, offset), the token prefix whose KV sits there. A
        # request reading a slot must find exactly its own prefix, else it would attend to
        # someone else's keys.
        self.kv_content: dict[tuple[int, int], tuple[int, ...]] = {}
        # Speculative decoding: the fake model's verdict on a row with drafts (its new
        # tokens: accepted drafts, then one more) and the fake proposer (drafts for a request
        # after its new tokens); None: every row samples `next_token`, nobody drafts.
        self.verify = None
        self.propose = None

    def add(
        self, prompt, max_tokens=4, priority=0, slo=None, lora_id=0, cache_salt=None, **params
    ) -> Request:
        if isinstance(prompt, int):
            prompt = list(range(100, 100 + prompt))
        sp = SamplingParams(max_tokens=max_tokens, eos_token_ids=(EOS,), **params)
        rid = f"r{next(self._ids)}"
        extra = {"slo": slo} if slo is not None else {}
        req = Request(rid, prompt, sp, arrival_time=self.clock(), priority=priority, **extra)
        req.lora_id = lora_id
        req.cache_salt = cache_salt
        self.sched.add_request(req)
        self.clock.advance(0.001)
        return req

    def step(
        self, sampled: dict[str, int | list[int]] | None = None, drafts=None
    ) -> tuple[SchedulerOutput, list[Request]]:
        """One step; every request reaching its last token samples `next_token` unless
        `sampled` says otherwise (a list: accepted drafts and one more); `drafts` are the
        proposals for the next step. Invariants are checked before and after."""
        self.sched.check_invariants()
        plan = self.sched.schedule()
        self.sched.check_invariants()
        self._write_kv(plan)
        if self.tiers is not None:
            self._store_and_plan_loads(plan)
        for s in plan.scheduled:
            self.assert_kv_correct(s.request, s.start + s.num_new_tokens - len(s.draft_token_ids))
        tokens = {
            s.request.request_id: self.verify(s)
            if self.verify and s.draft_token_ids
            else [self.next_token]
            for s in plan.scheduled
            if s.sample
        }
        if self.propose is not None and drafts is None:
            drafts = {
                rid: self.propose(self.sched.requests[rid], new) for rid, new in tokens.items()
            }
        tokens.update(
            {rid: t if isinstance(t, list) else [t] for rid, t in (sampled or {}).items()}
        )
        seconds = self.cost_model.predict(StepShape.of(plan.scheduled)) if self.cost_model else 0.01
        self.clock.advance(seconds)  # the step runs, then its tokens exist
        finished = self.sched.update(plan, tokens, drafts)
        self.sched.check_invariants()
        return plan, finished

    def _write_kv(self, plan: SchedulerOutput) -> None:
        bs = self.kv.block_size
        for s in plan.scheduled:
            toks = s.request.all_token_ids[: s.start] + s.token_ids  # drafts included
            for pos in range(s.start, s.start + s.num_new_tokens):
                self.kv_content[(s.request.block_ids[pos // bs], pos % bs)] = tuple(toks[: pos + 1])

    def _store_and_plan_loads(self, plan: SchedulerOutput) -> None:
        bs = self.kv.block_size
        for block_id, h in plan.kv_stores:  # the step computed them: copy them down
            self.tiers.blocks[h] = [self.kv_content.get((block_id, o)) for o in range(bs)]
        self.loads += plan.kv_loads

    def finish_loads(self, num_blocks: int | None = None) -> list[Request | None]:
        """End every planned load with its first num_blocks blocks (all: None) written."""
        done, bs = [], self.kv.block_size
        for load in self.loads:
            n = len(load.block_ids) if num_blocks is None else num_blocks
            for block_id, h in zip(load.block_ids[:n], load.hashes):
                for o, content in enumerate(self.tiers.blocks[h]):
                    self.kv_content[(block_id, o)] = content
            done.append(self.sched.finish_load(load.request_id, n * bs))
        self.loads = []
        self.sched.check_invariants()
        return done

    def assert_kv_correct(self, req: Request, upto: int) -> None:
        """Every slot the request attends to (positions < upto) holds its own prefix's KV."""
        bs = self.kv.block_size
        for pos in range(upto):
            got = self.kv_content.get((req.block_ids[pos // bs], pos % bs))
            assert got == tuple(req.all_token_ids[: pos + 1]), (
                f"{req.request_id} reads wrong KV at {pos}"
            )

    def run_to_completion(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.sched.has_unfinished():
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress"
        return steps

    def assert_pool_whole(self) -> None:
        """Nothing is held: every block is free or cached-and-evictable."""
        self.sched.check_invariants()
        assert self.kv.num_free_blocks == self.kv.num_usable_blocks
        assert all(r == 0 for r in self.kv.pool.ref_cnt)
