"""Capacity arithmetic: how much KV a token costs, how many blocks a memory budget buys, how
long a sequence may grow. Pure functions of a ModelConfig and plain numbers, so the engine,
the simulator and capacity planning for hardware we do not own all use the same sums."""

from __future__ import annotations

from tandem.core.model_config import ModelConfig

GiB = 2**30


def kv_bytes_per_token(cfg: ModelConfig, dtype_size: int, scale_bytes: int = 0) -> int:
    """K and V of one token across every layer, at dtype_size bytes per element, plus
    scale_bytes per KV head of each (an 8-bit cache's scales)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim * dtype_size + scale_bytes)


def kv_bytes_per_block(
    cfg: ModelConfig, block_size: int, dtype_size: int, scale_bytes: int = 0
) -> int:
    return block_size * kv_bytes_per_token(cfg, dtype_size, scale_bytes)


def num_blocks_for_memory(memory_bytes: int, block_bytes: int) -> int:
    """Usable KV blocks (the null block not counted) that fit in memory_bytes."""
    n = int(memory_bytes) // block_bytes
    if n < 1:
        raise ValueError(
            f"kv_cache_memory must hold at least one KV block ({block_bytes} bytes), "
            f"got {memory_bytes / GiB:g} GiB"
        )
    return n


def resolve_max_model_len(cfg: ModelConfig, requested: int | None) -> int:
    """The longest sequence (prompt + output) a request may reach: the model's position
    limit (and sliding window: attention here is full, and within the window the two agree
    exactly), or a smaller one the user asked for."""
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        limit = min(limit, cfg.sliding_window)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len must be <= {limit} for this model, got {requested}")
    return requested
