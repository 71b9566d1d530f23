"""EngineConfig: what a user sets. Derived values (dtype, device, max_model_len, number of KV
blocks) are resolved by the engine and passed to components, never written back here."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder or .gguf file; None: the bundled default model
    tokenizer: str | None = None  # default: the model's own
    dtype: str = "auto"  # auto: bfloat16 on GPUs and CPUs with native bf16, else float32
    device: str = "auto"  # auto: cuda if available, else cpu
    seed: int = 0
    block_size: int = 16
    kv_cache_memory: float = 2.0  # GiB for the KV cache pool
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    num_kv_blocks: int | None = None  # usable KV blocks, overriding kv_cache_memory (tests, sims)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if not (isinstance(self.block_size, int) and 1 <= self.block_size <= 1024):
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be > 0 (GiB), got {self.kv_cache_memory!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_kv_blocks is not None and not (
            isinstance(self.num_kv_blocks, int) and self.num_kv_blocks >= 1
        ):
            raise ValueError(f"num_kv_blocks must be an integer >= 1, got {self.num_kv_blocks!r}")
        if self.max_model_len is not None and not (
            isinstance(self.max_model_len, int) and self.max_model_len >= 2
        ):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
