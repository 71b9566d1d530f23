"""A split model's KV read and written as one model's: what prefill/decode disaggregation
and the KV tiers move through the runner, assembled on rank 0 from the ranks' shares (each
holds its KV heads of its stage's layers) and cut back into them on the way in.

Each `*_part` runs on every rank, inside the driver's `call` (a broadcast, then a gather of
the parts to rank 0); a rank without the layer gives None. Replicated KV heads come from
each of their ranks with the same values; the first is kept.
"""

from __future__ import annotations

import torch

# a rank's own pool, not the runner's methods: on rank 0 those ask the driver again
from tandem.runner import kv_transfer as local


def export_layer_part(runner, shard, block_ids, layer: int, start: int, end: int):
    if layer not in shard.layers:
        return None
    k, v, scales = local.export_layer(runner.kv_cache, runner.kv_scales, block_ids,
                                      layer - shard.layers.start, start, end)  # fmt: skip
    return shard.kv_heads, k, v, scales


def merge_layer(parts, num_kv_heads: int):
    """(K, V, scales) of one layer, all KV heads, from its ranks' parts."""
    parts = [p for p in parts if p is not None]
    _, k0, _, s0 = parts[0]
    k = k0.new_empty((k0.shape[0], num_kv_heads, k0.shape[2]))
    v = torch.empty_like(k)
    scales = None if s0 is None else s0.new_empty((2, k0.shape[0], num_kv_heads))
    for heads, pk, pv, ps in parts:
        k[:, heads.start : heads.stop], v[:, heads.start : heads.stop] = pk, pv
        if scales is not None:
            scales[:, :, heads.start : heads.stop] = ps
    return k, v, scales


def import_layer_part(runner, shard, block_ids, layer: int, start: int, k, v, scales=None):
    if layer not in shard.layers:
        return None
    h = shard.kv_heads
    cut = None if scales is None else scales[:, :, h.start : h.stop]
    local.import_layer(runner.kv_cache, runner.kv_scales, block_ids, layer - shard.layers.start,
                       start, k[:, h.start : h.stop], v[:, h.start : h.stop], cut)  # fmt: skip
    return None


def export_kv_part(runner, shard, block_ids, start: int, end: int):
    kv = local.export_kv(runner.kv_cache, runner.kv_scales, block_ids, start, end, runner.dtype)
    return shard.layers, shard.kv_heads, kv


def merge_kv(parts, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """[layers, 2, tokens, kv_heads, head_dim] from the ranks' [their layers, ..., their heads]."""
    _, _, kv0 = parts[0]
    out = kv0.new_empty((num_layers, 2, kv0.shape[2], num_kv_heads, kv0.shape[4]))
    for layers, heads, kv in parts:
        out[layers.start : layers.stop, :, :, heads.start : heads.stop] = kv
    return out


def import_kv_part(runner, shard, block_ids, start: int, kv):
    layers, heads = shard.layers, shard.kv_heads
    part = kv[layers.start : layers.stop, :, :, heads.start : heads.stop]
    local.import_kv(runner.kv_cache, runner.kv_scales, block_ids, start, part)
    return None


def export_blocks_part(runner, shard, block_ids):
    return [bytes(b) for b in local.export_blocks(runner.kv_cache, runner.kv_scales, block_ids)]


def block_bytes_part(runner, shard):
    (null,) = local.export_blocks(runner.kv_cache, runner.kv_scales, [0])
    return len(null)  # every block's size


def import_blocks_part(runner, shard, block_ids, payloads, offsets):
    """payloads: whole blocks, each the ranks' own payloads in rank order; offsets[r]: where
    rank r's starts (and offsets[-1] the whole size)."""
    a, b = offsets[shard.rank], offsets[shard.rank + 1]
    local.import_blocks(runner.kv_cache, runner.kv_scales, block_ids,
                        [memoryview(p)[a:b] for p in payloads])  # fmt: skip
    return None


CALLS = {
    "export_layer": export_layer_part,
    "import_layer": import_layer_part,
    "export_kv": export_kv_part,
    "import_kv": import_kv_part,
    "export_blocks": export_blocks_part,
    "import_blocks": import_blocks_part,
    "block_bytes": block_bytes_part,
}
