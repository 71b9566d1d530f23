"""The KV tiers behind the radix cache: host memory, a local disk directory, a shared Redis.

Each holds block payloads (a block's KV bytes, as the runner exports them) under their block
hash (core/block_hash.py) and answers three calls, from any thread:

    tier.contains(hashes) -> int        # how many of hashes, from the first, it holds
    tier.get(hashes) -> [payload|None]  # None: missing, evicted, corrupt or unreachable
    tier.put([(hash, payload), ...])    # best effort: a full or dead tier drops it

A tier never raises into the engine: whatever goes wrong reading it is a miss, writing it a
drop, and both are counted in `stats`. Disk and Redis keep entries (entry.py: the payload
with its hash, layout and checksum); host memory keeps payloads as they are.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from tandem.kv_transfer.entry import pack, unpack

log = logging.getLogger("tandem")


def leading_run(present) -> int:
    """How many of `present` (truths, in order) are true before the first false."""
    return sum(1 for _ in itertools.takewhile(bool, present))


def loadable_tokens(tiers, hashes: list[bytes], block_size: int, min_tokens: int) -> int:
    """Tokens of the blocks named by hashes, from the first, that the tiers hold together
    (each taking up where a faster one ran out); 0 when fewer than min_tokens."""
    n = 0
    for tier in tiers:
        if n == len(hashes):
            break
        n += tier.contains(hashes[n:])
    return n * block_size if n * block_size >= min_tokens else 0


@dataclass
class TierStats:
    """Cumulative counts for /metrics (blocks, bytes, seconds)."""

    name: str
    hits: int = 0  # blocks read back
    misses: int = 0  # blocks asked for and not read (absent, corrupt, unreachable)
    bytes_loaded: int = 0
    bytes_stored: int = 0
    evictions: int = 0  # blocks dropped for room
    load_seconds: float = 0.0  # time spent reading
    errors: int = 0  # failed calls (a dead Redis, an unreadable file)


@dataclass
class LoadStats:
    """Cumulative, over every tier."""

    lookups: int = 0  # admissions that asked
    lookup_hits: int = 0  # of those, answered with tokens to load
    loads: int = 0
    loaded_tokens: int = 0
    timeouts: int = 0  # loads given up
    stores_dropped: int = 0  # blocks not written to the slow tiers (backlog full)


class HostTier:
    """Payloads in this process's memory, least recently used dropped first."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.stats = TierStats("host")
        self._entries: OrderedDict[bytes, memoryview] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, hashes: list[bytes]) -> int:
        return leading_run(h in self._entries for h in hashes)  # dict reads: no lock

    def get(self, hashes: list[bytes]) -> list:
        t0, out = time.perf_counter(), []
        with self._lock:
            for h in hashes:
                payload = self._entries.get(h)
                if payload is not None:
                    self._entries.move_to_end(h)
                    self.stats.hits += 1
                    self.stats.bytes_loaded += payload.nbytes
                else:
                    self.stats.misses += 1
                out.append(payload)
        self.stats.load_seconds += time.perf_counter() - t0
        return out

    def put(self, items) -> None:
        with self._lock:
            for h, payload in items:
                view = memoryview(payload).cast("B")
                if view.nbytes > self.capacity:
                    continue
                old = self._entries.pop(h, None)
                if old is not None:
                    self._bytes -= old.nbytes
                self._entries[h] = view
                self._bytes += view.nbytes
                self.stats.bytes_stored += view.nbytes
            while self._bytes > self.capacity:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes
                self.stats.evictions += 1


