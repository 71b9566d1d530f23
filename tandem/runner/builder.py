"""Build the model runner for an EngineConfig: resolve device and dtype, find and load the
model, size the KV pool. Its result carries the numbers the scheduler needs, so the engine
loop never loads a model and never sees torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.core.capacity import (
    GiB,
    kv_bytes_per_block,
    num_blocks_for_memory,
    resolve_max_model_len,
)
from tandem.core.model_config import ModelConfig
from tandem.model.loader import load_model, resolve_model
from tandem.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class LoadedRunner:
    runner: ModelRunner
    model_path: Path  # the HF folder the model was loaded from (a GGUF's converted copy)
    model_config: ModelConfig
    max_model_len: int
    num_blocks: int  # KV blocks in the pool, the null block included
    dtype: torch.dtype
    device: torch.device


def build_model_runner(config) -> LoadedRunner:
    """config: an engine.config.EngineConfig (read here, never written)."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    path = resolve_model(config.model)
    mcfg = ModelConfig.from_folder(path)
    max_model_len = resolve_max_model_len(mcfg, config.max_model_len)
    torch.manual_seed(config.seed)
    model = load_model(path, mcfg, dtype, device, max_positions=max_model_len)
    usable = config.num_kv_blocks or num_blocks_for_memory(
        int(config.kv_cache_memory * GiB),
        kv_bytes_per_block(mcfg, config.block_size, dtype.itemsize),
    )
    num_blocks = 1 + usable
    runner = ModelRunner(model, mcfg, num_blocks, config.block_size, dtype, device, config.seed)
    return LoadedRunner(runner, path, mcfg, max_model_len, num_blocks, dtype, device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 where the hardware multiplies it natively; elsewhere torch emulates it and
        # float32 is several times faster (measured: 5x on an AVX2-only EPYC).
        fast_bf16 = device.type == "cuda" or _cpu_has_native_bf16()
        return torch.bfloat16 if fast_bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _cpu_has_native_bf16() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)
