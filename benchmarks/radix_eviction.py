"""Cost of one allocation that must evict, as the prefix cache fills a 100,000-block pool.

    python benchmarks/radix_eviction.py [--num-blocks 100000] [--allocs 300]

At each fill level the pool holds N evictable cached blocks and no free ones, so every new
one-block request evicts one. Measured for tandem's RadixCache (eviction order kept in a heap,
updated incrementally) and, on the same work in the same run, for the previous design that
rebuilt a heap over every evictable leaf on each call. Pure Python, no torch.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import time

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.radix_cache import RadixCache
from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams

BLOCK = 16


class RebuildingRadixCache(RadixCache):
    """The previous eviction: a fresh heap over every evictable leaf per call."""

    def evict(self, n: int) -> list[int]:
        tie = itertools.count()
        heap = [(self.policy.rank(x), next(tie), x) for x in self._evictable]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < n:
            _, _, node = heapq.heappop(heap)
            if node not in self._evictable:
                continue
            self._remove(node)
            freed.append(node.block_id)
            parent = node.parent
            if (
                parent is not self.root
                and not parent.children
                and not self._ref_cnt[parent.block_id]
            ):
                self._evictable.add(parent)
                heapq.heappush(heap, (self.policy.rank(parent), next(tie), parent))
        self.num_evicted += len(freed)
        return freed


def _request(ids, num_tokens: int) -> Request:
    start = next(ids) * num_tokens
    return Request(str(start), list(range(start, start + num_tokens)), SamplingParams())


def seconds_per_allocation(cache_cls, num_blocks: int, num_cached: int, allocs: int) -> float:
    kv = KVCacheManager(num_blocks + 1, BLOCK)
    kv.cache = cache_cls(BLOCK, kv.pool.ref_cnt)
    ids = itertools.count()
    for _ in range(num_cached):  # one-block requests that finish: their blocks stay cached
        r = _request(ids, BLOCK)
        assert kv.allocate_slots(r, BLOCK)
        kv.free(r)
    holder = _request(ids, (num_blocks - num_cached) * BLOCK)  # the rest is in use
    assert kv.allocate_slots(holder, holder.num_tokens)
    assert kv.pool.num_free == 0 and kv.num_free_blocks == num_cached
    start = time.perf_counter()
    for _ in range(allocs):
        r = _request(ids, BLOCK)
        assert kv.allocate_slots(r, BLOCK)  # evicts the least recently used block
        kv.free(r)
    elapsed = time.perf_counter() - start
    kv.check_invariants([holder])
    return elapsed / allocs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-blocks", type=int, default=100_000)
    ap.add_argument("--allocs", type=int, default=300)
    args = ap.parse_args()
    n = args.num_blocks
    print(f"pool of {n} blocks of {BLOCK} tokens; microseconds per allocation that evicts")
    print(f"{'cached blocks':>14} {'incremental':>12} {'rebuild':>10} {'ratio':>8}")
    for fraction in (0.01, 0.1, 0.5, 0.99):
        cached = max(1, int(n * fraction))
        new = seconds_per_allocation(RadixCache, n, cached, args.allocs)
        old = seconds_per_allocation(RebuildingRadixCache, n, cached, args.allocs)
        print(f"{cached:>14} {new * 1e6:>12.1f} {old * 1e6:>10.1f} {old / new:>7.1f}x")


if __name__ == "__main__":
    main()
