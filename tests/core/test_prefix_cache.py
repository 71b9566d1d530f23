"""Radix prefix caching in the scheduler: exact hits, sharing, eviction. No torch."""

from __future__ import annotations

from tandem.core.block_pool import BlockPool
from tandem.core.radix_cache import RadixCache
from tests.core.harness import Harness

SYSTEM = list(range(1000, 1032))  # 32 tokens = 8 blocks of 4


def test_a_shared_system_prompt_is_computed_once():
    h = Harness(block_size=4)
    first = h.add(SYSTEM + [1, 2, 3], max_tokens=2)
    h.run_to_completion()
    second = h.add(SYSTEM + [4, 5, 6, 7, 8], max_tokens=2)
    plan, _ = h.step()
    assert second.num_cached_tokens == 32
    assert plan.scheduled[0].start == 32 and plan.scheduled[0].num_new_tokens == 5
    assert h.kv.stats.queries == 35 + 37 and h.kv.stats.hits == 32
    assert first.num_cached_tokens == 0


def test_requests_admitted_in_the_same_step_share_the_first_ones_blocks():
    # The first request's blocks are published when scheduled; the second reads them after
    # this step's KV write, so the prefix is computed once even for simultaneous arrivals.
    h = Harness(block_size=4, max_num_batched_tokens=256)
    a = h.add(SYSTEM + [1], max_tokens=1)
    b = h.add(SYSTEM + [2], max_tokens=1)
    plan, _ = h.step()
    assert plan.num_scheduled_tokens == {a.request_id: 33, b.request_id: 1}
    assert b.block_ids[:8] == a.block_ids[:8]
    assert b.num_cached_tokens == 32


def test_a_fully_cached_prompt_still_computes_its_last_block():
    h = Harness(block_size=4)
    h.add(SYSTEM, max_tokens=1)
    h.run_to_completion()
    again = h.add(SYSTEM, max_tokens=1)
    plan, _ = h.step()
    # 32 tokens cached, but logits need a computed token: the last block is recomputed.
    assert again.num_cached_tokens == 28
    assert plan.scheduled[0].start == 28 and plan.scheduled[0].num_new_tokens == 4


def test_a_prefix_ending_mid_block_hits_only_whole_blocks():
    h = Harness(block_size=4)
    h.add(SYSTEM[:10], max_tokens=1)  # blocks: 4 + 4 full, 2 tokens in the third
    h.run_to_completion()
    r = h.add(SYSTEM[:10] + [9, 9, 9], max_tokens=1)
    h.step()
    assert r.num_cached_tokens == 8


def test_multi_turn_history_including_generated_tokens_is_reused():
    h = Harness(block_size=4)
    # 6 prompt + 7 output tokens; the last sampled token never had its KV computed, so 12
    # tokens = 3 full blocks are cached.
    turn1 = h.add(SYSTEM[:6], max_tokens=7)
    h.run_to_completion()
    history = turn1.all_token_ids + [50, 51, 52]
    turn2 = h.add(history, max_tokens=1)
    h.step()
    assert turn2.num_cached_tokens == 12


def test_cached_blocks_are_evicted_least_recently_used_first_when_the_pool_is_short():
    h = Harness(num_blocks=9, block_size=4)  # 8 usable
    old = h.add([1] * 8, max_tokens=1)  # 2 full blocks
    h.run_to_completion()
    newer = h.add([2] * 8, max_tokens=1)
    h.run_to_completion()
    assert h.kv.cache.num_cached_blocks == 4 and h.kv.num_free_blocks == 8
    big = h.add([3] * 24, max_tokens=1)  # needs 6 blocks: 4 free + 2 evicted
    h.step()
    assert h.kv.num_evicted == 2
    assert h.kv.cache.match([1] * 8, 2) == []  # the least recently used went first
    assert len(h.kv.cache.match([2] * 8, 2)) == 2
    assert big.num_output_tokens == 1 and old.is_finished and newer.is_finished


def test_blocks_in_use_are_never_evicted():
    h = Harness(num_blocks=9, block_size=4)
    holder = h.add(SYSTEM[:8], max_tokens=20)
    h.step()
    held = list(holder.block_ids)
    h.add([5] * 16, max_tokens=1)  # wants more than is free: must wait, not evict held blocks
    for _ in range(3):
        h.step()
        assert holder.block_ids[: len(held)] == held


def test_with_caching_off_nothing_is_cached_or_hit():
    h = Harness(prefix_caching=False)
    h.add(SYSTEM, max_tokens=1)
    h.run_to_completion()
    r = h.add(SYSTEM, max_tokens=1)
    h.step()
    assert r.num_cached_tokens == 0 and h.kv.cache is None


def test_radix_cache_confirms_hits_by_tokens_not_hashes():
    pool = BlockPool(8)
    cache = RadixCache(2, pool.ref_cnt)
    node = cache.insert(None, (1, 2), 1)
    cache.insert(node, (3, 4), 2)
    assert [n.block_id for n in cache.match([1, 2, 3, 4], 2)] == [1, 2]
    assert [n.block_id for n in cache.match([1, 2, 3, 5], 2)] == [1]
    assert cache.match([2, 1], 1) == []


def test_eviction_policy_is_pluggable():
    class EvictDeepestFirst:
        def rank(self, node):
            return (-node.depth,)

    pool = BlockPool(8)
    cache = RadixCache(1, pool.ref_cnt, EvictDeepestFirst())
    a = cache.insert(None, (1,), 1)
    cache.insert(a, (2,), 2)
    b = cache.insert(None, (9,), 3)
    for block in (1, 2, 3):
        cache.on_released(block)
    assert cache.evict(1) == [2]
    assert b.block_id == 3 and cache.num_evictable == 2


def test_a_cached_block_read_after_release_is_evicted_after_older_ones():
    pool = BlockPool(8)
    cache = RadixCache(2, pool.ref_cnt)
    for block, key in ((1, (1, 2)), (2, (3, 4)), (3, (5, 6))):
        cache.insert(None, key, block)
        cache.on_released(block)  # released in the order 1, 2, 3
    cache.match([1, 2], 1)  # block 1 is read again (a lookup that then was not admitted)
    cache.check_invariants()
    assert cache.evict(2) == [2, 3]
    assert cache.evict(5) == [1]
    cache.check_invariants()


def test_a_parent_becomes_evictable_when_its_last_child_goes():
    pool = BlockPool(8)
    cache = RadixCache(1, pool.ref_cnt)
    a = cache.insert(None, (1,), 1)
    cache.insert(a, (2,), 2)
    cache.on_released(2)
    cache.on_released(1)
    assert cache.evict(2) == [2, 1]  # the child first, then the parent it left a leaf
    assert cache.num_cached_blocks == 0


def test_eviction_order_stays_small_under_reference_churn():
    """Taking and releasing a cached block over and over (a shared system prompt) must not
    grow the eviction heap without bound."""
    pool = BlockPool(8)
    cache = RadixCache(1, pool.ref_cnt)
    for block in (1, 2):
        cache.insert(None, (block,), block)
        cache.on_released(block)
    for _ in range(10_000):
        pool.ref_cnt[1] = 1
        cache.on_referenced(1)
        pool.ref_cnt[1] = 0
        cache.on_released(1)
    cache.check_invariants()
    assert len(cache._heap) <= 2 * cache.num_evictable + 65
    assert cache.evict(2) == [2, 1]  # block 1 was released last
