"""KV tiers in the simulator: the interface of `kv_transfer.offload.KVTiers` on an
instance's virtual clock, with each tier's capacity, bandwidth and latency instead of bytes.

    groups:
      - {name: h100, hardware: H100, count: 4,
         kv_offload_tokens: 2000000, kv_offload_gbs: 25}     # a host-memory tier per instance
    kv_remote: {tokens: 50000000, bandwidth_gbs: 1.2, latency_ms: 0.5}   # one shared Redis

A load of n blocks found in tiers t1, t2... takes sum(latency + bytes / bandwidth) of each
tier it reads (host first, then the shared tier, as the engine reads them); one past the load
timeout ends with nothing, as a real one does, and its tokens are computed. Stores are
write-through and free (the engine copies a step's new blocks after it; on an accelerator
that copy overlaps the next step). The real scheduler and engine loop run unchanged: the
scheduler asks `num_loadable`, the request waits LOADING_KV, the load ends on the clock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tandem.core.block_hash import BlockHasher, model_seed
from tandem.core.kv_load import KVLoad
from tandem.kv_transfer.tiers import LoadStats, TierStats, leading_run, loadable_tokens


@dataclass(frozen=True)
class TierSpec:
    name: str  # host | redis
    tokens: int  # capacity
    bandwidth_gbs: float  # GB/s into the KV pool
    latency_s: float = 0.0  # per load


class SimTier:
    """A tier's contents (block hashes, least recently used first) and its speed."""

    def __init__(self, spec: TierSpec, block_size: int, bytes_per_token: int) -> None:
        self.spec = spec
        self.capacity = max(1, spec.tokens // block_size)
        self.block_bytes = bytes_per_token * block_size
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.stats = TierStats(spec.name)

    def __len__(self) -> int:
        return len(self.blocks)

    def contains(self, hashes: list[bytes]) -> int:
        return leading_run(h in self.blocks for h in hashes)

    def read(self, hashes: list[bytes]) -> float:
        """Seconds to load these blocks (all present); counted as hits."""
        for h in hashes:
            self.blocks.move_to_end(h)
        self.stats.hits += len(hashes)
        self.stats.bytes_loaded += len(hashes) * self.block_bytes
        seconds = self.spec.latency_s + len(hashes) * self.block_bytes / (
            self.spec.bandwidth_gbs * 1e9
        )
        self.stats.load_seconds += seconds
        return seconds

    def put(self, hashes: list[bytes]) -> None:
        for h in hashes:
            if h not in self.blocks:
                self.stats.bytes_stored += self.block_bytes
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
            self.stats.evictions += 1


class SimKVTiers:
    def __init__(self, tiers: list[SimTier], block_size: int, clock, min_tokens: int = 256,
                 load_timeout: float = 2.0) -> None:  # fmt: skip
        self.tiers, self.clock = tiers, clock
        # one seed for the whole cluster: a shared tier's blocks are every instance's
        self.hasher = BlockHasher(model_seed("sim"), block_size)
        self.block_size, self.min_tokens, self.load_timeout = block_size, min_tokens, load_timeout
        self.stats = LoadStats()
        self.load_seconds: list[float] = []
        self._loads: dict[str, tuple[KVLoad, int, float, float]] = {}  # load, blocks, due, start

    def describe(self) -> str:
        return ", ".join(t.spec.name for t in self.tiers)

    def num_loadable(self, request, start: int, end: int) -> int:
        bs = self.block_size
        first, last = start // bs, end // bs
        if (last - first) * bs < self.min_tokens:
            return 0
        hashes = self.hasher.hashes(request, last)[first:]
        tokens = loadable_tokens(self.tiers, hashes, bs, self.min_tokens)
        self.stats.lookups += 1
        self.stats.lookup_hits += bool(tokens)
        return tokens

    def _read(self, hashes: list[bytes]) -> tuple[int, float]:
        n, seconds = 0, 0.0
        for tier in self.tiers:
            k = tier.contains(hashes[n:])
            if k:
                seconds += tier.read(hashes[n : n + k])
                if tier is not self.tiers[0]:
                    self.tiers[0].put(hashes[n : n + k])  # promoted, as the engine does
            n += k
        if seconds > self.load_timeout:
            self.stats.timeouts += 1
            return 0, self.load_timeout
        return n, seconds

    def start(self, loads: list[KVLoad]) -> None:
        now = self.clock()
        for load in loads:
            n, seconds = self._read(load.hashes)
            self._loads[load.request_id] = (load, n, now + seconds, now)
            self.stats.loads += 1

    def finished(self) -> list[tuple[KVLoad, list]]:
        now, done = self.clock(), []
        for rid, (load, n, due, started) in list(self._loads.items()):
            if due <= now:
                del self._loads[rid]
                self.load_seconds.append(due - started)
                self.stats.loaded_tokens += n * self.block_size
                done.append((load, [None] * n))
        return done

    def wait(self, timeout: float) -> None:
        """Idle until the next load ends (at most timeout): the instance's clock moves on."""
        if self._loads:
            due = min(d for _, _, d, _ in self._loads.values())
            self.clock.advance(max(0.0, min(timeout, due - self.clock())))

    def load_now(self, load: KVLoad) -> list:
        n, seconds = self._read(load.hashes)
        self.clock.advance(seconds)
        self.stats.loads += 1
        self.stats.loaded_tokens += n * self.block_size
        return [None] * n

    def store(self, items) -> None:
        hashes = [h for h, _ in items]
        for tier in self.tiers:
            tier.put(hashes)

    def tier_stats(self) -> list[TierStats]:
        return [t.stats for t in self.tiers]
