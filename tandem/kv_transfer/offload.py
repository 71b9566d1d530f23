"""KVTiers: the engine's connector to its KV tiers (tiers.py), fastest first.

    n = tiers.num_loadable(request, start, end)  # the scheduler's question (core/kv_load.py)
    tiers.start(plan.kv_loads)                   # fetch off the step loop, a thread per kind
    for load, payloads in tiers.finished(): ...  # leading blocks that arrived; [] when none
    tiers.store([(hash, payload), ...])          # write-through: host now, disk/Redis behind

Loads are asynchronous: a request waits, LOADING_KV, while a thread reads its blocks (host
memory, then disk, then Redis, each taking up where the faster one ran out) and checks them;
a load past `load_timeout` is given up and its tokens computed instead. Stores copy every
block the engine computes down every tier (write-through, so a prefix is in the shared tier
when another instance asks, and on disk when this one restarts): host memory at once, the
slow tiers on a writer thread whose backlog is bounded (past it, stores are dropped, never
waited for).

A hit shorter than `min_tokens` is not loaded: for a short prefix a lookup and a load cost
more than computing it, the complaint users have of tiers that are slower than recompute.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import replace

from tandem.core.block_hash import BlockHasher
from tandem.core.kv_load import KVLoad
from tandem.core.request import Request
from tandem.kv_transfer.tiers import LoadStats, TierStats, loadable_tokens

log = logging.getLogger("tandem")

_MEMO_SECONDS = 1.0  # a lookup's answer is reused this long (a request waiting for room)
_MAX_STORE_BACKLOG = 256 << 20  # bytes queued for the slow tiers before stores are dropped


class KVTiers:
    def __init__(
        self,
        tiers: list,
        hasher: BlockHasher,
        min_tokens: int = 256,
        load_timeout: float = 2.0,
        clock=time.monotonic,
    ) -> None:
        self.tiers, self.hasher, self.clock = tiers, hasher, clock
        self.block_size = hasher.block_size
        self.min_tokens, self.load_timeout = min_tokens, load_timeout
        self.host = next((t for t in tiers if t.stats.name == "host"), None)
        self.slow = [t for t in tiers if t is not self.host]
        self.stats = LoadStats()
        self.load_seconds: list[float] = []  # per load since the last stats
        self._loader = cf.ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        self._writer = cf.ThreadPoolExecutor(1, thread_name_prefix="kv-store")
        self._loads: dict[str, tuple[KVLoad, cf.Future, float, float]] = {}
        self._memo: OrderedDict[tuple, tuple[float, int]] = OrderedDict()
        self._backlog = 0
        self._lock = threading.Lock()

    def describe(self) -> str:
        return ", ".join(t.stats.name for t in self.tiers)

    # ---- the scheduler's question -----------------------------------------------------
    def num_loadable(self, request: Request, start: int, end: int) -> int:
        bs = self.block_size
        first, last = start // bs, end // bs
        if (last - first) * bs < self.min_tokens:
            return 0  # even all of it would be worth recomputing
        key = (request.request_id, first, last)
        now = self.clock()
        memo = self._memo.get(key)
        if memo is not None and now - memo[0] < _MEMO_SECONDS:
            return memo[1]
        hashes = self.hasher.hashes(request, last)[first:]
        tokens = loadable_tokens(self.tiers, hashes, bs, self.min_tokens)
        self.stats.lookups += 1
        self.stats.lookup_hits += bool(tokens)
        self._memo[key] = (now, tokens)
        while len(self._memo) > 4096:
            self._memo.popitem(last=False)
        return tokens

    # ---- loads --------------------------------------------------------------------------
    def start(self, loads: list[KVLoad]) -> None:
        now = self.clock()
        for load in loads:
            future = self._loader.submit(self._fetch, load.hashes)
            self._loads[load.request_id] = (load, future, now + self.load_timeout, now)
            self.stats.loads += 1

    def load_now(self, load: KVLoad) -> list:
        """One load, waited for (at most load_timeout): the payloads that arrived."""
        t0 = self.clock()
        self.stats.loads += 1
        try:
            payloads = self._loader.submit(self._fetch, load.hashes).result(self.load_timeout)
        except cf.TimeoutError:
            self.stats.timeouts += 1
            payloads = []
        except Exception:
            log.exception("kv tiers: loading request %s's prefix failed", load.request_id)
            payloads = []
        self.load_seconds.append(self.clock() - t0)
        self.stats.loaded_tokens += len(payloads) * self.block_size
        return payloads

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def finished(self) -> list[tuple[KVLoad, list]]:
        """Loads that ended (done, failed or past their deadline): each with the payloads
        of its leading blocks that arrived sound."""
        if not self._loads:
            return []
        done, now = [], self.clock()
        for rid, (load, future, deadline, started) in list(self._loads.items()):
            if future.done():
                try:
                    payloads = future.result()
                except Exception:  # a tier's bug: the tokens are computed instead
                    log.exception("kv tiers: loading request %s's prefix failed", rid)
                    payloads = []
            elif now > deadline:
                log.warning("kv tiers: request %s's load passed %g s; computing it instead",
                            rid, self.load_timeout)  # fmt: skip
                self.stats.timeouts += 1
                payloads = []
            else:
                continue
            del self._loads[rid]
            self.load_seconds.append(now - started)
            self.stats.loaded_tokens += len(payloads) * self.block_size
            done.append((load, payloads))
        return done

    def wait(self, timeout: float) -> None:
        """Block until a load ends or its deadline passes, at most timeout seconds."""
        if not self._loads:
            return
        due = min(d for _, _, d, _ in self._loads.values()) - self.clock()
        futures = [f for _, f, _, _ in self._loads.values()]
        cf.wait(futures, max(0.0, min(timeout, due)), return_when=cf.FIRST_COMPLETED)

    def _fetch(self, hashes: list[bytes]) -> list:
        out: list = []
        for tier in self.tiers:
            rest = hashes[len(out) :]
            if not rest:
                break
            k = tier.contains(rest)
            got = []
            for payload in tier.get(rest[:k]) if k else ():
                if payload is None:
                    break
                got.append(payload)
            if got and tier is not self.host and self.host is not None:
                self.host.put(list(zip(rest, got)))  # the next hit is in memory
            out += got
            if len(got) < k:
                break  # a gap: what follows it cannot be used
        return out

    # ---- stores ---------------------------------------------------------------------
    def store(self, items: list[tuple[bytes, object]]) -> None:
        """Keep a copy of computed blocks, (hash, payload) each, in every tier."""
        if self.host is not None:
            self.host.put(items)
        if not self.slow:
            return
        size = sum(memoryview(p).nbytes for _, p in items)
        with self._lock:
            if self._backlog + size > _MAX_STORE_BACKLOG:
                self.stats.stores_dropped += len(items)
                return
            self._backlog += size
        self._writer.submit(self._write, items, size)

    def _write(self, items, size: int) -> None:
        try:
            for tier in self.slow:
                tier.put(items)
        except Exception:
            log.exception("kv tiers: writing %d blocks failed", len(items))
        finally:
            with self._lock:
                self._backlog -= size

    def flush(self, timeout: float = 10.0) -> None:
        """Wait for the stores queued so far to be written (tests, shutdown)."""
        self._writer.submit(lambda: None).result(timeout)

    def tier_stats(self) -> list[TierStats]:
        return [replace(t.stats) for t in self.tiers]

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._writer.shutdown(wait=False)
        for tier in self.tiers:
            close = getattr(tier, "close", None)
            if close is not None:
                close()