class DiskTier:
    """One file per block in a directory, kept under a size by dropping the least recently
    used. The index is rebuilt from the directory at start (oldest first by mtime; a read
    touches the file), so a restarted server finds what its predecessor wrote."""

    SUFFIX = ".kv"

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, layout: str) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity, self.layout = capacity_bytes, layout
        self.stats = TierStats("disk")
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes
        self._bytes = 0
        files = []
        for path in self.dir.glob(f"*{self.SUFFIX}"):
            try:
                h = bytes.fromhex(path.stem)
                st = path.stat()
            except (ValueError, OSError):
                continue
            files.append((st.st_mtime, h, st.st_size))
        for _, h, size in sorted(files):
            self._index[h] = size
            self._bytes += size
        self._shrink()

    def __len__(self) -> int:
        return len(self._index)

    def _path(self, h: bytes) -> Path:
        return self.dir / f"{h.hex()}{self.SUFFIX}"

    def contains(self, hashes: list[bytes]) -> int:
        return leading_run(h in self._index for h in hashes)

    def get(self, hashes: list[bytes]) -> list:
        t0, out = time.perf_counter(), []
        for h in hashes:
            payload = None
            if h in self._index:
                path = self._path(h)
                try:
                    payload = unpack(h, self.layout, path.read_bytes())
                    if payload is not None:
                        os.utime(path)  # recently used, for the next start's order too
                except OSError:
                    self.stats.errors += 1
                with self._lock:
                    if payload is None:
                        self._forget(h)  # unreadable or corrupt: never asked for again
                    elif h in self._index:
                        self._index.move_to_end(h)
            if payload is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.bytes_loaded += payload.nbytes
            out.append(payload)
        self.stats.load_seconds += time.perf_counter() - t0
        return out

    def put(self, items) -> None:
        for h, payload in items:
            if h in self._index:
                continue
            entry = pack(h, self.layout, payload)
            if len(entry) > self.capacity:
                continue
            path = self._path(h)
            tmp = path.with_suffix(".tmp")
            try:
                tmp.write_bytes(entry)
                os.replace(tmp, path)  # whole or absent, never half-written
            except OSError as e:
                self.stats.errors += 1
                log.warning("kv disk tier: cannot write %s: %s", path, e)
                continue
            with self._lock:
                self._index[h] = len(entry)
                self._bytes += len(entry)
                self.stats.bytes_stored += len(entry)
                self._shrink()

    def _shrink(self) -> None:
        while self._bytes > self.capacity and self._index:
            h = next(iter(self._index))
            self._forget(h)
            self.stats.evictions += 1

    def _forget(self, h: bytes) -> None:
        size = self._index.pop(h, None)
        if size is None:
            return
        self._bytes -= size
        try:
            self._path(h).unlink()
        except OSError:
            pass


class RedisTier:
    """Entries in a Redis server that several instances may share, one key per block.

    Reads are one MGET, lookups one pipeline of EXISTS, writes one pipeline of SETs: a round
    trip each. The pool is bounded; every call has a timeout. After a failure the tier counts
    as down for `retry_s` (every lookup a miss at once, writes dropped), then tries again, so
    a dead Redis costs at most one timeout per retry_s and the server keeps serving."""

    PREFIX = b"tandem:kv:"

    def __init__(
        self,
        url: str,
        layout: str,
        timeout_s: float = 0.5,
        retry_s: float = 5.0,
        max_connections: int = 4,
        ttl_s: int | None = None,
    ) -> None:
        import redis

        self.url, self.layout, self.retry_s, self.ttl_s = url, layout, retry_s, ttl_s
        self.stats = TierStats("redis")
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,  # waiting for a free connection
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
        )
        self._client = redis.Redis(connection_pool=pool)
        self._errors = (redis.RedisError, OSError)
        self._down_until = 0.0

    def _key(self, h: bytes) -> bytes:
        return self.PREFIX + h

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, e: Exception) -> None:
        if self.up:
            log.warning("kv redis tier %s: %s failed (%s); treated as down for %g s",
                        self.url, what, e, self.retry_s)  # fmt: skip
        self.stats.errors += 1
        self._down_until = time.monotonic() + self.retry_s

    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except self._errors as e:
            self._failed("ping", e)
            return False

    def contains(self, hashes: list[bytes]) -> int:
        if not hashes or not self.up:
            return 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self._key(h))
            found = pipe.execute()
        except self._errors as e:
            self._failed("lookup", e)
            return 0
        return leading_run(found)

    def get(self, hashes: list[bytes]) -> list:
        if not hashes:
            return []
        if not self.up:
            self.stats.misses += len(hashes)
            return [None] * len(hashes)
        t0 = time.perf_counter()
        try:
            entries = self._client.mget([self._key(h) for h in hashes])
        except self._errors as e:
            self._failed("read", e)
            entries = [None] * len(hashes)
        out = [unpack(h, self.layout, e) for h, e in zip(hashes, entries)]
        for payload in out:
            if payload is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.bytes_loaded += payload.nbytes
        self.stats.load_seconds += time.perf_counter() - t0
        return out

    def put(self, items) -> None:
        if not items or not self.up:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            size = 0
            for h, payload in items:
                entry = pack(h, self.layout, payload)
                size += len(entry)
                pipe.set(self._key(h), entry, ex=self.ttl_s)
            pipe.execute()
            self.stats.bytes_stored += size
        except self._errors as e:
            self._failed("write", e)

    def close(self) -> None:
        self._client.close()
