"""--radix-eviction-policy priority (SGLang's flag): when the pool is short, cached blocks that
only less urgent requests used go first, whatever their age; LRU evicts the oldest. No torch:
the scheduler harness, invariants checked every step."""

from __future__ import annotations

from tandem.core.radix_cache import NO_PRIORITY, LRUEviction, Node, PriorityEviction
from tests.core.harness import Harness


def harness(policy) -> Harness:
    h = Harness(num_blocks=24, block_size=4)
    h.kv.cache.policy = policy
    return h


def run(h: Harness, prompt: list[int], priority: int = 0):
    r = h.add(prompt, priority=priority)
    h.run_to_completion()
    return r


def survivors(policy) -> tuple[int, int]:
    """An urgent request's prompt, then a newer batch one (6 full blocks each), then one that
    needs 6 of them back: -> (urgent's, batch's) blocks still cached."""
    h = harness(policy)
    urgent, batch = list(range(100, 121)), list(range(300, 321))  # 21 + 4 tokens
    run(h, urgent, priority=0)
    run(h, batch, priority=5)
    assert h.kv.pool.num_free == 23 - 12
    run(h, list(range(500, 564)), priority=0)  # 64 + 4 tokens: 17 blocks
    cache = h.kv.cache
    return len(cache.match(urgent, 6)), len(cache.match(batch, 6))


def test_priority_eviction_keeps_the_urgent_prefix_and_lru_keeps_the_newer_one():
    assert survivors(PriorityEviction()) == (5, 0)
    assert survivors(LRUEviction()) == (0, 5)


def test_a_block_takes_the_most_urgent_priority_of_the_requests_that_used_it():
    h = harness(PriorityEviction())
    prompt = list(range(100, 113))
    run(h, prompt, priority=7)
    (node,) = h.kv.cache.match(prompt, 1)
    assert node.priority == 7
    run(h, prompt, priority=2)  # reads it from the cache
    assert node.priority == 2
    run(h, prompt, priority=9)  # a less urgent reader never lowers its standing
    assert node.priority == 2
    untouched = Node((1, 2, 3, 4), 5, None)
    assert untouched.priority == NO_PRIORITY
    assert PriorityEviction().rank(untouched) < PriorityEviction().rank(node)
