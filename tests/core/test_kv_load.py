"""Prefixes loaded from a KV tier: the scheduler's loading state, what it plans to load and
to store, and that a loaded request reads exactly its own KV. No torch, a fake tier."""

from __future__ import annotations

from tandem.core.block_hash import BlockHasher, chain_hash
from tandem.core.request import RequestStatus
from tests.core.harness import FakeTiers, Harness

PROMPT = list(range(300, 340))  # 40 tokens: 10 blocks of 4


def computed_then_evicted(h: Harness, prompt=PROMPT) -> None:
    """Run a request on `prompt` to its end, then drop its blocks from the pool."""
    h.add(prompt, max_tokens=1)
    h.run_to_completion()
    assert h.kv.reset_prefix_cache() == len(prompt) // h.kv.block_size


def test_every_computed_block_is_planned_for_the_tiers_once_with_its_chain_hash():
    tiers = FakeTiers(block_size=4)
    h = Harness(block_size=4, max_num_batched_tokens=16, tiers=tiers)
    r = h.add(PROMPT, max_tokens=6)
    stored = []
    while h.sched.has_unfinished():
        plan, _ = h.step()
        stored += plan.kv_stores
    # 40 prompt tokens and 5 computed outputs (the 6th is sampled, never computed): 11 blocks
    assert len(stored) == 11 and len({b for b, _ in stored}) == 11
    hasher, parent, expected = BlockHasher(b"test-model", 4), b"test-model", []
    for i in range(11):
        parent = chain_hash(parent, r.all_token_ids[i * 4 : (i + 1) * 4])
        expected.append(parent)
    assert [h_ for _, h_ in stored] == expected
    assert hasher.hashes(r, 11) == expected


def test_a_prefix_that_left_the_pool_is_loaded_instead_of_computed():
    tiers = FakeTiers(block_size=4)
    h = Harness(block_size=4, max_num_batched_tokens=64, tiers=tiers)
    computed_then_evicted(h)
    r = h.add(PROMPT + [7, 8, 9], max_tokens=2)
    plan, _ = h.step()
    assert plan.scheduled == [] and r.status == RequestStatus.LOADING_KV
    (load,) = plan.kv_loads
    assert (load.request_id, load.start, load.block_ids) == (r.request_id, 0, r.block_ids)
    assert len(load.block_ids) == 10  # the whole 40-token prefix; its 3 new tokens computed
    assert h.finish_loads() == [r]
    assert r.num_computed_tokens == 40 and r.num_cached_tokens == 40
    plan, _ = h.step()  # reads the loaded KV: the harness checks each slot's prefix
    assert [(s.start, s.num_new_tokens) for s in plan.scheduled] == [(40, 3)]
    assert plan.kv_stores == []  # no new full block: loaded blocks are not stored again
    h.run_to_completion()
    h.assert_pool_whole()


def test_loaded_blocks_are_published_for_later_requests():
    tiers = FakeTiers(block_size=4)
    h = Harness(block_size=4, tiers=tiers)
    computed_then_evicted(h)
    h.add(PROMPT + [1], max_tokens=1)
    h.step()
    h.finish_loads()
    other = h.add(PROMPT + [2, 3], max_tokens=1)
    plan, _ = h.step()  # the loaded blocks are in the radix tree: a device hit, no load
    assert plan.kv_loads == [] and other.num_cached_tokens == 40


def test_a_partial_load_computes_the_rest_in_the_blocks_it_holds():
    tiers = FakeTiers(block_size=4)
    h = Harness(block_size=4, max_num_batched_tokens=64, tiers=tiers)
    computed_then_evicted(h)
    r = h.add(PROMPT + [5], max_tokens=2)
    h.step()
    held = list(r.block_ids)
    h.finish_loads(num_blocks=3)  # a gap, a corrupt entry or a timeout after 3 blocks
    assert r.num_computed_tokens == 12 and r.status == RequestStatus.RUNNING
    plan, _ = h.step()
    assert [(s.start, s.num_new_tokens) for s in plan.scheduled] == [(12, 29)]
    assert r.block_ids[: len(held)] == held
    h.run_to_completion()
    h.assert_pool_whole()


