"""All-reduce through shared memory, for the ranks of one host (as vLLM's CPU backend does):
a step's all-reduces are small ([rows, hidden]) and many (two a layer), and gloo's round
trips through loopback TCP cost more than the sum itself.

Each rank writes its tensor to its own slot and publishes the call's sequence number in its
flag; once every flag has reached it, each rank sums all slots in rank order, so every rank
gets the same bits. Slots alternate between two buffers by call parity: a rank can start
call n+2 only after every rank published n+1, which each did after reading call n's slots,
so no slot is overwritten while it is read. x86 keeps stores in order, so a flag is never
seen before the data written ahead of it.

A wait spins briefly, then yields the core; it checks `alive()` every few milliseconds and
gives up after `timeout` seconds, so a dead or stuck rank fails the call, never hangs it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import torch

FLAG_BYTES = 64  # one cache line per rank's flag


class ShmTimeout(RuntimeError):
    pass


class ShmAllReduce:
    def __init__(self, path: str, rank: int, world: int, max_bytes: int, create: bool) -> None:
        self.rank, self.world, self.max_bytes = rank, world, max_bytes
        self.slot = max_bytes
        size = world * FLAG_BYTES + 2 * world * self.slot
        if create:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            self.buf = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        # ctypes reads a flag in 0.1 us, numpy and torch in 1.5
        self.flags = (ctypes.c_int64 * (world * FLAG_BYTES // 8)).from_buffer(self.buf)
        self.flag_index = [r * FLAG_BYTES // 8 for r in range(world)]
        self.raw = torch.frombuffer(self.buf, dtype=torch.uint8)
        self.views: dict[tuple, list[torch.Tensor]] = {}  # a view costs 5 us to make
        self.seq = 0

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= self.max_bytes and t.is_contiguous()

    def _slots(self, parity: int, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's slot of this call's buffer, as tensors shaped like t."""
        key = (parity, t.dtype, t.shape)
        views = self.views.get(key)
        if views is None:
            if len(self.views) > 512:  # shapes follow the steps' token counts
                self.views.clear()
            nbytes = t.numel() * t.element_size()
            base = self.world * FLAG_BYTES + parity * self.world * self.slot
            views = [
                self.raw[base + r * self.slot : base + r * self.slot + nbytes].view(t.dtype).view(t.shape)
                for r in range(self.world)
            ]  # fmt: skip
            self.views[key] = views
        return views

    def all_reduce(self, t: torch.Tensor, alive, timeout: float) -> torch.Tensor:
        """Sum `t` over the ranks, in place; -> t."""
        self.seq += 1
        slots = self._slots(self.seq & 1, t)
        slots[self.rank].copy_(t)
        self.flags[self.flag_index[self.rank]] = self.seq
        self._wait(alive, timeout)
        if self.world == 2:
            torch.add(slots[0], slots[1], out=t)
            return t
        t.copy_(slots[0])
        for r in range(1, self.world):
            t.add_(slots[r])
        return t

    def _late(self) -> list[int]:
        return [r for r, i in enumerate(self.flag_index) if self.flags[i] < self.seq]

    def _wait(self, alive, timeout: float) -> None:
        flags, seq, index = self.flags, self.seq, self.flag_index
        spins, deadline = 0, None
        while any(flags[i] < seq for i in index):
            spins += 1
            if spins < 2000:
                continue
            os.sched_yield()
            if spins % 512 == 0:
                alive()
                if deadline is None:
                    deadline = time.monotonic() + timeout
                elif time.monotonic() > deadline:
                    late = [r for r in range(self.world) if flags[r] < seq]
                    raise ShmTimeout(
                        f"ranks {late} did not reach all-reduce {seq} in {timeout:g} s"
                    )

    def close(self) -> None:
        self.flags = self.raw = None
        self.views.clear()
        try:
            self.buf.close()
        except BufferError:  # a tensor view still holds it; the mapping goes with the process
            pass
