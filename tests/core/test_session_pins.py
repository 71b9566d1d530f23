"""An agent session's prefix pinned between its turns (core/pins.py): it survives pressure
that evicts everything else, its pin grows with the conversation, and it ends on unpin or at
its deadline with every block back in the pool; pins never take more than their share. No
torch: the scheduler harness, invariants checked every step (pins included)."""

from __future__ import annotations

from tests.core.harness import Harness


def turn(h: Harness, prompt: list[int], max_tokens: int = 4):
    r = h.add(prompt, max_tokens=max_tokens)
    h.run_to_completion()
    return r


def flood(h: Harness, n: int = 12) -> None:
    """Distinct prompts that together need the whole pool: LRU evicts every unused block."""
    for i in range(n):
        turn(h, [1000 + 50 * i + j for j in range(20)])


def test_a_pinned_prefix_survives_pressure_that_evicts_an_unpinned_one():
    h = Harness(num_blocks=24, block_size=4)
    agent, other = list(range(100, 113)), list(range(200, 213))  # 13 tokens each
    first = turn(h, agent)
    h.kv.pin_prefix("session-1", first, until=h.clock() + 60)
    turn(h, other)  # the same shape, never pinned
    flood(h)
    # the next turn: the whole conversation so far and the tool's output
    again = turn(h, first.all_token_ids + [300, 301, 302])
    assert again.num_cached_tokens == 16  # every full block of turn one (13 + 4 tokens)
    assert turn(h, other).num_cached_tokens == 0
    assert h.kv.cache.num_evicted > 0


def test_each_turn_replaces_its_sessions_pin_with_the_longer_path():
    h = Harness(num_blocks=32, block_size=4)
    r1 = turn(h, list(range(100, 109)))
    # 9 + 4 tokens, the last never computed (the next turn does): 3 full blocks
    assert h.kv.pin_prefix("s", r1, until=100.0) == 3
    r2 = turn(h, r1.all_token_ids + list(range(400, 407)))
    assert h.kv.pin_prefix("s", r2, until=100.0) == 5  # 13 + 7 + 4 tokens, 23 computed
    assert h.kv.pins.num_blocks == 5 and set(h.kv.pins.pins) == {"s"}
    assert all(h.kv.pool.ref_cnt[b] == 1 for b in h.kv.pins.pins["s"].block_ids)
    h.sched.check_invariants()


def test_unpinning_or_the_deadline_returns_every_block_to_the_pool():
    h = Harness(num_blocks=32, block_size=4)
    a, b = turn(h, list(range(100, 113))), turn(h, list(range(200, 213)))
    h.kv.pin_prefix("a", a, until=h.clock() + 5)
    h.kv.pin_prefix("b", b, until=h.clock() + 50)
    assert h.kv.usage > 0
    assert h.kv.unpin("a") == 4 and h.kv.unpin("a") == 0
    h.clock.advance(10)
    assert h.kv.expire_pins(h.clock()) == []  # b's deadline is later
    h.clock.advance(41)
    assert h.kv.expire_pins(h.clock()) == ["b"]
    h.assert_pool_whole()
    # unpinned, the blocks stay cached (evictable) until the pool needs them
    assert turn(h, list(range(100, 113))).num_cached_tokens == 12


def test_pins_never_hold_more_than_their_share_of_the_pool():
    h = Harness(num_blocks=21, block_size=4, max_pinned_fraction=0.25)  # 20 usable: 5
    long = turn(h, list(range(100, 125)))  # 25 + 4 tokens: 7 full blocks
    assert h.kv.pin_prefix("long", long, until=100.0) == 5  # the longest prefix that fits
    other = turn(h, list(range(200, 213)))
    assert h.kv.pin_prefix("other", other, until=100.0) == 0  # no room for new blocks
    shared = turn(h, list(range(100, 110)))  # the first 2 blocks are long's
    assert h.kv.pin_prefix("shared", shared, until=100.0) == 2  # shared blocks cost nothing
    assert h.kv.pins.full and h.kv.pins.num_blocks == 5
    flood(h)  # ordinary traffic still runs in the other 15 blocks
    h.kv.unpin("long")
    h.kv.unpin("shared")
    h.assert_pool_whole()


def test_a_pin_holds_only_cached_blocks_and_nothing_without_a_prefix_cache():
    h = Harness(num_blocks=32, block_size=4)
    r = turn(h, [5, 6, 7])  # 3 + 4 tokens: one full block
    assert h.kv.pin_prefix("s", r, until=1.0) == 1
    plain = Harness(num_blocks=32, block_size=4, prefix_caching=False)
    r = turn(plain, list(range(100, 113)))
    assert plain.kv.pin_prefix("s", r, until=1.0) == 0 and plain.kv.unpin("s") == 0
    plain.assert_pool_whole()
