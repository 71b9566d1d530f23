"""The engine's composition root for a real model, shared by the offline `LLM` and the
engine-core process: build the model runner, then the KV manager and scheduler sized from it,
and hand all three to an EngineCore."""

from __future__ import annotations

import logging

from tandem.core.clock import WallClock
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.scheduler import Scheduler, SchedulerConfig
from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore

log = logging.getLogger("tandem")


def build_engine(config: EngineConfig, clock=None):
    """-> (EngineCore, LoadedRunner): the core, and what was loaded (model path and config,
    max_model_len) for the front door to report."""
    from tandem.runner.builder import build_model_runner  # torch: only when a model is built

    clock = clock or WallClock()
    loaded = build_model_runner(config)
    kv = KVCacheManager(loaded.num_blocks, config.block_size, config.enable_prefix_caching)
    scheduler = Scheduler(
        SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, loaded.max_model_len),
        kv,
        clock,
    )
    core = EngineCore(scheduler, loaded.runner, clock, loaded.model_config.eos_token_ids)
    log.info(
        "engine ready: %s, %s on %s, %d KV blocks of %d tokens, max_model_len %d",
        loaded.model_config.architecture,
        loaded.dtype,
        loaded.device,
        loaded.num_blocks - 1,
        config.block_size,
        loaded.max_model_len,
    )
    return core, loaded
