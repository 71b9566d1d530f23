"""Rank 0 of a split model: it starts the other ranks, then for each step sends them the
ledger, runs its own stage, and gets the logits it samples from. The engine core's process
is rank 0, so the scheduler and the sampler stay one of each.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import torch
import torch.distributed as dist

from tandem.core.runner import RankFailed
from tandem.distributed import kv_shards
from tandem.distributed.groups import Ranks
from tandem.distributed.launch import (
    WorkerProcesses,
    new_key,
    open_store,
    rendezvous_of,
    wait_for_ranks,
)
from tandem.distributed.placement import cpu_binds, use_cpus
from tandem.distributed.stage import ledger_of, stage_forward

log = logging.getLogger("tandem")

PING_S = 2.0  # an idle server pings the ranks of other nodes this often


class Driver:
    def __init__(self, config, vocab_size: int) -> None:
        self.rdv = rdv = rendezvous_of(config)
        self.vocab_size = vocab_size
        self.runner = self.shard = None  # rank 0's, once loaded (attach)
        self.offsets = None  # where each rank's share starts in a block's payload
        self.last_ping = time.monotonic()
        self.workers = None
        self.ranks = None
        self.restore = None
        self.store = open_store(rdv, is_master=True)
        key = new_key()
        self.store.set("shm_key", key)
        self.store.set("joined/0", f"{socket.gethostname()} {os.getpid()}")
        local = rdv.node_ranks(0)
        binds = cpu_binds(config.cpu_threads_bind, local)
        try:
            if config.distributed_executor_backend == "ray":
                from tandem.distributed.ray_workers import RayWorkers

                self.workers = RayWorkers(config, rdv)
            else:
                self.workers = WorkerProcesses(config, rdv, local[1:], binds)
            wait_for_ranks(self.store, rdv, "joined", "join", self.check_alive)
            self.restore = use_cpus(binds.get(0))
            prefix = dist.PrefixStore("pg", self.store)
            self.ranks = Ranks(rdv.layout, 0, prefix, rdv.timeout, rdv.node_of(), key, self.check_alive)  # fmt: skip
        except BaseException:
            self.close()
            raise
        log.info("distributed: %d ranks (tensor parallel %d x pipeline parallel %d) on %d "
                 "node(s), %s", rdv.layout.world_size, rdv.layout.tp, rdv.layout.pp,
                 rdv.nnodes, config.distributed_executor_backend)  # fmt: skip

    def attach(self, runner, shard) -> None:
        """Rank 0's runner and share, once loaded: the KV calls run on them."""
        self.runner, self.shard = runner, shard

    def wait_loaded(self) -> None:
        wait_for_ranks(self.store, self.rdv, "loaded", "load its weights", self.check_alive)

    def check_alive(self) -> None:
        """Raise RankFailed if a rank this process watches (its children, its Ray actors)
        has died; cheap, so collectives call it while they wait."""
        if self.workers is not None:
            self.workers.check()

    def check_idle(self) -> None:
        """An idle server's look at its ranks: the watched ones' processes, and every few
        seconds a ping that the other nodes' ranks, which no process check reaches, must take
        (their death closes the connection; a hung one times the ping out)."""
        self.check_alive()
        if self.rdv.nnodes > 1 and time.monotonic() - self.last_ping > PING_S:
            self.ranks.broadcast(("ping",))
            self.last_ping = time.monotonic()

    def send_step(self, plan, block_size: int) -> None:
        self.ranks.broadcast(("step", ledger_of(plan, block_size)))

    def forward(self, model, inputs) -> torch.Tensor | None:
        try:
            return stage_forward(model, inputs, self.ranks, self.vocab_size)
        except RankFailed:
            raise
        except Exception as e:  # the other ranks went on without this one: out of step
            raise RankFailed(f"rank 0 failed mid-step: {type(e).__name__}: {e}") from e

    # ---- the KV as one model's (kv_shards.py) ------------------------------------------
    def call(self, name: str, *args) -> list:
        """Run kv_shards.CALLS[name] on every rank; -> the parts, in rank order."""
        self.ranks.broadcast(("call", name, args))
        part = kv_shards.CALLS[name](self.runner, self.shard, *args)
        return self.ranks.gather_parts(part)

    def export_layer(self, block_ids, layer: int, start: int, end: int):
        parts = self.call("export_layer", block_ids, layer, start, end)
        return kv_shards.merge_layer(parts, self.shard.cfg.num_kv_heads)

    def import_layer(self, block_ids, layer: int, start: int, k, v, scales=None) -> None:
        self.call("import_layer", block_ids, layer, start, k, v, scales)

    def export_kv(self, block_ids, start: int, end: int) -> torch.Tensor:
        parts = self.call("export_kv", block_ids, start, end)
        cfg = self.shard.cfg
        return kv_shards.merge_kv(parts, cfg.num_layers, cfg.num_kv_heads)

    def import_kv(self, block_ids, start: int, kv) -> None:
        self.call("import_kv", block_ids, start, kv)

    def kv_layout(self, rank0: str) -> str:
        """A block payload's layout: the ranks' payloads in rank order, each as rank 0's is
        named, of this split (a tier entry of another split is never imported)."""
        return f"{rank0}|tp{self.rdv.layout.tp}xpp{self.rdv.layout.pp}"

    def export_blocks(self, block_ids) -> list[memoryview]:
        parts = self.call("export_blocks", block_ids)
        return [memoryview(b"".join(p[i] for p in parts)) for i in range(len(block_ids))]

    def import_blocks(self, block_ids, payloads) -> None:
        if self.offsets is None:
            sizes = self.call("block_bytes")
            self.offsets = [sum(sizes[:r]) for r in range(len(sizes) + 1)]
        self.call("import_blocks", block_ids, [bytes(p) for p in payloads], self.offsets)

    def close(self) -> None:
        """Stop the other ranks (they exit on the stop message, or are terminated)."""
        if self.ranks is not None:
            try:
                self.check_alive()
                self.ranks.broadcast(("stop",))
            except Exception:  # a rank is gone already; the rest are terminated below
                pass
        if self.workers is not None:
            self.workers.stop()
            self.workers = None
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
        if self.restore is not None:
            self.restore()
            self.restore = None
