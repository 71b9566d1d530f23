"""Rank 0 of a split model: it starts the other ranks, then for each step sends them the
ledger, runs its own stage, and gets the logits it samples from. The engine core's process
is rank 0, so the scheduler and the sampler stay one of each.
"""

from __future__ import annotations

import logging
import os
import socket

import torch
import torch.distributed as dist

from tandem.core.runner import RankFailed
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


class Driver:
    def __init__(self, config, vocab_size: int) -> None:
        self.rdv = rdv = rendezvous_of(config)
        self.vocab_size = vocab_size
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

    def wait_loaded(self) -> None:
        wait_for_ranks(self.store, self.rdv, "loaded", "load its weights", self.check_alive)

    def check_alive(self) -> None:
        if self.workers is not None:
            self.workers.check()

    def send_step(self, plan, block_size: int) -> None:
        self.ranks.broadcast(("step", ledger_of(plan, block_size)))

    def forward(self, model, inputs) -> torch.Tensor | None:
        try:
            return stage_forward(model, inputs, self.ranks, self.vocab_size)
        except RankFailed:
            raise
        except Exception as e:  # the other ranks went on without this one: out of step
            raise RankFailed(f"rank 0 failed mid-step: {type(e).__name__}: {e}") from e

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
