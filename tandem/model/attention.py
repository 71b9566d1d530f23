"""Attention over the paged KV cache for a mixed batch of prefill chunks and decodes.

The runner enters `forward_context(meta)` around a forward pass, so models keep the plain
signature `forward(input_ids, positions)`; each attention layer reads the step's metadata.

Per layer: write this step's K and V into their slots, then attend group by group. A group is
a set of rows with a padded query length: single-token rows (decodes) in one group, longer
chunks (prefills) in another, so a long chunk never pads 31 decodes to its length. Keys are
gathered from the cache through block tables, with this step's keys already written, so a
row can read blocks another row fills in the same step. On the CPU the decode group skips the
gather: a C++ kernel (tandem/model/kernels) reads K and V through the block tables in place.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tandem import cpu_isa
from tandem.model.kv_quant import dequantize_kv, quantize_kv


@dataclass
class AttentionGroup:
    token_slice: slice  # this group's rows in the flat token batch
    block_tables: torch.Tensor  # [B, num_blocks] long, null-padded
    mask: torch.Tensor  # [B, Q, L] bool: key visible to query
    context_lens: torch.Tensor  # [B] long: keys each row sees after this step
    query_starts: torch.Tensor  # [B] long: position of each row's first query (CPU)
    scatter_index: (
        torch.Tensor | None
    )  # [tokens] long: flat token -> padded B*Q slot (None: no padding)
    # each row's query length when every row starts at position 0 (no cached context, so a
    # row's keys are its own tokens of this step), else None
    fresh_lens: list[int] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.mask.shape[0], self.mask.shape[1]  # (B, Q)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot for each token's new K/V
    groups: list[AttentionGroup]
    # Called with a layer's index once this step's K/V of that layer is in the cache, so a
    # prefill instance can send each layer while the next ones compute.
    on_layer_written: Callable[[int], None] | None = None


_meta: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata):
    global _meta
    _meta = meta
    try:
        yield
    finally:
        _meta = None


def decode_only() -> AttentionMetadata | None:
    """This step's metadata when every row is one decode token (a single group of query
    length 1) and nobody is told of each layer's KV, else None: the steps a DecodeStack
    (model/decode_stack.py) runs."""
    meta = _meta
    if meta is None or meta.on_layer_written is not None or len(meta.groups) != 1:
        return None
    group = meta.groups[0]
    return meta if group.shape[1] == 1 and group.scatter_index is None else None


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.attend = sdpa_attention  # the runner picks per dtype and device: attention_fn()
        # (q [B, H, D], k_cache, v_cache, block_tables, context_lens, scale) -> [B, H, D]:
        # attention for single-token rows straight from the paged cache, when the runner has one
        self.decode_kernel = None
        # (q [B, Q, H, D], k_cache, v_cache, block_tables, starts, context_lens, scale, k_scale,
        # v_scale) -> [B, Q, H, D]: causal attention for chunks straight from the paged cache,
        # an 8-bit one too (bf16 on AVX512-BF16 CPUs, kernels/prefill_attention.cpp), when the
        # runner has one
        self.prefill_kernel = None
        # (q [T, H, D], k, v [T, KVH, D], lens, scale) -> [T, H * D]: causal attention of
        # chunks that all start at position 0 over their own keys, with no gather and no mask
        # (causal_sdpa), when the runner has one
        self.fresh_attend = None
        # [num_blocks, block_size, kv_heads, head_dim] each; bound by the runner.
        self.k_cache = self.v_cache = torch.empty(0)
        # With an 8-bit cache (kv_quant.py): [num_blocks, block_size, kv_heads] float32 scales
        # of K and V, bound by the runner; None: the cache holds the compute dtype.
        self.k_scale = self.v_scale = None
        self.layer_index = 0  # which layer of the model, set by the runner
        self.fused = None  # the KV write in one call (kernels/fused.cpp), bound by the runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D]
        meta = _meta
        kvh, d = self.num_kv_heads, self.head_dim
        if self.fused is not None:
            self.fused.write_kv(
                self.k_cache, self.v_cache, meta.slot_mapping, k, v, self.k_scale, self.v_scale
            )
        elif self.k_scale is not None:
            for x, cache, scales in ((k, self.k_cache, self.k_scale), (v, self.v_cache, self.v_scale)):  # fmt: skip
                xq, xs = quantize_kv(x, cache.dtype)
                # as bytes: torch's CPU index ops do not take float8
                cache.view(torch.uint8).view(-1, kvh, d).index_copy_(
                    0, meta.slot_mapping, xq.view(torch.uint8)
                )
                scales.view(-1, kvh).index_copy_(0, meta.slot_mapping, xs)
        else:
            self.k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
            self.v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)
        if meta.on_layer_written is not None:
            meta.on_layer_written(self.layer_index)
        outs = [self._attend_group(q, k, v, g) for g in meta.groups]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend_group(self, q, k, v, g: AttentionGroup) -> torch.Tensor:
        b, qlen = g.shape
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        rows = g.token_slice
        if g.fresh_lens is not None and self.fresh_attend is not None:
            return self.fresh_attend(q[rows], k[rows], v[rows], g.fresh_lens, self.scale)
        q = q[rows]
        if qlen == 1 and self.decode_kernel is not None:
            out = self.decode_kernel(
                q, self.k_cache, self.v_cache, g.block_tables, g.context_lens, self.scale,
                self.k_scale, self.v_scale,
            )  # fmt: skip
            return out.view(b, h * d)  # [B, H, D] -> [B, H * D]
        if g.scatter_index is not None:
            padded = q.new_zeros(b * qlen, h, d)
            padded[g.scatter_index] = q
            q = padded
        if self.prefill_kernel is not None:
            out = self.prefill_kernel(
                q.view(b, qlen, h, d), self.k_cache, self.v_cache, g.block_tables,
                g.query_starts, g.context_lens, self.scale, self.k_scale, self.v_scale,
            ).view(b * qlen, h * d)  # fmt: skip
            return out[g.scatter_index] if g.scatter_index is not None else out
        # index_select is ~4x faster than cache[block_tables] on the CPU
        flat = g.block_tables.view(-1)
        if self.k_scale is None:
            k = self.k_cache.index_select(0, flat).view(b, -1, kvh, d)  # [B, L, KVH, D]
            v = self.v_cache.index_select(0, flat).view(b, -1, kvh, d)
        else:
            k, v = (
                dequantize_kv(
                    cache.view(torch.uint8)
                    .index_select(0, flat)
                    .view(cache.dtype)
                    .view(b, -1, kvh, d),
                    scales.index_select(0, flat).view(b, -1, kvh),
                    q.dtype,
                )
                for cache, scales in ((self.k_cache, self.k_scale), (self.v_cache, self.v_scale))
            )
        out = self.attend(q.view(b, qlen, h, d), k, v, g.mask, self.scale)  # [B, Q, H, D]
        out = out.reshape(b * qlen, h * d)
        return out[g.scatter_index] if g.scatter_index is not None else out


def attention_fn(dtype: torch.dtype, device: torch.device, fused=None):
    """The faster formulation for this dtype and device, as measured by
    benchmarks/attention_backends.py: torch's fused SDPA, except for bf16 on the CPU, where
    it is pathological for single-token queries and two grouped matmuls win; between them,
    with the C++ kernels (`fused`, kernels/fused.cpp), one pass for the softmax."""
    if device.type == "cpu" and dtype != torch.float32:
        if dtype == torch.bfloat16 and fused is not None:
            return functools.partial(grouped_attention, softmax=fused.masked_softmax_)
        return grouped_attention
    return sdpa_attention


def amx_sdpa() -> bool:
    """Whether the CPU has AMX, where torch's SDPA (flash attention on oneDNN's AMX brgemm)
    beats the C++ prefill kernel on bf16 chunks from 2 query rows up: 2.2 vs 3.9 ms a layer
    for 8 prompts of 256 tokens, 15 vs 25 for one of 2048, 1.2 vs 1.2 for 16 rows of 4
    queries (an AMX Xeon, `python benchmarks/attention_backends.py --dtype bfloat16`).
    Single-token rows keep the C++ decode kernel."""
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return is_amx is not None and is_amx() and cpu_isa.at_least("amx")


def sdpa_attention(q, k, v, mask, scale):
    """q: [B, Q, H, D]; k, v: [B, L, KVH, D]; mask: [B, Q, L] bool. Returns [B, Q, H, D]."""
    out = nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    )  # [B, H, Q, D]
    return out.transpose(1, 2)


# torch's CPU flash attention runs lengths off a multiple of 16 up to 2x slower (bf16 on an
# AMX Xeon, one causal 9-head layer: 0.22 ms at 256 tokens, 0.33 at 257, 0.27 at 272, 0.50 at
# 273, 0.27 at 288); a chunk is padded to one with zero rows after its last query, which no
# query sees under the causal mask.
CAUSAL_LEN_MULTIPLE = 16


def causal_sdpa(q, k, v, lens, scale):
    """Causal attention of chunks that each start at position 0, over their own keys: SDPA
    with is_causal, which skips the key blocks past each query block, where a mask makes it
    compute every pair and mask half away (a 2048-token prompt's layer: 7.3 vs 14.6 ms in
    bf16, 20 vs 37 in float32 on an AMX Xeon), and needs no gather from the cache. The same
    results as sdpa_attention with the causal mask: to the bit on lengths that are multiples
    of CAUSAL_LEN_MULTIPLE (the skipped blocks add nothing there); on others, which it pads,
    within rounding (the kernel's blocks fall elsewhere and sum in another order: float32
    5e-7 apart at most, bf16 an ulp on 0.04% of the outputs, on the test's case).

    q: [T, H, D]; k, v: [T, KVH, D]; lens: each chunk's tokens, in order. Returns [T, H * D].
    """

    def attend(q, k, v):  # [B, n, heads, D] each
        b, n, h, d = q.shape
        if pad := -n % CAUSAL_LEN_MULTIPLE:  # zero rows after the last query's
            q, k, v = (nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, scale=scale, enable_gqa=True,
        )  # fmt: skip
        return out.transpose(1, 2)[:, :n].reshape(b * n, h * d)

    if len(set(lens)) == 1:  # one batched call
        b, n = len(lens), lens[0]
        return attend(*(x.view(b, n, *x.shape[1:]) for x in (q, k, v)))
    starts = itertools.accumulate(lens, initial=0)
    return torch.cat([attend(q[None, s : s + n], k[None, s : s + n], v[None, s : s + n])
                      for s, n in zip(starts, lens)])  # fmt: skip


# A long chunk's queries attend a block of rows at a time, so that their float32 scores (heads
# x rows x keys) stay small: all at once, a 512-token chunk after 1536 tokens of context made
# 38 MB of scores per layer, past glibc's largest heap block (32 MB), so every layer mapped
# and faulted in fresh pages: 1595 ms a step against 614 ms in blocks (level up to ~1k keys).
# Each query row's result is the same either way, to the bit.
SCORES_BYTES = 8 << 20


def grouped_attention(q, k, v, mask, scale, softmax=None):
    """Softmax attention with query heads grouped under their KV head (GQA) as two batched
    matmuls, softmax in float32: torch's ops, or `softmax(scores, mask, scale)` in place on
    the bf16 scores (kernels/fused.cpp's masked_softmax_: the same steps in one pass).

    q: [B, Q, H, D]; k, v: [B, L, KVH, D]; mask: [B, Q, L] bool. Returns [B, Q, H, D].
    """
    b, qlen, h, _ = q.shape
    rows = max(16, SCORES_BYTES // (4 * b * h * k.shape[1]))
    if qlen > rows:
        return torch.cat([_grouped_attention(q[:, i : i + rows], k, v, mask[:, i : i + rows],
                                             scale, softmax)
                          for i in range(0, qlen, rows)], dim=1)  # fmt: skip
    return _grouped_attention(q, k, v, mask, scale, softmax)


def _grouped_attention(q, k, v, mask, scale, softmax=None):
    b, qlen, h, d = q.shape
    kvh = k.shape[2]
    group = h // kvh
    # [B, KVH, G*Q, D]: query head i attends with KV head i // G, as transformers' repeat_kv.
    qg = q.view(b, qlen, kvh, group, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, group * qlen, d)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1))  # [B, KVH, G*Q, L]
    if softmax is not None:
        scores = scores.view(b, kvh, group, qlen, -1)
        softmax(scores, mask.contiguous(), scale)
        probs = scores.view(b, kvh, group * qlen, -1)
    else:
        scores = (scores * scale).view(b, kvh, group, qlen, -1).float()
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, kvh, group * qlen, -1)
    out = torch.matmul(probs, v.transpose(1, 2))  # [B, KVH, G*Q, D]
    return out.view(b, kvh, group, qlen, d).permute(0, 3, 1, 2, 4).reshape(b, qlen, h, d)
