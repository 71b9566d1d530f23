"""Whole blocks out of the KV pool and back, for the KV tiers: bytes exact, any dtype, an
8-bit pool's scales with them, into other block ids of another pool."""

from __future__ import annotations

import pytest
import torch

from tandem.runner.kv_transfer import block_layout, export_blocks, import_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_blocks_round_trip_bit_for_bit_into_other_block_ids(dtype):
    shape = (3, 2, 9, 4, 2, 8)  # layers, K/V, blocks, block size, KV heads, head dim
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(
        0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=gen, dtype=torch.uint8
    )
    src = raw.view(dtype)
    eight_bit = dtype in (torch.int8, torch.float8_e4m3fn)
    scales = torch.rand(shape[:-1], generator=gen) if eight_bit else None
    payloads = export_blocks(src, scales, [5, 2, 7])
    assert len(payloads) == 3 and all(isinstance(p, memoryview) for p in payloads)
    dst = torch.zeros_like(raw).view(dtype)
    dst_scales = torch.zeros_like(scales) if eight_bit else None
    import_blocks(dst, dst_scales, [1, 3, 4], [bytes(p) for p in payloads])
    for a, b in zip([5, 2, 7], [1, 3, 4]):
        assert torch.equal(dst[:, :, b].view(torch.uint8), src[:, :, a].view(torch.uint8))
        if eight_bit:
            assert torch.equal(dst_scales[:, :, b], scales[:, :, a])
    untouched = [0, 2, 5, 6, 7, 8]
    assert not dst[:, :, untouched].view(torch.uint8).any()
    assert block_layout(src, scales).endswith("3x2x4x2x8" + ("+scales" if eight_bit else ""))
