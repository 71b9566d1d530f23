"""BlockPool: a fixed set of KV blocks with reference counts.

Block 0 is the null block: never allocated, it pads block tables so they need no sentinel.
A block is in exactly one state: free (ref 0, on the free list), in use (ref > 0), or cached
(ref 0, held by the prefix cache until evicted). The pool tracks the first two; the prefix
cache reports the third so `check_invariants` can see the whole.
"""

from __future__ import annotations

from collections import deque

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def take(self, n: int) -> list[int]:
        """n blocks off the free list with ref 1. The caller checks num_free first."""
        assert n <= len(self.free_ids), "take() beyond the free list: check num_free first"
        ids = [self.free_ids.popleft() for _ in range(n)]
        for b in ids:
            self.ref_cnt[b] = 1
        return ids

    def incref(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.ref_cnt[b] += 1

    def decref(self, block_ids: list[int]) -> list[int]:
        """Drop one reference from each block; return the blocks that reached zero."""
        released = []
        for b in block_ids:
            assert self.ref_cnt[b] > 0, f"block {b} freed more often than taken"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                released.append(b)
        return released

    def put_free(self, block_ids: list[int]) -> None:
        self.free_ids.extend(block_ids)

    def check_invariants(self, cached: set[int] = frozenset()) -> None:
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is on the free list twice"
        assert NULL_BLOCK not in free and self.ref_cnt[NULL_BLOCK] == 0, "null block handed out"
        for b in range(1, self.num_blocks):
            in_use = self.ref_cnt[b] > 0
            states = (b in free) + in_use + (b in cached and not in_use)
            assert self.ref_cnt[b] >= 0, f"block {b} has negative refs"
            assert not (b in free and b in cached), f"block {b} both free and cached"
            assert states == 1, f"block {b} is in {states} states (ref={self.ref_cnt[b]})"
