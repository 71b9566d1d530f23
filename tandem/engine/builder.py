"""The engine's composition root for a real model, shared by the offline `LLM` and the
engine-core process: build the model runner, then the KV manager and scheduler sized from it,
and hand all three to an EngineCore."""

from __future__ import annotations

import logging
import time

from tandem.core.clock import WallClock
from tandem.core.cost_model import DEFAULT_PRIOR, CostModel, OnlineCostModel
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.policy import BatchPolicy, FCFSBatch, PriorityBatch
from tandem.core.scheduler import Scheduler, SchedulerConfig
from tandem.core.slo_policy import SLOBatch
from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore

log = logging.getLogger("tandem")


def build_engine(config: EngineConfig, clock=None):
    """-> (EngineCore, LoadedRunner): the core, and what was loaded (model path and config,
    max_model_len) for the front door to report."""
    from tandem.runner.builder import build_model_runner  # torch: only when a model is built

    clock = clock or WallClock()
    cost = build_cost_model(config)  # before the model loads: a bad file fails at once
    loaded = build_model_runner(config)
    if isinstance(cost, OnlineCostModel):  # a profiled file already knows
        cost.switches_kernels_at(loaded.kernel_rows)
    if config.enable_lora:
        loaded.runner.enable_lora(config.max_loras, config.max_lora_rank)
    loaded.runner.enable_structured_outputs(build_grammar_compiler(config, loaded))
    if config.speculative_config is not None:
        loaded.runner.proposer = build_proposer(config.speculative_config, config, loaded)
    kv = KVCacheManager(loaded.num_blocks, config.block_size, config.enable_prefix_caching)
    scheduler = Scheduler(
        SchedulerConfig(
            config.max_num_seqs,
            loaded.max_num_batched_tokens,
            loaded.max_model_len,
            config.max_loras if config.enable_lora else None,
        ),
        kv,
        clock,
        build_batch_policy(config.scheduling_policy, cost),
        cost,
    )
    eos = loaded.model_config.eos_token_ids
    core = EngineCore(scheduler, loaded.runner, clock, eos, cpu_clock=time.process_time)
    log.info(
        "engine ready: %s, %s on %s, weights %s, %d KV blocks of %d tokens (KV cache %s), "
        "max_model_len %d, %d tokens a step, scheduling %s, speculative decoding: %s, LoRA: %s",
        loaded.model_config.architecture,
        loaded.dtype,
        loaded.device,
        loaded.weights,
        loaded.num_blocks - 1,
        config.block_size,
        loaded.runner.kv_cache.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
        loaded.max_model_len,
        loaded.max_num_batched_tokens,
        config.scheduling_policy,
        config.speculative_config.describe() if config.speculative_config else "off",
        f"{config.max_loras} slots, rank <= {config.max_lora_rank}"
        if config.enable_lora
        else "off",
    )
    return core, loaded


def build_grammar_compiler(config: EngineConfig, loaded):
    """Structured output's compiler: the tokenizer's vocabulary is prepared for the grammar
    libraries on a worker thread from now on, so the first request does not wait for it."""
    from tandem.engine.tokenizer import load_tokenizer
    from tandem.structured.compiler import GrammarCompiler

    folder = config.tokenizer or loaded.model_path
    return GrammarCompiler(
        lambda: load_tokenizer(folder),
        loaded.model_config.vocab_size,
        list(loaded.model_config.eos_token_ids),
        config.structured_outputs_backend,
        config.structured_outputs_compile_timeout,
    )


def build_proposer(spec, config: EngineConfig, loaded):
    """The proposer of a SpeculativeConfig, for the runner to call after each step."""
    if spec.method == "ngram":
        from tandem.spec.ngram import NgramProposer

        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
    from tandem.spec.draft_model import build_draft_proposer

    return build_draft_proposer(spec, config, loaded)


def build_cost_model(config: EngineConfig):
    """The step-latency model: a profiled one from a file, else one fitted online."""
    if config.cost_model:
        return CostModel.load(config.cost_model)
    return OnlineCostModel(DEFAULT_PRIOR)


def build_batch_policy(name: str, cost_model) -> BatchPolicy:
    if name == "priority":
        return PriorityBatch()
    if name == "slo":
        return SLOBatch(cost_model)
    return FCFSBatch()
