"""The shared-memory all-reduce between real processes: every rank gets the same sum, to
the bit, call after call (the slots alternate); a rank that never arrives is a timeout naming
it, and a dead one fails the wait as soon as the liveness check says so."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import pytest
import torch

from tandem.distributed.shm import ShmAllReduce, ShmTimeout


def _rank(path: str, rank: int, world: int, calls: int, out) -> None:
    torch.manual_seed(rank)
    shm = ShmAllReduce(path, rank, world, 1 << 16, create=False)
    sums = []
    for i in range(calls):
        x = torch.randn(3 + i % 5, 16)  # shapes change call to call, as steps' token counts do
        sums.append(shm.all_reduce(x.clone(), lambda: None, 10.0).numpy().copy())
    out.put((rank, sums))  # numpy: pickled by value


def test_every_rank_gets_the_same_sum_to_the_bit_over_many_calls(tmp_path):
    path, world, calls = f"/dev/shm/tandem-test-{uuid.uuid4().hex[:8]}", 3, 200
    owner = ShmAllReduce(path, 0, world, 1 << 16, create=True)  # the creator: rank 0 below
    try:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(path, r, world, calls, out)) for r in (1, 2)]
        for p in procs:
            p.start()
        torch.manual_seed(0)
        mine = []
        for i in range(calls):
            x = torch.randn(3 + i % 5, 16)
            mine.append(owner.all_reduce(x.clone(), lambda: None, 10.0))
        got = dict(out.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(10)
    finally:
        os.unlink(path)
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    for i in range(calls):
        parts = [torch.randn(3 + i % 5, 16, generator=g) for g in gens]
        want = parts[0] + parts[1] + parts[2]  # in rank order, as every rank sums
        assert torch.equal(mine[i], want)
        assert (got[1][i] == want.numpy()).all() and (got[2][i] == want.numpy()).all()


def test_a_rank_that_never_arrives_is_a_timeout_naming_it():
    path = f"/dev/shm/tandem-test-{uuid.uuid4().hex[:8]}"
    shm = ShmAllReduce(path, 0, 2, 1 << 12, create=True)
    try:
        with pytest.raises(ShmTimeout, match=r"ranks \[1\] did not reach all-reduce 1 in 0.2 s"):
            shm.all_reduce(torch.ones(4), lambda: None, 0.2)
    finally:
        os.unlink(path)


def test_a_dead_rank_fails_the_wait_through_the_liveness_check():
    path = f"/dev/shm/tandem-test-{uuid.uuid4().hex[:8]}"
    shm = ShmAllReduce(path, 0, 2, 1 << 12, create=True)

    def dead():
        raise RuntimeError("rank 1 (pid 42) was killed by signal 9")

    try:
        with pytest.raises(RuntimeError, match="killed by signal 9"):
            shm.all_reduce(torch.ones(4), dead, 60.0)
    finally:
        os.unlink(path)
