"""The CPU KV pool: zeros that take memory only where written, in plain pages (a huge-page
advice made first writes stall in the kernel's memory compaction)."""

from __future__ import annotations

import numpy as np
import torch

from tandem.runner.model_runner import zeroed_pool

MB = 1 << 20


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def mapping_field(address: int, field: str) -> list[str]:
    """A field of the mapping holding `address` (/proc/self/smaps), e.g. VmFlags or Rss."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == f"{field}:":
                return line.split()[1:]
    raise AssertionError("no mapping holds the pool")


def resident_bytes(pool: torch.Tensor) -> int:
    """How much of the mapping holding `pool` is in memory."""
    size, unit = mapping_field(pool.data_ptr(), "Rss")
    assert unit == "kB"
    return int(size) * 1024


def _mapping_flags(address: int) -> list[str]:
    return mapping_field(address, "VmFlags")


def test_the_pool_is_zeros_and_takes_memory_only_where_written():
    before = _rss()
    pool = zeroed_pool((8192, 16, 8, 64), torch.float32, torch.device("cpu"))  # 256 MiB
    assert pool.shape == (8192, 16, 8, 64) and pool.dtype == torch.float32
    assert pool.is_contiguous() and pool[::1024].abs().sum().item() == 0.0
    assert _rss() - before < 32 * MB  # not written: not resident
    pool[:2048] = 1.0  # 64 MiB written
    assert pool[2047].sum().item() == 16 * 8 * 64 and pool[2048].abs().sum().item() == 0
    assert 56 * MB < _rss() - before < 128 * MB


def test_the_pool_is_not_advised_for_huge_pages():
    pool = zeroed_pool((2048, 16, 8, 64), torch.bfloat16, torch.device("cpu"))  # 32 MiB
    middle = pool.data_ptr() + pool.nbytes // 2
    assert "hg" not in _mapping_flags(middle)  # MADV_HUGEPAGE shows as "hg"
    # numpy's zeros, which the pool used to be, are advised so (all but the first page): the
    # check can tell
    advised = np.zeros(32 * MB, dtype=np.uint8)
    assert "hg" in _mapping_flags(advised.ctypes.data + 16 * MB)
