"""KVCacheManager: the request-level view of KV blocks (allocation, prefix reuse, release).

The scheduler asks it two questions, "what of this prompt is cached?" and "can this request
get room for n more tokens?", and it answers without side effects when the answer is no.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from tandem.core.block_hash import BlockHasher
from tandem.core.block_pool import BlockPool
from tandem.core.kv_events import KVEventLog
from tandem.core.pins import PrefixPins
from tandem.core.radix_cache import EvictionPolicy, Node, RadixCache
from tandem.core.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class _InsertCursor:
    """Where a request's next full block goes in the tree."""

    node: Node | None = None  # None: the root
    num_blocks: int = 0  # blocks of the request already in (or matched against) the tree
    stopped: bool = False  # hit a duplicate: the rest of the request stays private


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        eviction_policy: EvictionPolicy | None = None,
        hasher: BlockHasher | None = None,
        max_pinned_fraction: float = 0.5,
        events: KVEventLog | None = None,
    ) -> None:
        self.block_size = block_size
        # With KV tiers: names blocks for them, and every block computed here is listed in
        # `_stores` as it is published, for the tiers to keep a copy (write-through).
        self.hasher = hasher
        self._stores: list[tuple[int, bytes]] = []
        self.pool = BlockPool(num_blocks)
        self.cache = (
            RadixCache(block_size, self.pool.ref_cnt, eviction_policy)
            if enable_prefix_caching
            else None
        )
        self.stats = PrefixCacheStats()
        # KV events for external routers (core/kv_events.py): blocks stored and removed
        self.events = events if self.cache is not None else None
        self._cursors: dict[str, _InsertCursor] = {}
        # sessions' prefixes held between turns (core/pins.py), at most this share of the pool
        self.pins = (
            PrefixPins(self.pool, self.cache, int(max_pinned_fraction * self.pool.num_usable))
            if self.cache is not None
            else None
        )
        # Weight updates (RL): each request keys its blocks by the epoch of the weights it was
        # admitted under, so KV computed under older weights never matches a newer request.
        self.weight_epoch = 0

    # ---- capacity ---------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get now: free ones plus evictable cached ones."""
        return self.pool.num_free + (self.cache.num_evictable if self.cache else 0)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached but unused blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.pool.num_usable

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix reuse -----------------------------------------------------------
    def match_prefix(self, request: Request) -> list[Node]:
        """Cached full blocks covering a prefix of the request's tokens. At least the last
        token is left to compute, so the model yields logits to sample from."""
        if request.weight_epoch != self.weight_epoch and not request.block_ids:
            # admitted (or readmitted after preemption) under newer weights: computed anew
            request.weight_epoch, request.block_hashes = self.weight_epoch, []
        if self.cache is None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.cache.match(_keyed(request, request.all_token_ids), max_blocks)

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.stats.queries += num_queried
        self.stats.hits += num_hit

    def new_weight_epoch(self) -> int:
        """New weights: requests admitted from now on match only KV computed under them.
        The old blocks stay until evicted (or reset_prefix_cache); no pin holds them."""
        self.weight_epoch += 1
        self.expire_pins(float("inf"))
        return self.weight_epoch

    # ---- sessions: prefixes pinned between turns -----------------------------------
    def pin_prefix(self, owner: str, request: Request, until: float) -> int:
        """Hold the cached blocks the request's tokens spell (its radix path, whoever
        computed them) for `owner` until `until`, in place of the owner's previous pin;
        -> the blocks held (0 without a prefix cache)."""
        if self.pins is None:
            return 0
        path = self.cache.match(_keyed(request, request.all_token_ids), request.num_tokens)
        return self.pins.pin(owner, [n.block_id for n in path], until)

    def unpin(self, owner: str) -> int:
        return self.pins.unpin(owner) if self.pins is not None else 0

    def expire_pins(self, now: float) -> list[str]:
        return self.pins.expire(now) if self.pins is not None else []

    # ---- allocation ------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        prefix: list[Node] = (),
        publish: bool = True,
        num_unverified: int = 0,
    ) -> bool:
        """Give the request room for num_new_tokens more tokens, after adopting `prefix`
        (cached blocks from match_prefix) if it has none yet. False, changing nothing, when
        the pool is short. With publish=False the new full blocks stay out of the radix tree
        until `publish` (their KV is still to arrive from elsewhere). The last
        `num_unverified` new tokens are drafts (speculative decoding): they get slots but are
        never published, since the model may reject them.

            |<------------------ blocks after the call ------------------->|
            |<- prefix ->|<- request.block_ids[len(prefix):] ->|<- new ->|
            |<-------- num_computed --------->|<-- num_new_tokens -->|
        """
        bs = self.block_size
        num_computed = request.num_computed_tokens + len(prefix) * bs
        num_held = len(request.block_ids) + len(prefix)
        num_new_blocks = max(0, self.blocks_for(num_computed + num_new_tokens) - num_held)
        if not num_new_blocks and not prefix:  # most decode steps: room already held
            if publish and self.cache is not None:
                self._insert_full_blocks(request, num_computed + num_new_tokens - num_unverified)
            return True
        prefix_ids = [n.block_id for n in prefix]
        revived = sum(1 for b in prefix_ids if self.pool.ref_cnt[b] == 0)
        if num_new_blocks > self.num_free_blocks - revived:
            return False

        for node in prefix:
            node.priority = min(node.priority, request.priority)
            self.pool.ref_cnt[node.block_id] += 1
            if self.pool.ref_cnt[node.block_id] == 1:
                self.cache.on_referenced(node.block_id)
        request.block_ids.extend(prefix_ids)
        request.block_ids.extend(self._take(num_new_blocks))
        if self.cache is not None:
            if prefix:
                self._cursors[request.request_id] = _InsertCursor(prefix[-1], len(prefix))
            if publish:
                self._insert_full_blocks(request, num_computed + num_new_tokens - num_unverified)
        return True

    def publish(self, request: Request, num_tokens: int, store: bool = True) -> None:
        """The KV of the request's first num_tokens is in place: let others match it.
        store=False: it came from a KV tier, which holds it already."""
        if self.cache is not None:
            self._insert_full_blocks(request, num_tokens, store)

    def take_stores(self) -> list[tuple[int, bytes]]:
        """(block id, hash) of the blocks published since the last call whose KV the tiers
        should keep: only those still held by a request, so none can be evicted and written
        over before the step's end, when the caller copies them."""
        stores, self._stores = self._stores, []
        ref = self.pool.ref_cnt
        return [(b, h) for b, h in stores if ref[b] > 0 and self.cache.contains(b)]

    def _take(self, n: int) -> list[int]:
        short = n - self.pool.num_free
        if short > 0:
            evicted = self.cache.evict(short)
            assert len(evicted) == short, "evictable count promised more blocks than eviction found"
            self._removed(evicted)
            self.pool.put_free(evicted)
        return self.pool.take(n)

    def _insert_full_blocks(self, request: Request, num_tokens: int, store: bool = True) -> None:
        """Publish the request's blocks that are full once num_tokens are computed. They go in
        at schedule time: a request admitted later in the same step reads them after this
        step's KV write, which precedes attention in every layer."""
        cursor = self._cursors.get(request.request_id)
        if cursor is None:
            cursor = self._cursors[request.request_id] = _InsertCursor()
        bs = self.block_size
        if cursor.stopped or cursor.num_blocks >= num_tokens // bs:  # most steps: none filled
            return
        tokens = request.all_token_ids
        while not cursor.stopped and cursor.num_blocks < num_tokens // bs:
            i = cursor.num_blocks
            block_id = request.block_ids[i]
            key = tuple(_keyed(request, tokens[i * bs : (i + 1) * bs]))
            parent = cursor.node
            node = self.cache.insert(parent, key, block_id)
            node.priority = min(node.priority, request.priority)  # PriorityEviction's
            if node.block_id != block_id:
                cursor.stopped = True
                break
            if self.events is not None:
                self.events.stored(request, i, block_id, parent.block_id if parent else None)
            cursor.node, cursor.num_blocks = node, i + 1
            # An adapter the hasher has no digest of keeps its KV in the pool.
            if store and self.hasher is not None and self.hasher.covers(request.lora_id):
                self._stores.append((block_id, self.hasher.hashes(request, i + 1)[i]))

    # ---- release -------------------------------------------------------------------
    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past its first num_tokens (slots of rejected
        drafts). They were never published, so nobody else holds them."""
        keep = self.blocks_for(num_tokens)
        extra = request.block_ids[keep:]
        if not extra:
            return
        del request.block_ids[keep:]
        assert not any(self.cache and self.cache.contains(b) for b in extra), (
            "trimmed a cached block"
        )
        self.pool.put_free(self.pool.decref(extra))

    def free(self, request: Request, keep_cached: bool = True) -> None:
        """Drop the request's references. Cached blocks stay for reuse until evicted, unless
        `keep_cached` is False (the request failed mid-step: KV it published may be unwritten),
        which drops those nobody else holds from the cache."""
        released = self.pool.decref(list(reversed(request.block_ids)))
        for b in released:
            if self.cache is not None and self.cache.contains(b):
                self.cache.on_released(b)
                if not keep_cached:
                    dropped = self.cache.discard(b)
                    self._removed(dropped)
                    self.pool.put_free(dropped)
            else:
                self.pool.put_free([b])
        request.block_ids = []
        self._cursors.pop(request.request_id, None)

    def reset_prefix_cache(self) -> int:
        """Evict every unreferenced cached block; return how many were freed."""
        if self.cache is None:
            return 0
        freed = self.cache.clear()
        if self.events is not None and freed:
            if self.cache.num_cached_blocks:  # pinned or in use: those stay
                self.events.removed(freed)
            else:
                self.events.cleared()
        self.pool.put_free(freed)
        return len(freed)

    def purge_lora(self, lora_id: int) -> int:
        """Drop every cached block computed with adapter `lora_id` (no request may hold one:
        the caller unloads an adapter nobody uses), so an adapter loaded later under the same
        id never hits the old one's KV; return how many were freed."""
        if self.cache is None or not lora_id:
            return 0
        # its keys: token + (lora_id << 32), salted or not (_keyed)
        roots = [n for key, n in self.cache.root.children.items()
                 if (key[0] >> 32) & 0xFFFFFFFF == lora_id]  # fmt: skip
        freed = [b for node in roots for b in self.cache.discard(node.block_id)]
        self._removed(freed)
        self.pool.put_free(freed)
        return len(freed)

    def _removed(self, block_ids: list[int]) -> None:
        if self.events is not None and block_ids:
            self.events.removed(block_ids)

    @property
    def num_evicted(self) -> int:
        return self.cache.num_evicted if self.cache else 0

    def check_invariants(self, requests: list[Request] | None = None) -> None:
        """Every block is free, held or cached; given every live request, refs equal the
        number of requests holding each block."""
        self.pool.check_invariants(self.cache.cached_block_ids() if self.cache else set())
        if self.cache is not None:
            self.cache.check_invariants()
        if requests is None:
            return
        holders = [0] * self.pool.num_blocks
        if self.pins is not None:
            self.pins.check_invariants()
            for b, n in self.pins.holders().items():
                holders[b] += n
        for r in requests:
            assert len(set(r.block_ids)) == len(r.block_ids), f"{r.request_id} holds a block twice"
            for b in r.block_ids:
                holders[b] += 1
        assert holders == self.pool.ref_cnt, "block refs differ from the requests holding them"


def _keyed(request: Request, tokens: list[int]) -> list[int]:
    """The tokens as the radix tree keys them. A LoRA adapter's KV differs from the base
    model's for the same tokens, so its keys are moved past every token id (ids are below
    2**32) by the adapter's id, and two adapters (or an adapter and the base) never share a
    block; a cache_salt moves them further (64 bits of its digest, past any adapter id), so
    requests share blocks only within one salt, and one weight epoch."""
    shift = request.lora_id << 32
    if request.cache_salt is not None:
        shift += salt_key(request.cache_salt) << 64
    shift += request.weight_epoch << 128  # the weights it runs on (new_weight_epoch)
    return tokens if not shift else [t + shift for t in tokens]


def salt_key(salt: str) -> int:
    """A salt's place in the radix keys: 64 bits of its digest, never 0 (an unsalted key)."""
    digest = hashlib.blake2b(salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | 1
