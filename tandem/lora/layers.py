"""LoRALinear: a projection plus, for each token, the low-rank update of its own adapter.

Every adapter slot holds A (all shards of a fused projection stacked: [slots, shards * R, in])
and each shard's B ([slots, out, R], scaled); unused ranks and modules are zeros. A step's
`LoRAContext` says which tokens use which slot, in two forms chosen per step:

- padded: the tokens of the slots that have few (decodes), laid out [slots, m, in] and run
  through two batched matmuls, reading each adapter's weights once (BGMV-like);
- groups: each slot with many tokens (a prefill chunk) on its own, two plain matmuls.

Base-model tokens take no work. benchmarks/multi_lora.py measures both layouts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LoRAContext:
    # padded: slots [S] (index into the slot tensors; None = all slots in order), token index
    # [S, m] (T = a zero row for padding), and the flat positions of real tokens in [S * m]
    pad_slots: torch.Tensor | None
    pad_index: torch.Tensor | None
    pad_valid: torch.Tensor | None
    groups: list[tuple[int, torch.Tensor]]  # (slot, token indices)


_ctx: LoRAContext | None = None


@contextlib.contextmanager
def lora_context(ctx: LoRAContext | None):
    global _ctx
    _ctx = ctx
    try:
        yield
    finally:
        _ctx = None


class LoRALinear(nn.Module):
    def __init__(
        self, base: nn.Module, shard_outs: list[int], slots: int, rank: int, dtype, device
    ) -> None:
        super().__init__()
        self.base, self.shard_outs, self.rank = base, shard_outs, rank
        fan_in = base.in_features
        self.a = torch.zeros(slots, len(shard_outs) * rank, fan_in, dtype=dtype, device=device)
        self.b = [torch.zeros(slots, o, rank, dtype=dtype, device=device) for o in shard_outs]
        self.offsets = [sum(shard_outs[:i]) for i in range(len(shard_outs))]

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def set_slot(self, slot: int, shard: int, a: torch.Tensor | None, b: torch.Tensor | None):
        """Load one shard's (A [r, in], B [out, r]) into a slot; None clears it."""
        rows = slice(shard * self.rank, (shard + 1) * self.rank)
        self.a[slot, rows].zero_()
        self.b[shard][slot].zero_()
        if a is not None:
            r = a.shape[0]
            self.a[slot, shard * self.rank : shard * self.rank + r] = a
            self.b[shard][slot, :, :r] = b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        ctx = _ctx
        if ctx is None:
            return y
        r = self.rank
        if ctx.pad_index is not None:
            a = self.a if ctx.pad_slots is None else self.a[ctx.pad_slots]
            xs = torch.cat([x, x.new_zeros(1, x.shape[1])])[ctx.pad_index]  # [S, m, in]
            h = torch.bmm(xs, a.transpose(1, 2))  # [S, m, shards * R]
            flat = ctx.pad_index.flatten()[ctx.pad_valid]
            for i, (b, off, out) in enumerate(zip(self.b, self.offsets, self.shard_outs)):
                b = b if ctx.pad_slots is None else b[ctx.pad_slots]
                d = torch.bmm(h[:, :, i * r : (i + 1) * r], b.transpose(1, 2))  # [S, m, out]
                y[:, off : off + out].index_add_(0, flat, d.flatten(0, 1)[ctx.pad_valid])
        for slot, idx in ctx.groups:
            h = x[idx] @ self.a[slot].T  # [n, shards * R]
            for i, (b, off, out) in enumerate(zip(self.b, self.offsets, self.shard_outs)):
                y[:, off : off + out].index_add_(0, idx, h[:, i * r : (i + 1) * r] @ b[slot].T)
        return y
