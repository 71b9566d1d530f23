"""The engine's composition root for a real model, shared by the offline `LLM` and the
engine-core process: build the model runner, then the KV manager and scheduler sized from it,
and hand all three to an EngineCore."""

from __future__ import annotations

import logging
import time

from tandem.core.block_hash import BlockHasher
from tandem.core.clock import WallClock
from tandem.core.cost_model import DEFAULT_PRIOR, CostModel, OnlineCostModel
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.kv_events import KVEventLog
from tandem.core.policy import BatchPolicy, FCFSBatch, PriorityBatch
from tandem.core.radix_cache import EVICTION_POLICIES
from tandem.core.scheduler import Scheduler, SchedulerConfig
from tandem.core.slo_policy import SLOBatch
from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore
from tandem.engine.kv_event_publisher import build_publisher

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
    tiers = build_kv_tiers(config, loaded) if config.kv_tiers_on else None
    publisher = build_publisher(config.kv_events_config)
    events = None
    if publisher is not None:  # blocks named as the tiers name them (their hasher, if any)
        hasher = tiers.hasher if tiers else BlockHasher(kv_seed(config, loaded), config.block_size)
        events = KVEventLog(hasher, "GPU" if loaded.device.type == "cuda" else "CPU")
    kv = KVCacheManager(
        loaded.num_blocks,
        config.block_size,
        config.enable_prefix_caching,
        EVICTION_POLICIES[config.radix_eviction_policy](),
        hasher=tiers.hasher if tiers else None,
        max_pinned_fraction=config.max_pinned_fraction,
        events=events,
    )
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
        kv_source=tiers,
    )
    eos = loaded.model_config.eos_token_ids
    core = EngineCore(
        scheduler, loaded.runner, clock, eos, cpu_clock=time.process_time, kv_tiers=tiers,
        kv_events=publisher,
    )  # fmt: skip
    if config.role == "both" and not config.enable_role_switching:  # (no KV sender wraps it)
        core.rebuild_runner = lambda old: rebuild_runner(config, old)
    log.info(
        "engine ready: %s, %s on %s, weights %s, %d KV blocks of %d tokens (KV cache %s), "
        "max_model_len %d, %d tokens a step, scheduling %s, speculative decoding: %s, LoRA: %s, "
        "KV tiers: %s",
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
        tiers.describe() if tiers else "off",
    )
    return core, loaded


def rebuild_runner(config: EngineConfig, old):
    """A new runner for a level-2 sleeper (its model dropped): the model loaded again from
    `config`, with what the old runner had besides (LoRA adapters, the grammar compiler,
    the draft proposer). The KV pool is new, the same size."""
    from tandem.runner.builder import build_model_runner

    runner = build_model_runner(config).runner
    if old.lora_state is not None:
        max_loras, max_rank, adapters = old.lora_state
        runner.enable_lora(max_loras, max_rank)
        for lora_id, weights in adapters.items():
            runner.add_lora(lora_id, weights)
    if old.grammars is not None:
        runner.enable_structured_outputs(old.grammars)
    runner.proposer = old.proposer
    return runner


def build_kv_tiers(config: EngineConfig, loaded):
    """The KV tiers the flags ask for, fastest first, named for this model and KV layout."""
    from tandem.kv_transfer.offload import KVTiers
    from tandem.kv_transfer.tiers import DiskTier, HostTier, RedisTier

    layout = loaded.runner.kv_layout
    seed = kv_seed(config, loaded)
    tiers = []
    if config.kv_offloading_size:
        tiers.append(HostTier(int(config.kv_offloading_size * 2**30)))
    if config.kv_disk_dir:
        tiers.append(DiskTier(config.kv_disk_dir, int(config.kv_disk_size * 2**30), layout))
    if config.kv_remote_url:
        redis_tier = RedisTier(config.kv_remote_url, layout, timeout_s=min(0.5, config.kv_offload_load_timeout))  # fmt: skip
        if not redis_tier.ping():
            log.warning("KV tiers: Redis at %s does not answer; lookups miss until it does",
                        config.kv_remote_url)  # fmt: skip
        tiers.append(redis_tier)
    return KVTiers(
        tiers,
        BlockHasher(seed, config.block_size),
        config.kv_offload_min_tokens,
        config.kv_offload_load_timeout,
    )


def kv_seed(config: EngineConfig, loaded) -> bytes:
    """The root of every block hash: the same for every instance of this model and KV
    layout, so KV tiers and KV events name a prefix alike everywhere."""
    from tandem.core.block_hash import model_seed

    mc = loaded.model_config
    return model_seed(
        "tandem-kv-1", model_fingerprint(config.model), mc.architecture, mc.num_layers,
        mc.vocab_size, loaded.weights, loaded.runner.kv_layout,
    )  # fmt: skip


def model_fingerprint(model: str | None) -> tuple:
    """What names the weights wherever they are: a file's name and size; a folder's name,
    its weight files' names and sizes, and its config.json."""
    from pathlib import Path

    path = Path(model or "")
    if path.is_file():
        return (path.name, path.stat().st_size)
    if not path.is_dir():
        return (str(model),)
    files = sorted(
        (f.name, f.stat().st_size)
        for f in path.iterdir()
        if f.suffix in (".safetensors", ".bin", ".gguf", ".pt")
    )
    config = path / "config.json"
    return (path.name, tuple(files), config.read_text() if config.is_file() else "")


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
