"""Pinned prefixes: an agent session's KV, held between its turns.

An agent's turn ends, a tool runs for seconds or minutes, and the next turn sends the same
context plus the tool's output. Left to LRU, the context's blocks are evicted during the
pause by other traffic and computed again. A pin holds them: at the end of each turn the
session's owner pins the radix path its tokens spell, until a deadline (the session's TTL
after the turn's end), replacing its previous pin.

A pin is a reference on each block of the path, taken as a running request takes them, so
the radix cache's accounting needs nothing new: a referenced block is never evicted, and
its ancestors are never leaves while it lives. The pinned blocks are bounded (at most
`max_blocks` distinct ones), so ordinary traffic always keeps the rest of the pool; a pin
that would pass the bound holds the longest prefix that fits.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tandem.core.block_pool import BlockPool
from tandem.core.radix_cache import RadixCache


@dataclass
class Pin:
    block_ids: list[int]  # a radix path from the root, in order
    until: float  # the owner's deadline, on the scheduler's clock


class PrefixPins:
    def __init__(self, pool: BlockPool, cache: RadixCache, max_blocks: int) -> None:
        self.pool, self.cache = pool, cache
        self.max_blocks = max_blocks  # distinct blocks all pins together may hold
        self.pins: dict[str, Pin] = {}
        self._count: Counter[int] = Counter()  # block -> pins holding it

    @property
    def num_blocks(self) -> int:
        """Distinct blocks pinned now."""
        return len(self._count)

    @property
    def full(self) -> bool:
        return self.num_blocks >= self.max_blocks

    def pin(self, owner: str, block_ids: list[int], until: float) -> int:
        """Hold a radix path (block ids from the root, every one cached) for `owner` until
        `until`, in place of its previous pin; -> the blocks held (a prefix of the path when
        the bound cuts it)."""
        old = self.pins.pop(owner, None)
        old_blocks = old.block_ids if old else []
        self._count.subtract(old_blocks)  # the owner's own blocks count toward its new pin
        room = self.max_blocks - sum(1 for c in self._count.values() if c > 0)
        keep = []
        for b in block_ids:
            if self._count[b] <= 0:
                if room <= 0:
                    break
                room -= 1
            keep.append(b)
        self._count.update(old_blocks)
        self._hold(keep)  # before the old ones go: a block in both never reaches zero
        self._release(old_blocks)
        if keep:
            self.pins[owner] = Pin(keep, until)
        return len(keep)

    def unpin(self, owner: str) -> int:
        """Drop the owner's pin; -> the blocks it held."""
        pin = self.pins.pop(owner, None)
        if pin is None:
            return 0
        self._release(pin.block_ids)
        return len(pin.block_ids)

    def expire(self, now: float) -> list[str]:
        """Drop every pin whose deadline has passed; -> their owners."""
        gone = [owner for owner, pin in self.pins.items() if pin.until <= now]
        for owner in gone:
            self.unpin(owner)
        return gone

    def holders(self) -> Counter[int]:
        """block -> pins holding it, for the KV manager's reference check."""
        return +self._count

    def _hold(self, block_ids: list[int]) -> None:
        for b in block_ids:
            assert self.cache.contains(b), f"pinning block {b}, which is not cached"
            self._count[b] += 1
            self.pool.ref_cnt[b] += 1
            if self.pool.ref_cnt[b] == 1:
                self.cache.on_referenced(b)

    def _release(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self._count[b] -= 1
            if self._count[b] == 0:
                del self._count[b]
        for b in self.pool.decref(block_ids):
            self.cache.on_released(b)

    def check_invariants(self) -> None:
        held = Counter(b for pin in self.pins.values() for b in pin.block_ids)
        assert held == +self._count, "pin counts differ from the pins"
        assert self.num_blocks <= self.max_blocks, "pins hold more blocks than their bound"
        for owner, pin in self.pins.items():
            nodes = [self.cache.node_of(b) for b in pin.block_ids]
            assert all(n is not None for n in nodes), f"{owner} pins an uncached block"
            assert nodes[0].parent is self.cache.root, f"{owner}'s pin does not start at the root"
            for parent, child in zip(nodes, nodes[1:]):
                assert child.parent is parent, f"{owner}'s pin is not a path"
