"""Draft tokens in the token ledger: the scheduler budgets them, gives them slots, never
publishes their KV, and takes back the slots of those the model rejects. No torch."""

from __future__ import annotations

import random

import pytest

from tandem.core.request import RequestStatus
from tests.core.harness import EOS, Harness


def decoding(h: Harness, prompt=6, max_tokens=20, **kw):
    """A request past its prefill, with one output token."""
    req = h.add(prompt, max_tokens=max_tokens, **kw)
    h.step()
    assert req.num_output_tokens == 1
    return req


def test_a_request_with_drafts_is_scheduled_with_them_as_lookahead():
    h = Harness(block_size=4)
    req = decoding(h)
    req.draft_token_ids = [11, 12, 13]
    plan = h.sched.schedule()
    (s,) = plan.scheduled
    assert (s.start, s.num_new_tokens, s.draft_token_ids, s.sample) == (6, 4, (11, 12, 13), True)
    assert s.token_ids == [7, 11, 12, 13]  # the last sampled token, then the drafts
    assert len(req.block_ids) == h.kv.blocks_for(6 + 4)


def test_accepted_drafts_advance_the_request_and_rejected_slots_go_back():
    h = Harness(block_size=2)
    req = decoding(h, prompt=5)
    req.draft_token_ids = [11, 12, 13, 14]
    h.verify = lambda s: [11, 12, 30]  # two drafts accepted, then the model's own token
    plan, _ = h.step()
    assert req.output_token_ids == [7, 11, 12, 30]
    assert req.num_computed_tokens == 5 + 3  # 7, 11, 12 have KV; 30 is next to compute
    assert len(req.block_ids) == h.kv.blocks_for(req.num_tokens)  # 13 and 14's slots returned
    stats = h.sched.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 2)
    assert stats.accepted_per_pos == [1, 1, 0, 0]


def test_all_drafts_rejected_still_yields_one_token():
    h = Harness(block_size=4)
    req = decoding(h)
    req.draft_token_ids = [11, 12]
    h.verify = lambda s: [40]
    h.step()
    assert req.output_token_ids == [7, 40] and req.num_computed_tokens == 7


def test_drafts_are_capped_by_max_tokens_and_max_model_len():
    h = Harness(block_size=4, max_model_len=12)
    req = decoding(h, prompt=6, max_tokens=3)  # one output so far: two more may come
    req.draft_token_ids = [11, 12, 13, 14]
    (s,) = h.sched.schedule().scheduled
    assert s.draft_token_ids == (11,)  # the draft and the model's token make max_tokens
    h2 = Harness(block_size=4, max_model_len=9)
    r2 = decoding(h2, prompt=6, max_tokens=20)  # 7 tokens of 9
    r2.draft_token_ids = [11, 12, 13]
    (s2,) = h2.sched.schedule().scheduled
    assert s2.draft_token_ids == (11,)


def test_the_token_budget_cuts_drafts_before_known_tokens():
    h = Harness(block_size=4, max_num_batched_tokens=3)
    req = decoding(h, prompt=3)
    req.draft_token_ids = [11, 12, 13, 14]
    (s,) = h.sched.schedule().scheduled
    assert s.num_new_tokens == 3 and s.draft_token_ids == (11, 12)


def test_drafts_never_preempt_another_request():
    # Two decoding requests fill the pool; the drafts do not fit, so they are dropped rather
    # than evicting the other request.
    h = Harness(num_blocks=6, block_size=4, prefix_caching=False)
    a, b = decoding(h, prompt=7, max_tokens=8), decoding(h, prompt=7, max_tokens=8)
    a.draft_token_ids = [11, 12, 13, 14, 15, 16]
    plan = h.sched.schedule()
    assert plan.preempted_ids == []
    rows = {s.request.request_id: s for s in plan.scheduled}
    assert rows[a.request_id].draft_token_ids == () and b.request_id in rows


def test_an_emitted_stop_token_among_accepted_drafts_ends_the_request_there():
    h = Harness(block_size=4)
    req = decoding(h)
    req.draft_token_ids = [11, EOS, 12]
    h.verify = lambda s: [11, EOS, 12, 13]
    _, finished = h.step()
    assert finished == [req] and req.output_token_ids == [7, 11, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    h.assert_pool_whole()


def test_draft_kv_is_never_published_to_the_prefix_cache():
    # The drafts fill a whole block; rejected, that block must not be found by a prompt that
    # happens to continue with the same tokens.
    h = Harness(block_size=4)
    req = decoding(h, prompt=8)  # 8 prompt + 1 output: the next block holds positions 8..11
    req.draft_token_ids = [11, 12, 13]
    h.verify = lambda s: [50]
    h.step()
    other = h.add(req.prompt_token_ids + [7, 11, 12, 13, 1])
    plan, _ = h.step()  # the harness checks every row reads only its own prefix's KV
    row = next(s for s in plan.scheduled if s.request is other)
    assert row.start == 8  # the prompt's two full blocks matched, nothing from the drafts


def test_preemption_drops_a_requests_drafts():
    h = Harness(block_size=4)
    req = decoding(h)
    req.draft_token_ids = [11, 12]
    h.sched._preempt(req)
    assert req.draft_token_ids == [] and req.status == RequestStatus.PREEMPTED
    h.run_to_completion()
    h.assert_pool_whole()


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_no_block_leaks_after_random_accepts_rejects_aborts_and_preemption(seed, prefix_caching):
    rng = random.Random(seed)
    h = Harness(
        num_blocks=rng.randint(12, 40),
        block_size=rng.choice([1, 2, 4]),
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(4, 40),
        prefix_caching=prefix_caching,
    )

    def verify(s):
        accepted = rng.randint(0, len(s.draft_token_ids))
        return list(s.draft_token_ids[:accepted]) + [rng.choice([EOS, *range(3, 12)])]

    h.verify = verify
    h.propose = lambda req, new: [rng.randrange(3, 12) for _ in range(rng.randint(0, 5))]
    live, max_fit = [], h.sched.max_request_tokens
    for _ in range(300):
        op = rng.random()
        if op < 0.25:
            prompt = [rng.randrange(3, 12) for _ in range(rng.randint(1, 12))]
            if max_fit - len(prompt) >= 1:
                live.append(
                    h.add(prompt, max_tokens=rng.randint(1, min(max_fit - len(prompt), 20)))
                )
        elif op < 0.33 and live:
            h.sched.finish_requests([rng.choice(live).request_id], RequestStatus.FINISHED_ABORTED)
        else:
            h.next_token = EOS if rng.random() < 0.1 else rng.randrange(3, 12)
            h.step()
        live = [r for r in live if not r.is_finished]
    h.run_to_completion()
    h.assert_pool_whole()
    assert h.sched.spec_stats.num_drafts > 0
