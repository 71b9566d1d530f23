"""An 8-bit KV cache: K and V stored as int8 or float8 (e4m3), each token's vector of each
KV head with its own float32 scale (absmax / the format's largest value), kept in a pool
beside the blocks. Written quantized as each step's K/V lands in the cache; read back
dequantized into the compute dtype as attention gathers its blocks. With head_dim 64 a
token's K or V per head is 64 bytes + 4 of scale instead of 256 (float32) or 128 (bf16)."""

from __future__ import annotations

import torch

# --kv-cache-dtype (engine.config.KV_CACHE_DTYPES, vLLM's names; fp8 is e4m3) -> storage
_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # largest representable magnitude
EIGHT_BIT = tuple(_QMAX)  # the 8-bit storage dtypes (a scale per token and KV head)
SCALE_BYTES = 4  # one float32 per token, KV head, and K or V


def storage_dtype(kv_cache_dtype: str, compute: torch.dtype) -> torch.dtype:
    return compute if kv_cache_dtype == "auto" else _STORAGE[kv_cache_dtype]


def quantize_kv(x: torch.Tensor, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, KVH, D] -> (x in `storage`, scales [T, KVH] float32)."""
    qmax = _QMAX[storage]
    xf = x.float()
    scale = (xf.abs().amax(-1) / qmax).clamp_min(1e-12)
    y = xf / scale[..., None]
    q = y.round_().clamp_(-qmax, qmax).to(torch.int8) if storage == torch.int8 else y.to(storage)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q: [..., KVH, D] stored values, scale: [..., KVH] -> [..., KVH, D] in dtype."""
    return (q.float() * scale[..., None]).to(dtype)
