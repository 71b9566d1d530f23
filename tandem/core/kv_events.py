"""KV cache events for external routers, in vLLM's wire format (its `kv_events.py`): which
blocks an instance's prefix cache holds, as they are stored and removed, so a KV-aware
router (llm-d's, Dynamo's, tandem's own) can place a request where its prefix is instead of
estimating it.

A batch is `[ts, [event, ...], data_parallel_rank?]`, each event a tagged array:
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`,
`["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]` (msgpack, msgspec's
array_like layout, the one vLLM's example subscriber decodes). A block's hash is the first
8 bytes of its BlockHasher chain hash as an unsigned int: it covers the whole prefix, the
model, the adapter and the cache salt, so the same prefix has the same hash on every instance
of the same model. The events are collected here, in the KV manager's thread, with no I/O;
the engine's publisher (engine/kv_event_publisher.py) sends them.
"""

from __future__ import annotations

import time

import msgspec

from tandem.core.block_hash import BlockHasher
from tandem.core.request import Request


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class KVEventLog:
    def __init__(self, hasher: BlockHasher, medium: str = "CPU") -> None:
        self.hasher, self.medium = hasher, medium
        self.events: list[KVCacheEvent] = []
        self._hashes: dict[int, int] = {}  # cached block id -> its hash, for BlockRemoved

    def stored(self, request: Request, index: int, block_id: int, parent_id: int | None) -> None:
        """The request's block `index` went into the radix tree as block_id, under parent_id
        (None: the root). A block that extends the last event's run joins it."""
        bs = self.hasher.block_size
        digest = self.hasher.hashes(request, index + 1)[index]
        h = int.from_bytes(digest[:8], "big")
        self._hashes[block_id] = h
        parent = None if parent_id is None else self._hashes.get(parent_id)
        tokens = request.all_token_ids[index * bs : (index + 1) * bs]
        lora = request.lora_id or None
        last = self.events[-1] if self.events else None
        if (
            isinstance(last, BlockStored)
            and last.block_hashes[-1] == parent
            and last.lora_id == lora
        ):
            last.block_hashes.append(h)
            last.token_ids.extend(tokens)
        else:
            self.events.append(BlockStored([h], parent, list(tokens), bs, lora, self.medium))

    def removed(self, block_ids: list[int]) -> None:
        hashes = [self._hashes.pop(b) for b in block_ids if b in self._hashes]
        if hashes:
            self.events.append(BlockRemoved(hashes, self.medium))

    def cleared(self) -> None:
        """Nothing is cached any more."""
        self._hashes.clear()
        self.events.append(AllBlocksCleared())

    def take(self) -> KVEventBatch | None:
        """The events since the last call, as one batch; None when there are none."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return KVEventBatch(time.time(), events)
