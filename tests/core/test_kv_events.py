"""KV cache events in vLLM's wire format (core/kv_events.py): BlockStored as blocks enter the
radix tree, chained by parent hash; BlockRemoved as they are evicted; AllBlocksCleared on a
reset that empties the cache. Read back with plain msgpack, not tandem's classes. No torch."""

from __future__ import annotations

import msgpack
import msgspec

from tandem.core.block_hash import BlockHasher, model_seed
from tandem.core.kv_events import KVEventLog
from tests.core.harness import Harness


def harness(**kw) -> Harness:
    return Harness(
        num_blocks=16, block_size=4, events=KVEventLog(BlockHasher(model_seed("m"), 4)), **kw
    )


def batch(h: Harness) -> list:
    """The events since the last call, as a subscriber decodes them: [ts, events]."""
    b = h.kv.events.take()
    return [] if b is None else msgpack.unpackb(msgspec.msgpack.encode(b))[1]


def run(h: Harness, prompt: list[int], **kw):
    r = h.add(prompt, max_tokens=1, **kw)
    h.run_to_completion()
    return r


def test_a_prompts_blocks_are_stored_in_one_chained_event_with_their_tokens():
    h = harness()
    run(h, list(range(100, 110)))  # 10 tokens, then 1 out: 2 full blocks computed
    (event,) = batch(h)
    tag, hashes, parent, tokens, block_size, lora, medium = event
    assert (tag, parent, tokens, block_size, lora, medium) == (
        "BlockStored",
        None,
        list(range(100, 108)),
        4,
        None,
        "CPU",
    )
    assert len(hashes) == 2 and all(isinstance(x, int) and 0 <= x < 2**64 for x in hashes)
    # a longer prompt sharing them stores only its new blocks, under the last shared one
    run(h, list(range(100, 114)))
    (event,) = batch(h)
    assert event[0] == "BlockStored" and event[2] == hashes[1]
    assert event[3] == list(range(108, 112))
    assert batch(h) == []


def test_hashes_name_the_prefix_the_same_way_in_every_instance_and_per_salt():
    a, b = harness(), harness()
    run(a, list(range(100, 109)))
    run(b, list(range(100, 109)))
    run(b, list(range(100, 109)), cache_salt="tenant")
    first, salted = batch(b)
    assert batch(a)[0][1] == first[1]
    assert set(salted[1]).isdisjoint(first[1]) and salted[2] is None


def test_evicted_blocks_are_removed_and_a_reset_clears_all():
    h = harness()
    run(h, list(range(100, 113)))
    stored = batch(h)[0][1]
    for i in range(8):  # distinct prompts that need the pool back
        run(h, list(range(500 + 20 * i, 513 + 20 * i)))
    events = batch(h)
    removed = [x for e in events if e[0] == "BlockRemoved" for x in e[1]]
    assert set(stored) <= set(removed)
    h.kv.reset_prefix_cache()
    assert batch(h) == [["AllBlocksCleared"]]
    h.assert_pool_whole()
