"""Export and import the KV of a token range, layout-neutral: per layer, K and V as
[tokens, kv_heads, head_dim], whatever the pool's block size or dtype. What prefill/decode
disaggregation moves between instances (the heterogeneous case: a sender and a receiver that
differ in block size or dtype interoperate, since both address KV by token position)."""

from __future__ import annotations

import torch


def slots_of(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Cache slots of positions [start, end) of a request holding `block_ids`."""
    pos = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.long)[pos // block_size]
    return blocks * block_size + pos % block_size  # [tokens]


def export_kv(kv_cache: torch.Tensor, block_ids: list[int], start: int, end: int) -> torch.Tensor:
    """kv_cache: [layers, 2, blocks, block_size, kv_heads, head_dim] ->
    [layers, 2, tokens, kv_heads, head_dim], a copy on the CPU."""
    layers, _, blocks, bs, kvh, d = kv_cache.shape
    slots = slots_of(block_ids, bs, start, end).to(kv_cache.device)
    flat = kv_cache.view(layers, 2, blocks * bs, kvh, d)
    return flat.index_select(2, slots).cpu()


def export_layer(
    kv_cache: torch.Tensor, block_ids: list[int], layer: int, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer, each [tokens, kv_heads, head_dim], copies on the CPU."""
    _, _, blocks, bs, kvh, d = kv_cache.shape
    slots = slots_of(block_ids, bs, start, end).to(kv_cache.device)
    flat = kv_cache[layer].view(2, blocks * bs, kvh, d)
    kv = flat.index_select(1, slots).cpu()
    return kv[0], kv[1]


def import_layer(
    kv_cache: torch.Tensor, block_ids: list[int], layer: int, start: int, k, v
) -> None:
    """Write one layer's K and V ([tokens, kv_heads, head_dim], any float dtype) into
    positions [start, start + tokens), cast to the cache's dtype."""
    layers, _, blocks, bs, kvh, d = kv_cache.shape
    if not 0 <= layer < layers or k.shape != v.shape or tuple(k.shape[1:]) != (kvh, d):
        raise ValueError(
            f"kv: layer {layer} of shape {tuple(k.shape)} does not fit a cache of {layers} "
            f"layers, {kvh} KV heads of {d}"
        )
    slots = slots_of(block_ids, bs, start, start + k.shape[0]).to(kv_cache.device)
    flat = kv_cache[layer].view(2, blocks * bs, kvh, d)
    flat[0].index_copy_(0, slots, k.to(device=kv_cache.device, dtype=kv_cache.dtype))
    flat[1].index_copy_(0, slots, v.to(device=kv_cache.device, dtype=kv_cache.dtype))


def import_kv(kv_cache: torch.Tensor, block_ids: list[int], start: int, kv: torch.Tensor) -> None:
    """Write kv ([layers, 2, tokens, kv_heads, head_dim], any float dtype) into positions
    [start, start + tokens) of the request holding `block_ids`, cast to the cache's dtype."""
    layers, _, blocks, bs, kvh, d = kv_cache.shape
    if kv.shape[0] != layers or kv.shape[3:] != (kvh, d):
        raise ValueError(
            f"kv: shape {tuple(kv.shape)} does not fit a cache of {layers} layers, "
            f"{kvh} KV heads of {d}"
        )
    slots = slots_of(block_ids, bs, start, start + kv.shape[2]).to(kv_cache.device)
    flat = kv_cache.view(layers, 2, blocks * bs, kvh, d)
    flat.index_copy_(2, slots, kv.to(device=kv_cache.device, dtype=kv_cache.dtype))
