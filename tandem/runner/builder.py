"""Build the model runner for an EngineConfig: resolve device and dtype, find and load the
model, size the KV pool. Its result carries the numbers the scheduler needs, so the engine
loop never loads a model and never sees torch."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem import cpu_isa
from tandem.core.capacity import (
    GiB,
    kv_bytes_per_block,
    num_blocks_for_memory,
    resolve_max_model_len,
)
from tandem.core.cost_model import KernelRows
from tandem.core.model_config import ModelConfig
from tandem.distributed.driver import Driver
from tandem.distributed.layout import ParallelLayout, check_splits
from tandem.distributed.sharding import RankShard
from tandem.engine.config import (
    DEFAULT_KV_CACHE_GIB,
    kv_cache_setting,
    resolve_batch_invariant,
    step_token_budget,
)
from tandem.model import kernels
from tandem.model.kv_quant import SCALE_BYTES, storage_dtype
from tandem.model.loader import gguf_file, load_model, resolve_model
from tandem.model.quant import Int4Linear, QuantizedLinear
from tandem.model.quantize import (
    check_device,
    keep_bf16_copies,
    quantize_model,
    resolve_activation_quantization,
    use_int8_activations,
    use_rows_invariant,
)
from tandem.model.weight_update import WeightUpdater, checkpoint_shapes
from tandem.runner.model_runner import ModelRunner

log = logging.getLogger("tandem")


@dataclass(frozen=True)
class LoadedRunner:
    runner: ModelRunner
    model_path: Path  # the HF folder the model was loaded from (a GGUF's converted copy)
    model_config: ModelConfig
    max_model_len: int
    max_num_batched_tokens: int  # the step budget: as set, else its default for this runner
    num_blocks: int  # KV blocks in the pool, the null block included
    dtype: torch.dtype
    device: torch.device
    weights: str = "none"  # how the weights are quantized (quantize_model's description)
    # Where the quantized layers change kernels with a step's rows (steps in the step time the
    # cost model fits); the default: one kernel at every size.
    kernel_rows: KernelRows = KernelRows()
    shard: object = None  # a split model's distributed.sharding.RankShard (None: whole)


def build_model_runner(config, rank: int = 0, ranks=None) -> LoadedRunner:
    """config: an engine.config.EngineConfig (read here, never written). Split over ranks
    (tensor or pipeline parallel), rank 0 (ranks None) starts the others first, so they
    load their shares while it loads its own; a rank past 0 passes its joined `ranks`."""
    cpu_isa.selected()  # a wrong TANDEM_CPU_ISA fails the start, saying why
    kernels.configure(build_timeout=config.kernel_build_timeout)
    device = resolve_device(config.device)
    if device.type == "cpu":
        kernels.prebuild()
    dtype = resolve_dtype(config.dtype, device)
    gguf = gguf_file(config.model)
    method = quantization_method(config.quantization, gguf)
    check_device(method, device)
    resolve_activation_quantization(config.activation_quantization, method, device)  # refusals
    path = resolve_model(config.model)
    mcfg = ModelConfig.from_folder(path)
    max_model_len = resolve_max_model_len(mcfg, config.max_model_len)
    layout = ParallelLayout(
        config.tensor_parallel_size, config.pipeline_parallel_size,
        config.enable_expert_parallel, config.expert_placement_strategy,
    )  # fmt: skip
    if layout.world_size == 1:
        return _build(config, path, mcfg, method, gguf, dtype, device, max_model_len)
    check_splits(mcfg, layout)
    shard = RankShard(mcfg, layout, rank)
    driver = Driver(config, mcfg.vocab_size) if ranks is None else None
    try:
        loaded = _build(config, path, mcfg, method, gguf, dtype, device, max_model_len, shard)
        loaded = dataclasses.replace(loaded, shard=shard)
        shard.wire(loaded.runner.model, ranks or driver.ranks)
        loaded.runner.model.model.decode_stack = None  # its C++ layers know no all-reduce
        if driver is not None:
            driver.wait_loaded()
            driver.attach(loaded.runner, shard)
            loaded.runner.distributed = driver
    except BaseException:
        if driver is not None:
            driver.close()
        raise
    return loaded


def _build(config, path, mcfg, method, gguf, dtype, device, max_model_len, shard=None):
    """The model runner of one rank (the whole model where shard is None)."""
    model_cfg = mcfg if shard is None else shard.model_config()
    torch.manual_seed(config.seed)
    activations = resolve_activation_quantization(config.activation_quantization, method, device)
    model = load_model(path, model_cfg, dtype, device, max_model_len, shard)
    weights = quantize_model(model, method, config.quantization_group_size, gguf, shard)
    if config.bf16_weight_copy:
        if method == "none":
            raise ValueError("bf16_weight_copy: the weights are not quantized (quantization none)")
        keep_bf16_copies(model)
        weights += " + bf16 copy"
    if activations == "int8":
        required = config.activation_quantization == "int8"
        if count := use_int8_activations(model, required):
            weights += f", int8 activations ({count} layers)"
    batch_invariant = resolve_batch_invariant(config)
    if batch_invariant:
        use_rows_invariant(model)
        weights += ", batch-invariant"
    kv_dtype = storage_dtype(config.kv_cache_dtype, dtype)
    scale_bytes = 0 if config.kv_cache_dtype == "auto" else SCALE_BYTES
    # every rank sizes its pool for the stage with the most layers: the same block count
    kv_cfg = model_cfg if shard is None else dataclasses.replace(
        model_cfg, num_layers=shard.layout.max_stage_layers(mcfg.num_layers)
    )  # fmt: skip
    block_bytes = kv_bytes_per_block(kv_cfg, config.block_size, kv_dtype.itemsize, scale_bytes)
    usable = config.num_kv_blocks or num_blocks_for_memory(
        kv_pool_bytes(config, mcfg, dtype, device), block_bytes
    )
    num_blocks = 1 + usable
    # the runner's config: this rank's KV heads and layers, the whole vocabulary (its logits)
    runner_cfg = dataclasses.replace(model_cfg, vocab_size=mcfg.vocab_size)
    runner = ModelRunner(
        model, runner_cfg, num_blocks, config.block_size, dtype, device, config.seed,
        config.kv_cache_dtype, batch_invariant,
    )  # fmt: skip
    _enable_weight_updates(runner, model, path, dtype, shard)
    budget = step_token_budget(config, runner.chunks_in_place)
    return LoadedRunner(runner, path, mcfg, max_model_len, budget, num_blocks, dtype, device,
                        weights, kernel_rows(model, device))  # fmt: skip


def _enable_weight_updates(runner, model, path: Path, dtype, shard) -> None:
    """Give the runner its WeightUpdater, or the reason it has none."""
    if shard is not None:
        runner.weights_refusal = "the model is split over ranks (tensor or pipeline parallel)"
    elif model.moe_blocks():
        runner.weights_refusal = "a mixture of experts' prepacked experts cannot be updated yet"
    else:
        runner.weights = WeightUpdater(model, checkpoint_shapes(path), dtype)


def kernel_rows(model, device: torch.device) -> KernelRows:
    """Where the quantized projections and output head change kernels, and the rows torch's
    CPU kernels compute per pass over the weights (the cost model's KernelRows)."""
    head = model.lm_head
    body = [m.kernel_max_rows for m in model.modules()
            if isinstance(m, QuantizedLinear) and m.can_dense and m is not head]  # fmt: skip
    quantized = any(isinstance(m, QuantizedLinear) for m in model.modules())
    gemm = [m.gemm_max_rows for m in model.modules()
            if isinstance(m, Int4Linear) and m.gemm_max_rows and m is not head]  # fmt: skip
    return KernelRows(
        wide=max(body, default=None),
        head=head.kernel_max_rows if isinstance(head, QuantizedLinear) and head.can_dense else None,
        tile=QuantizedLinear.CPU_ROW_TILE if quantized and device.type == "cpu" else None,
        gemm=max(gemm, default=None),
    )


def quantization_method(name: str | None, gguf: Path | None) -> str:
    """The quantization to apply: as asked, else a GGUF's own blocks, else none."""
    if name is None:
        return "gguf" if gguf is not None else "none"
    if name == "gguf" and gguf is None:
        raise ValueError("quantization: gguf needs a .gguf model (it runs on the file's blocks)")
    if name in ("int8", "int4") and gguf is not None:
        raise ValueError(
            f"quantization: {name} quantizes an HF checkpoint at load; a GGUF model runs on its "
            "own blocks (gguf, its default) or dequantized (none)"
        )
    return name


def kv_pool_bytes(config, mcfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes for the KV pool, from the first setting that gives them; on CUDA without one,
    vLLM's rule: `gpu_memory_utilization` of the GPU, less what is in use once the model is
    loaded and an estimate of the activations of the largest step."""
    budget, source = kv_cache_setting(config)
    if budget is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free)
        budget -= _activation_bytes(config, mcfg, dtype)
        source = (
            f"--gpu-memory-utilization {config.gpu_memory_utilization} of {total / GiB:.0f} GiB"
        )
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization {config.gpu_memory_utilization} leaves no memory for "
                f"the KV cache after the model ({(total - free) / GiB:.1f} GiB in use)"
            )
    elif budget is None:
        budget = int(DEFAULT_KV_CACHE_GIB * GiB)
        source = "the default (on the CPU --gpu-memory-utilization does not apply)"
    log.info("KV cache pool: %.2f GiB, sized by %s", budget / GiB, source)
    return budget


def _activation_bytes(config, mcfg: ModelConfig, dtype: torch.dtype) -> int:
    """A generous estimate of the largest step's temporaries: hidden states and MLP
    activations of max_num_batched_tokens, plus float32 logits (and sampling copies) of
    max_num_seqs rows (CUDA only, where chunks never read the cache in place)."""
    per_token = (4 * mcfg.hidden_size + 3 * mcfg.intermediate_size) * dtype.itemsize
    logits = 3 * config.max_num_seqs * mcfg.vocab_size * 4
    return 2 * step_token_budget(config, chunks_in_place=False) * per_token + logits


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 where the hardware multiplies it natively; elsewhere torch emulates it and
        # float32 is several times faster (measured: 5x on an AVX2-only EPYC).
        fast_bf16 = device.type == "cuda" or _cpu_has_native_bf16()
        return torch.bfloat16 if fast_bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _cpu_has_native_bf16() -> bool:
    return cpu_isa.at_least("avx512_bf16")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)
