"""Randomized schedules: any mix of arrivals, finishes, aborts, preemption and eviction leaves
every block accounted for, and no request ever reads KV that is not its own prefix's."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.core.request import RequestStatus
from tests.core.harness import EOS, Harness

PREFIXES = [list(range(500, 500 + n)) for n in (0, 5, 12, 23)]


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_no_block_leaks_after_random_finish_abort_and_preemption(seed, prefix_caching):
    rng = random.Random(seed)
    h = Harness(
        num_blocks=rng.randint(12, 40),
        block_size=rng.choice([1, 2, 4]),
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(4, 40),
        prefix_caching=prefix_caching,
    )
    max_tokens_fit = h.sched.max_request_tokens
    live = []
    for _ in range(300):
        op = rng.random()
        if op < 0.25:
            prompt = rng.choice(PREFIXES) + [
                rng.randrange(3, 50) for _ in range(rng.randint(1, 10))
            ]
            budget = max_tokens_fit - len(prompt)
            if budget >= 1:
                live.append(h.add(prompt, max_tokens=rng.randint(1, min(budget, 20))))
        elif op < 0.33 and live:
            victim = rng.choice(live)
            h.sched.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
        else:
            h.next_token = EOS if rng.random() < 0.1 else rng.randrange(3, 50)
            h.step()
        live = [r for r in live if not r.is_finished]
    h.run_to_completion()
    h.assert_pool_whole()


class PrefixCacheMachine(RuleBasedStateMachine):
    """Drives insert (admission), match, evict, free (finish) and abort on a small pool; the
    reference model is the fake KV: each slot records which token prefix was written there."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(num_blocks=16, block_size=2, max_num_seqs=4, max_num_batched_tokens=12)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(3, 9), min_size=1, max_size=6),
        max_tokens=st.integers(1, 6),
    )
    def add(self, prefix, suffix, max_tokens):
        prompt = prefix + suffix
        if len(prompt) + max_tokens <= self.h.sched.max_request_tokens:
            self.h.add(prompt, max_tokens=max_tokens)

    @rule(token=st.sampled_from([EOS, 3, 4, 5]))
    def step(self, token):
        self.h.next_token = token
        self.h.step()

    @precondition(lambda self: self.h.sched.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.h.sched.requests)))
        self.h.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    @rule()
    def reset_cache(self):
        self.h.kv.reset_prefix_cache()

    @invariant()
    def blocks_accounted_and_kv_correct(self):
        self.h.sched.check_invariants()
        for r in self.h.sched.running:
            self.h.assert_kv_correct(r, r.num_computed_tokens)

    def teardown(self):
        self.h.sched.finish_requests(list(self.h.sched.requests), RequestStatus.FINISHED_ABORTED)
        self.h.assert_pool_whole()


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
test_prefix_cache_state_machine = PrefixCacheMachine.TestCase
