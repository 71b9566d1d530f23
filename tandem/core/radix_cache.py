"""RadixCache: a tree over KV blocks keyed by token ids, one full block per edge.

A path from the root spells a token prefix; each node holds the block whose KV covers that
node's tokens given the path above it. Keys are the block's token ids themselves, so a hit
is confirmed by comparing tokens, not a hash. The tree holds no references: a node whose
block nobody uses (ref 0) and that has no children is evictable, least valuable first as
an `EvictionPolicy` ranks them.

Invariant: an unreferenced node has no referenced descendant (a request holds every block of
its path; the KV manager stops inserting a request's blocks at the first duplicate). So every
unreferenced node is reachable by evicting leaves, and `num_evictable` is a plain count.

Eviction order is kept incrementally in a heap of (rank, node) entries, pushed when a node
becomes an evictable leaf and checked lazily when popped: an entry whose node was referenced
again is dropped, one whose rank grew since (the node was read) is pushed back with its new
rank. Evicting costs O(log n) per block, not a rebuild over every leaf, which matters at the
10^5-block pools the simulator models. Stale entries are compacted once they outnumber the
live ones.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Protocol

# A node no request with a priority has read yet (PriorityEviction's rank treats it as the
# least urgent of all).
NO_PRIORITY = 2**63


class Node:
    __slots__ = ("key", "block_id", "parent", "children", "last_access", "depth", "priority")

    def __init__(self, key: tuple[int, ...], block_id: int, parent: Node | None) -> None:
        self.key = key
        self.block_id = block_id
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.last_access = 0
        self.depth = 0 if parent is None else parent.depth + 1
        # the most urgent (lowest) priority of the requests that computed or read it: it
        # only falls, so a rank built on it only grows
        self.priority = NO_PRIORITY


class EvictionPolicy(Protocol):
    def rank(self, node: Node) -> tuple:
        """Lower ranks are evicted first. A node's rank may only grow over time (as its last
        access does): the heap re-ranks an entry lazily, when it reaches the top."""
        ...


class LRUEviction:
    def rank(self, node: Node) -> tuple:
        # Deeper nodes first among equals: they are the tails of longer prefixes.
        return (node.last_access, -node.depth)


class PriorityEviction:
    """Blocks only less urgent requests used go first (priority as the scheduler reads it:
    lower values are more urgent, as vLLM's), least recently read among equals: a batch
    tenant's prompts never push out an interactive one's (--radix-eviction-policy priority,
    SGLang's flag)."""

    def rank(self, node: Node) -> tuple:
        return (-node.priority, node.last_access, -node.depth)


EVICTION_POLICIES = {"lru": LRUEviction, "priority": PriorityEviction}


class RadixCache:
    def __init__(
        self, block_size: int, ref_cnt: list[int], policy: EvictionPolicy | None = None
    ) -> None:
        self.block_size = block_size
        self.root = Node((), -1, None)
        self.policy = policy or LRUEviction()
        self._ref_cnt = ref_cnt  # the pool's counts, read-only here
        self._nodes: dict[int, Node] = {}  # block id -> node
        self._evictable: set[Node] = set()  # unreferenced leaves
        self._unreferenced: set[Node] = set()  # all unreferenced nodes
        self._heap: list[tuple[tuple, int, Node]] = []  # (rank when pushed, tie, node)
        self._tie = itertools.count()
        self._clock = itertools.count(1)
        self.num_evicted = 0

    # ---- queries -------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._nodes)

    @property
    def num_evictable(self) -> int:
        return len(self._unreferenced)

    def cached_block_ids(self) -> set[int]:
        return set(self._nodes)

    def contains(self, block_id: int) -> bool:
        return block_id in self._nodes

    def match(
        self, token_ids: Sequence[int], max_blocks: int, start: Node | None = None
    ) -> list[Node]:
        """The longest run of cached full blocks spelling token_ids, at most max_blocks."""
        bs, node, path = self.block_size, start or self.root, []
        now = next(self._clock)
        for i in range(max_blocks):
            child = node.children.get(tuple(token_ids[i * bs : (i + 1) * bs]))
            if child is None:
                break
            child.last_access = now
            path.append(child)
            node = child
        return path

    # ---- updates ------------------------------------------------------------
    def insert(self, parent: Node | None, key: tuple[int, ...], block_id: int) -> Node:
        """Record that block_id holds `key` after parent's prefix. If those tokens are cached
        already, the existing node wins and block_id stays the caller's private copy."""
        parent = parent or self.root
        assert len(key) == self.block_size
        node = parent.children.get(key)
        if node is None:
            node = Node(key, block_id, parent)
            parent.children[key] = node
            self._nodes[block_id] = node
            self._evictable.discard(parent)
        node.last_access = next(self._clock)
        return node

    def node_of(self, block_id: int) -> Node | None:
        return self._nodes.get(block_id)

    def on_referenced(self, block_id: int) -> None:
        """The pool took block_id from zero references to one."""
        node = self._nodes.get(block_id)
        if node is not None:
            self._evictable.discard(node)
            self._unreferenced.discard(node)

    def on_released(self, block_id: int) -> None:
        """The pool dropped block_id's last reference."""
        node = self._nodes[block_id]
        node.last_access = next(self._clock)
        self._unreferenced.add(node)
        if not node.children:
            self._add_evictable(node)

    def evict(self, n: int) -> list[int]:
        """Remove up to n unreferenced leaves, lowest rank first; return their block ids."""
        freed: list[int] = []
        while self._heap and len(freed) < n:
            rank, _, node = heapq.heappop(self._heap)
            if node not in self._evictable:
                continue  # referenced again, or no longer a leaf, since it was pushed
            current = self.policy.rank(node)
            if current != rank:  # read since it was pushed: back in line at its new rank
                heapq.heappush(self._heap, (current, next(self._tie), node))
                continue
            self._remove(node)
            freed.append(node.block_id)
            parent = node.parent
            if (
                parent is not self.root
                and not parent.children
                and self._ref_cnt[parent.block_id] == 0
            ):
                self._add_evictable(parent)
        self.num_evicted += len(freed)
        return freed

    def discard(self, block_id: int) -> list[int]:
        """Drop an unreferenced node and the (unreferenced) subtree under it, whatever their
        rank: their KV cannot be trusted. Returns the freed block ids."""
        node = self._nodes[block_id]
        freed, stack = [], [node]
        while stack:
            n = stack.pop()
            assert self._ref_cnt[n.block_id] == 0, "discarding a block in use"
            stack.extend(n.children.values())
            freed.append(n.block_id)
        for b in reversed(freed):  # leaves first, so each is detached from a live parent
            self._remove(self._nodes[b])
        parent = node.parent
        if parent is not self.root and not parent.children and self._ref_cnt[parent.block_id] == 0:
            self._add_evictable(parent)
        return freed

    def clear(self) -> list[int]:
        """Drop every unreferenced node (for reset); return the freed block ids."""
        return self.evict(len(self._nodes))

    def _add_evictable(self, node: Node) -> None:
        self._evictable.add(node)
        heapq.heappush(self._heap, (self.policy.rank(node), next(self._tie), node))
        if len(self._heap) > 2 * len(self._evictable) + 64:  # mostly stale: rebuild, amortized
            self._heap = [(self.policy.rank(x), next(self._tie), x) for x in self._evictable]
            heapq.heapify(self._heap)

    def _remove(self, node: Node) -> None:
        self._evictable.discard(node)
        self._unreferenced.discard(node)
        del node.parent.children[node.key]
        del self._nodes[node.block_id]

    def check_invariants(self) -> None:
        for block_id, node in self._nodes.items():
            assert node.block_id == block_id
            assert node.parent.children.get(node.key) is node, "node detached from its parent"
            free = self._ref_cnt[block_id] == 0
            assert (node in self._unreferenced) == free, (
                f"unreferenced set wrong for block {block_id}"
            )
            assert (node in self._evictable) == (free and not node.children), (
                f"evictable set wrong for block {block_id}"
            )
            if free:
                assert all(self._ref_cnt[c.block_id] == 0 for c in node.children.values()), (
                    f"unreferenced block {block_id} has a referenced child"
                )
        # Every evictable leaf is in the heap at a rank no later than its own.
        queued: dict[Node, tuple] = {}
        for rank, _, node in self._heap:
            if node not in queued or rank < queued[node]:
                queued[node] = rank
        for node in self._evictable:
            assert node in queued, f"evictable block {node.block_id} is not in the heap"
            assert queued[node] <= self.policy.rank(node), f"block {node.block_id} ranked late"