def test_a_request_aborted_while_loading_gives_its_blocks_back():
    tiers = FakeTiers(block_size=4)
    h = Harness(block_size=4, tiers=tiers)
    computed_then_evicted(h)
    r = h.add(PROMPT + [5], max_tokens=1)
    h.step()
    assert r.block_ids
    h.sched.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)
    assert h.finish_loads() == [None]  # its late load is dropped
    h.assert_pool_whole()


def test_a_hit_shorter_than_min_tokens_is_computed():
    tiers = FakeTiers(block_size=4, min_tokens=44)
    h = Harness(block_size=4, tiers=tiers)
    computed_then_evicted(h)
    r = h.add(PROMPT + [5], max_tokens=1)
    plan, _ = h.step()
    assert plan.kv_loads == [] and [(s.start, s.num_new_tokens) for s in plan.scheduled] == [
        (0, 41)
    ]
    assert r.num_cached_tokens == 0


def test_the_last_prompt_token_is_always_computed():
    tiers = FakeTiers(block_size=4)
    h = Harness(block_size=4, tiers=tiers)
    computed_then_evicted(h)
    r = h.add(PROMPT, max_tokens=1)  # exactly the stored 40 tokens
    plan, _ = h.step()
    assert len(plan.kv_loads[0].block_ids) == 9  # 36 tokens: the 40th gives the logits
    h.finish_loads()
    plan, _ = h.step()
    assert [(s.start, s.num_new_tokens) for s in plan.scheduled] == [(36, 4)]
    assert r.is_finished


def test_loading_requests_hold_seats():
    tiers = FakeTiers(block_size=4)
    h = Harness(block_size=4, max_num_seqs=1, tiers=tiers)
    computed_then_evicted(h)
    loading = h.add(PROMPT + [5], max_tokens=1)
    other = h.add(8, max_tokens=1)
    plan, _ = h.step()
    assert loading.status == RequestStatus.LOADING_KV and plan.scheduled == []
    assert other.status == RequestStatus.WAITING
    h.finish_loads()
    h.run_to_completion()
    assert other.is_finished


def test_an_adapter_without_a_digest_neither_loads_nor_stores():
    tiers = FakeTiers(block_size=4)
    h = Harness(block_size=4, tiers=tiers)
    computed_then_evicted(h)
    r = h.add(PROMPT + [5], max_tokens=1, lora_id=1)
    asked = tiers.num_asked
    plan, _ = h.step()
    assert plan.kv_loads == [] and plan.kv_stores == [] and tiers.num_asked == asked
    assert r.is_finished


def test_a_preempted_loaded_request_loads_again():
    tiers = FakeTiers(block_size=4)
    h = Harness(block_size=4, num_blocks=16, max_num_batched_tokens=64, tiers=tiers)
    computed_then_evicted(h)
    r = h.add(PROMPT + [5], max_tokens=12)
    h.step()
    h.finish_loads()
    h.step()
    h.sched._preempt(r)
    h.kv.reset_prefix_cache()
    plan, _ = h.step()
    assert r.status == RequestStatus.LOADING_KV and plan.kv_loads
    h.finish_loads()
    h.run_to_completion()
    assert r.num_cached_tokens == 40 and r.num_output_tokens == 12


def test_an_adapters_blocks_are_named_by_its_digest_apart_from_the_base_models():
    tiers = FakeTiers(block_size=4)
    h = Harness(block_size=4, tiers=tiers)
    tiers.hasher.add_adapter(3, b"adapter weights digest")
    base = h.add(PROMPT, max_tokens=1)
    adapted = h.add(PROMPT, max_tokens=1, lora_id=3)
    stored = []
    while h.sched.has_unfinished():
        plan, _ = h.step()
        stored += [x for _, x in plan.kv_stores]
    assert len(set(stored)) == 20  # both requests' 10 blocks: the adapter's match no base ones
    assert set(base.block_hashes).isdisjoint(adapted.block_hashes)
    h.kv.reset_prefix_cache()
    again = h.add(PROMPT + [1], max_tokens=1, lora_id=3)
    plan, _ = h.step()
    assert plan.kv_loads[0].hashes == adapted.block_hashes
    h.finish_loads()
    h.run_to_completion()
    assert again.num_cached_tokens == 40
