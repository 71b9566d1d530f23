"""Export and import the KV of a token range, layout-neutral: per layer, K and V as
[tokens, kv_heads, head_dim], whatever the pool's block size or dtype. What prefill/decode
disaggregation moves between instances (the heterogeneous case: a sender and a receiver that
differ in block size or dtype interoperate, since both address KV by token position).

An 8-bit cache (kv_quant.py: int8 or e4m3, a float32 scale per token and KV head, in
`kv_scales` [layers, 2, blocks, block_size, kv_heads]) exports its layers as stored, with
their scales; an import into a cache of the same 8-bit dtype copies both, bit for bit, into
another dtype dequantizes (and quantizes, into the other 8-bit one) as the cache's own
write would: a float32 prefill instance feeding an int8 decode instance stores what an int8
instance computing the prompt itself would."""

from __future__ import annotations

import warnings

import torch

from tandem.model.kv_quant import EIGHT_BIT, dequantize_kv, quantize_kv


def slots_of(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Cache slots of positions [start, end) of a request holding `block_ids`."""
    pos = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.long)[pos // block_size]
    return blocks * block_size + pos % block_size  # [tokens]


def export_layer(
    kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, block_ids: list[int], layer: int,
    start: int, end: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """K and V of one layer, each [tokens, kv_heads, head_dim] as stored, and an 8-bit
    cache's scales [2, tokens, kv_heads] (else None); copies on the CPU."""
    _, _, blocks, bs, kvh, d = kv_cache.shape
    slots = slots_of(block_ids, bs, start, end).to(kv_cache.device)
    kv = kv_cache[layer].view(2, blocks * bs, kvh, d).index_select(1, slots).cpu()
    scales = None
    if kv_scales is not None:
        scales = kv_scales[layer].view(2, blocks * bs, kvh).index_select(1, slots).cpu()
    return kv[0], kv[1], scales


def import_layer(
    kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, block_ids: list[int], layer: int,
    start: int, k, v, scales: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Write one layer's K and V ([tokens, kv_heads, head_dim], any float dtype, or 8-bit
    with `scales` [2, tokens, kv_heads]) into positions [start, start + tokens)."""
    layers, _, blocks, bs, kvh, d = kv_cache.shape
    if not 0 <= layer < layers or k.shape != v.shape or tuple(k.shape[1:]) != (kvh, d):
        raise ValueError(
            f"kv: layer {layer} of shape {tuple(k.shape)} does not fit a cache of {layers} "
            f"layers, {kvh} KV heads of {d}"
        )
    if (k.dtype in EIGHT_BIT) != (scales is not None):
        raise ValueError(f"kv: {k.dtype} K and V {'without' if scales is None else 'with'} scales")
    if scales is not None and tuple(scales.shape) != (2, k.shape[0], kvh):
        raise ValueError(f"kv: scales of shape {tuple(scales.shape)} for K of {tuple(k.shape)}")
    slots = slots_of(block_ids, bs, start, start + k.shape[0]).to(kv_cache.device)
    flat = kv_cache[layer].view(2, blocks * bs, kvh, d)
    for i, x in enumerate((k, v)):
        x, scale = _as_stored(x, None if scales is None else scales[i], kv_cache.dtype)
        dst, x = flat[i], x.to(kv_cache.device)
        if x.dtype in EIGHT_BIT:  # (no index_copy_ for e4m3: copy the bytes)
            dst, x = dst.view(torch.uint8), x.view(torch.uint8)
        dst.index_copy_(0, slots, x)
        if kv_scales is not None:
            kv_scales[layer, i].view(blocks * bs, kvh).index_copy_(0, slots, scale.to(kv_scales.device))  # fmt: skip


def _as_stored(x: torch.Tensor, scale: torch.Tensor | None, storage: torch.dtype):
    """(x as a cache of `storage` holds it, its scales or None)."""
    if scale is not None and x.dtype == storage:
        return x, scale.float()  # the same 8-bit dtype: the bytes themselves
    if scale is not None:
        x = dequantize_kv(x, scale, torch.float32)
    if storage in EIGHT_BIT:
        return quantize_kv(x, storage)
    return x.to(storage), None


def export_kv(
    kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, block_ids: list[int], start: int,
    end: int, dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """[layers, 2, tokens, kv_heads, head_dim] of positions [start, end), a copy on the CPU;
    an 8-bit cache's dequantized to `dtype`."""
    layers = []
    for i in range(kv_cache.shape[0]):
        k, v, scales = export_layer(kv_cache, kv_scales, block_ids, i, start, end)
        if scales is not None:
            k, v = dequantize_kv(k, scales[0], dtype), dequantize_kv(v, scales[1], dtype)
        layers.append(torch.stack([k, v]))
    return torch.stack(layers)


def import_kv(
    kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, block_ids: list[int], start: int,
    kv: torch.Tensor,
) -> None:  # fmt: skip
    """Write kv ([layers, 2, tokens, kv_heads, head_dim], any float dtype) into positions
    [start, start + tokens) of the request holding `block_ids`."""
    layers, _, _, _, kvh, d = kv_cache.shape
    if kv.shape[0] != layers or kv.shape[3:] != (kvh, d):
        raise ValueError(
            f"kv: shape {tuple(kv.shape)} does not fit a cache of {layers} layers, "
            f"{kvh} KV heads of {d}"
        )
    for i in range(layers):
        import_layer(kv_cache, kv_scales, block_ids, i, start, kv[i, 0], kv[i, 1])


# ---- whole blocks, for the KV tiers (kv_transfer/offload.py) ----------------------------
def block_layout(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> str:
    """What a block's payload is, for a tier's entries: a payload of another layout (another
    model, dtype or block size) is never imported."""
    layers, _, _, bs, kvh, d = kv_cache.shape
    scales = "+scales" if kv_scales is not None else ""
    return f"{str(kv_cache.dtype).removeprefix('torch.')}:{layers}x2x{bs}x{kvh}x{d}{scales}"


def export_blocks(
    kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, block_ids: list[int]
) -> list[memoryview]:
    """Each block's KV as stored, a byte view per block of one copy on the CPU: for each
    layer, K then V, each [block_size, kv_heads, head_dim], followed by an 8-bit cache's
    scales for them [block_size, kv_heads]."""
    parts = _block_rows(kv_cache, kv_scales)
    widths = [p.shape[2] for p in parts]
    if kv_cache.device.type != "cpu":  # one gather on the device, one copy back
        idx = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
        rows = torch.cat([p.index_select(1, idx) for p in parts], 2).movedim(1, 0).cpu()
    else:  # one copy: each block's rows straight into its place (no intermediate gather)
        rows = torch.empty(len(block_ids), parts[0].shape[0], sum(widths), dtype=torch.uint8)
        for i, b in enumerate(block_ids):
            start = 0
            for p, w in zip(parts, widths):
                rows[i, :, start : start + w] = p[:, b]
                start += w
    array = rows.reshape(len(block_ids), -1).numpy()
    return [memoryview(row) for row in array]


def import_blocks(
    kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, block_ids: list[int], payloads
) -> None:
    """Write payloads from `export_blocks` (of a cache of the same layout) into block_ids."""
    parts = _block_rows(kv_cache, kv_scales)
    widths = [p.shape[2] for p in parts]
    shape = (parts[0].shape[0], sum(widths))
    with warnings.catch_warnings():  # read-only payloads are only read
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        for b, payload in zip(block_ids, payloads):
            row = torch.frombuffer(payload, dtype=torch.uint8).view(shape)
            start = 0
            for p, w in zip(parts, widths):
                p[:, b] = row[:, start : start + w].to(p.device)
                start += w


def _block_rows(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> list[torch.Tensor]:
    """The pool (and an 8-bit pool's scales) as bytes [layers * 2, blocks, bytes a block]."""
    layers, two, blocks = kv_cache.shape[:3]
    parts = [_bytes_of(kv_cache).view(layers * two, blocks, -1)]
    if kv_scales is not None:
        parts.append(_bytes_of(kv_scales).view(layers * two, blocks, -1))
    return parts


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8, the last dimension in bytes (index_copy_ has no e4m3)."""
    return t.view(torch.uint8)
