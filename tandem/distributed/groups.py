"""This process's place among the ranks, and the collectives a step needs, on
torch.distributed: the tensor-parallel all-reduce (shared memory within a node, gloo
otherwise), expert parallelism's all-to-all, the vocabulary gather of the logits to the stage's first rank, the pipeline's
activations from stage to stage, and the driver's broadcast of each step's ledger.

Every collective has a timeout, and every failure surfaces as RankFailed: the ranks are out
of step after one, so no later step may run.
"""

from __future__ import annotations

import os
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.core.runner import RankFailed
from tandem.distributed.layout import ParallelLayout
from tandem.distributed.shm import ShmAllReduce

SHM_MAX_BYTES = 1 << 20  # larger all-reduces (long prefill chunks) take gloo
# A rank waits on the ledger's channel for the next step as long as the server idles (the
# driver's own sends on it are bounded by the collectives' timeout: `_bounded`).
IDLE_TIMEOUT = timedelta(days=365)


class Ranks:
    def __init__(
        self,
        layout: ParallelLayout,
        rank: int,
        store: dist.Store,
        timeout: float,
        node_of: list[int],
        shm_key: str,
        alive=lambda: None,
    ) -> None:
        """node_of[r]: the node rank r runs on (ranks of one node share memory, in a file
        named for shm_key, the launch's own); `alive()` raises where a watched rank has died
        (the driver watches its local workers)."""
        self.layout, self.rank, self.timeout, self.alive = layout, rank, timeout, alive
        self.stage, self.tp_rank = layout.stage_of(rank), layout.tp_rank_of(rank)
        self.first_stage, self.last_stage = self.stage == 0, self.stage == layout.pp - 1
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=layout.world_size,
            timeout=timedelta(seconds=timeout),
        )  # fmt: skip
        self.tp_group = None
        for s in range(layout.pp):  # every rank creates every group, in the same order
            group = dist.new_group(layout.stage_ranks(s), timeout=timedelta(seconds=timeout))
            if s == self.stage:
                self.tp_group = group
        self.control = dist.new_group(list(range(layout.world_size)), timeout=IDLE_TIMEOUT)
        self.stage_root = layout.stage_ranks(self.stage)[0]
        self.shm = None
        stage_ranks = layout.stage_ranks(self.stage)
        if layout.tp > 1 and len({node_of[r] for r in stage_ranks}) == 1:
            self.shm = self._open_shm(shm_key, stage_ranks)
        self.num_shm = self.num_gloo = 0

    def _open_shm(self, key: str, stage_ranks: list[int]) -> ShmAllReduce:
        path = f"/dev/shm/tandem-{key}-stage{self.stage}"
        creator = self.rank == stage_ranks[0]
        shm = ShmAllReduce(path, self.tp_rank, self.layout.tp, SHM_MAX_BYTES, create=creator) if creator else None  # fmt: skip
        dist.barrier(group=self.tp_group)
        shm = shm or ShmAllReduce(path, self.tp_rank, self.layout.tp, SHM_MAX_BYTES, create=False)
        dist.barrier(group=self.tp_group)
        if creator:  # every rank has it mapped: a crash from here on leaves no file behind
            os.unlink(path)
        return shm

    # ---- tensor parallel --------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        try:
            if self.shm is not None and self.shm.fits(x):
                self.num_shm += 1
                return self.shm.all_reduce(x, self.alive, self.timeout)
            self.num_gloo += 1
            dist.all_reduce(x, group=self.tp_group)
            return x
        except RankFailed:
            raise
        except Exception as e:
            raise self._failure("all-reduce", e) from e

    def all_to_all(self, x: torch.Tensor, recv_splits: list[int], send_splits: list[int]):
        """Rows of x to the stage's ranks (send_splits[r] to rank r, in rank order), and the
        rows they send here (recv_splits[r] from rank r): expert parallelism's exchange."""
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        self._call("all-to-all", dist.all_to_all_single, out, x.contiguous(), recv_splits,
                   send_splits, group=self.tp_group)  # fmt: skip
        return out

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """[rows, V/tp] on each rank of the stage -> [rows, V] on its first rank (None on
        the others)."""
        if self.layout.tp == 1:
            return local[:, :vocab_size]
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.layout.tp)] if self.tp_rank == 0 else None  # fmt: skip
        self._call("logits gather", dist.gather, local, parts, dst=self.stage_root, group=self.tp_group)  # fmt: skip
        return torch.cat(parts, dim=-1)[:, :vocab_size] if parts is not None else None

    # ---- pipeline -------------------------------------------------------------------
    def send_activations(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        dst = self.rank + self.layout.tp  # the same tensor-parallel rank, one stage on
        self._call("sending activations", dist.send, torch.stack([x, residual]).contiguous(), dst)

    def recv_activations(self, shape, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.empty((2, *shape), dtype=dtype)
        self._call("receiving activations", dist.recv, both, self.rank - self.layout.tp)
        return both[0], both[1]

    def send_logits(self, logits: torch.Tensor) -> None:
        self._call("sending logits", dist.send, logits.contiguous(), 0)

    def recv_logits(self, rows: int, vocab_size: int) -> torch.Tensor:
        logits = torch.empty((rows, vocab_size), dtype=torch.float32)
        src = self.layout.stage_ranks(self.layout.pp - 1)[0]
        self._call("receiving logits", dist.recv, logits, src)
        return logits

    def gather_parts(self, part) -> list | None:
        """Every rank's `part` (any picklable object), in rank order, on rank 0."""
        parts = [None] * self.layout.world_size if self.rank == 0 else None
        self._call("gathering KV", dist.gather_object, part, parts, dst=0)
        return parts

    # ---- the driver's ledger --------------------------------------------------------
    def broadcast(self, message) -> None:
        """Rank 0: send every rank this message (a step's ledger, or a command). A rank that
        does not take it within the timeout fails the call (gloo's send waits for the
        receiver, and this group's own bound is the idle one)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.int64)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for t in (size, payload):
            self._call("broadcasting the step", self._bounded, dist.broadcast, t, 0, group=self.control)  # fmt: skip

    def _bounded(self, fn, *args, **kwargs) -> None:
        work = fn(*args, **kwargs, async_op=True)
        try:
            done = work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as e:
            if "timed out" not in str(e):
                raise
            done = False
        if not done:
            raise TimeoutError(f"a rank did not take it within {self.timeout:g} s")

    def receive(self):
        """Ranks past 0: the driver's next message (waits as long as the server idles)."""
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.control)
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(payload, 0, group=self.control)
        return pickle.loads(payload.numpy().tobytes())

    def _call(self, what: str, fn, *args, **kwargs):
        self.alive()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise self._failure(what, e) from e

    def _failure(self, what: str, e: Exception) -> RankFailed:
        """The failure to report: a watched rank's death where that is the cause (gloo only
        says a connection closed), else the collective's own error."""
        try:
            self.alive()
        except RankFailed as dead:
            return dead
        return RankFailed(f"rank {self.rank}: {what} failed: {str(e).splitlines()[0][:300]}")

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        if dist.is_initialized():
            dist.destroy_process_group()
