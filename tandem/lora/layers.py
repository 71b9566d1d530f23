"""LoRALinear: a projection plus, for each token, the low-rank update of its own adapter.

Every adapter slot holds A (all shards of a fused projection stacked: [slots, shards * R, in])
and each shard's B, transposed ([slots, R, out], scaled); unused ranks and modules are zeros.
On the CPU the few-token slots go through a C++ kernel instead (model/kernels/lora_bgmv.cpp:
each token reads its own adapter in place, in the model's dtype); where it is not built,
weights are float32, since torch's CPU bmm is ~3x faster in float32 than in bfloat16 at these
shapes (a batch of matrix-vector products), twice the bytes notwithstanding. A step's
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
    # [S, m] (padding repeats token 0), and which of the S * m entries are real (None: all)
    pad_slots: torch.Tensor | None
    pad_index: torch.Tensor | None
    pad_valid: torch.Tensor | None
    pad_tokens: torch.Tensor | None  # the real entries' token indices, in entry order
    # when the padded entries are every token of the step once: entry of each token
    pad_inverse: torch.Tensor | None
    # (slot, token indices, or None when the slot has every token of the step in order)
    groups: list[tuple[int, torch.Tensor | None]]
    # with the C++ kernel instead of the padded layout: each token's slot (-1: none here)
    token_slots: torch.Tensor | None = None


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
        self,
        base: nn.Module,
        shard_outs: list[int],
        slots: int,
        rank: int,
        dtype,
        device,
        kernel=None,
    ) -> None:
        super().__init__()
        self.base, self.shard_outs, self.rank = base, shard_outs, rank
        self.kernel = kernel  # kernels.lora_bgmv, where built
        fan_in = base.in_features
        self.a = torch.zeros(slots, len(shard_outs) * rank, fan_in, dtype=dtype, device=device)
        self.bt = [torch.zeros(slots, rank, o, dtype=dtype, device=device) for o in shard_outs]

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
        self.bt[shard][slot].zero_()
        if a is not None:
            r = a.shape[0]
            self.a[slot, shard * self.rank : shard * self.rank + r] = a
            self.bt[shard][slot, :r] = b.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        ctx = _ctx
        if ctx is None:
            return y
        if ctx.token_slots is not None:
            self.kernel(y, x.contiguous(), self.a, self.bt, ctx.token_slots)
        if ctx.pad_index is not None:
            a = self.a if ctx.pad_slots is None else self.a[ctx.pad_slots]
            xs = x[ctx.pad_index].to(a.dtype)  # [S, m, in]
            h = torch.bmm(xs, a.transpose(1, 2))  # [S, m, shards * R]
            d = self._up(h, ctx.pad_slots, batched=True).flatten(0, 1).to(y.dtype)  # [S*m, out]
            d = d if ctx.pad_valid is None else d[ctx.pad_valid]  # the real entries
            if ctx.pad_inverse is not None:  # every token once: a gather, not a scatter
                y += d[ctx.pad_inverse]
            else:
                y.index_add_(0, ctx.pad_tokens, d)
        for slot, idx in ctx.groups:
            xs = (x if idx is None else x[idx]).to(self.a.dtype)
            d = self._up(xs @ self.a[slot].T, slot).to(y.dtype)
            if idx is None:  # every token: no gather, no scatter
                y += d
            else:
                y.index_add_(0, idx, d)
        return y

    def _up(self, h: torch.Tensor, slots, batched: bool = False) -> torch.Tensor:
        """h [.., shards * R] through each shard's B, the shards side by side [.., out]."""
        r, outs = self.rank, []
        for i, bt in enumerate(self.bt):
            hi = h[..., i * r : (i + 1) * r]
            if batched:
                outs.append(torch.bmm(hi, bt if slots is None else bt[slots]))
            else:
                outs.append(hi @ bt[slots])
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
