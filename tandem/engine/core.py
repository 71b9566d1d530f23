"""EngineCore: the step loop. Token ids in, token ids out; no text, no HTTP.

    plan     = scheduler.schedule()
    result   = runner.execute(plan)
    finished = scheduler.update(plan, result.sampled)

It runs in the caller's process (offline LLM) or in its own (the server, over ZMQ).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec
import torch

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.request import Request, RequestStatus
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import Scheduler, SchedulerConfig
from tandem.engine.config import EngineConfig
from tandem.model.loader import load_model, load_model_config, resolve_model
from tandem.runner.model_runner import ModelRunner, kv_bytes_per_block

log = logging.getLogger("tandem")


class EngineCoreRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    # (token ids, logprobs, rank of the sampled token); ids[0] is the sampled token
    logprobs: tuple[list[int], list[float], int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # monotonic clock, for queue-time metrics


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_evicted_blocks: int


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


class EngineCore:
    def __init__(self, config: EngineConfig, clock=time.monotonic) -> None:
        self.config = config
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        self.model_path = resolve_model(config.model)
        self.model_config = mcfg = load_model_config(self.model_path)
        self.max_model_len = self._resolve_max_model_len(config.max_model_len)
        self.eos_token_ids = mcfg.eos_token_ids

        torch.manual_seed(config.seed)
        model = load_model(self.model_path, mcfg, dtype, device, max_positions=self.max_model_len)
        num_blocks = 1 + self._num_usable_blocks(kv_bytes_per_block(mcfg, config.block_size, dtype))
        self.runner = ModelRunner(
            model, mcfg, num_blocks, config.block_size, dtype, device, config.seed
        )
        kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        sched_cfg = SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len
        )
        self.scheduler = Scheduler(sched_cfg, kv, clock)
        self.last_step_timings: dict[str, float] = {}
        log.info(
            "engine ready: %s, %s on %s, %d KV blocks of %d tokens, max_model_len %d",
            mcfg.architecture,
            dtype,
            device,
            num_blocks - 1,
            config.block_size,
            self.max_model_len,
        )

    def _num_usable_blocks(self, block_bytes: int) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        n = int(self.config.kv_cache_memory * 2**30) // block_bytes
        if n < 1:
            raise ValueError(
                f"kv_cache_memory must hold at least one KV block ({block_bytes} bytes), "
                f"got {self.config.kv_cache_memory} GiB"
            )
        return n

    def _resolve_max_model_len(self, requested: int | None) -> int:
        limit = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            # Attention here is full; within the window the two agree exactly.
            limit = min(limit, self.model_config.sliding_window)
        if requested is None:
            return limit
        if requested > limit:
            raise ValueError(f"max_model_len must be <= {limit} for this model, got {requested}")
        return requested

    # ---- requests ----------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        params = req.sampling_params
        params.eos_token_ids = self.eos_token_ids
        request = Request(
            req.request_id, req.prompt_token_ids, params, req.arrival_time, req.priority
        )
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        t1 = time.perf_counter()
        result = self.runner.execute(plan)
        t2 = time.perf_counter()
        self.scheduler.update(plan, result.sampled)
        outputs = []
        for s in plan.scheduled:
            req = s.request
            token = result.sampled.get(req.request_id)
            if token is None:
                continue
            outputs.append(
                EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=[token],
                    logprobs=result.logprobs.get(req.request_id),
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                    num_cached_tokens=req.num_cached_tokens,
                    first_scheduled_time=req.first_scheduled_time
                    if req.num_output_tokens == 1
                    else None,
                )
            )
        self.last_step_timings = {
            "schedule": t1 - t0,
            **self.runner.timings,
            "update": time.perf_counter() - t2,
        }
        return outputs

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_evicted_blocks=kv.num_evicted,
        )

    def reset_prefix_cache(self) -> int:
        return self.scheduler.kv.reset_prefix_cache()
