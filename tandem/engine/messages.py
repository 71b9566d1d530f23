"""What crosses the boundary between the engine core and its clients: requests in, token ids
and stats out, and the control messages of the engine-core process. msgspec structs only, so
a process that builds or reads them (the HTTP server) never imports torch or the model.

    server (AsyncLLM) ──PUSH: ADD | ABORT | SHUTDOWN──▶ core
    server (AsyncLLM) ◀──PUSH: CoreReady, then CoreOutputs... | CoreFailed── core
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from tandem.core.runner import TokenLogprobs
from tandem.core.sampling_params import SamplingParams
from tandem.core.slo import DEFAULT_CLASS, SLOClass

# Message kinds, server -> core: the first frame of a multipart message.
ADD, ABORT, SHUTDOWN = b"add", b"abort", b"shutdown"


class EngineCoreRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    slo: SLOClass = DEFAULT_CLASS  # its class and targets, resolved by the front end


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # the core's clock, for queue-time metrics
    error: str | None = None  # finish_reason "error": what went wrong computing this request


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_evicted_blocks: int
    step_seconds: float = 0.0  # the last step's execute time
    predicted_step_seconds: float | None = None  # what the cost model said it would take


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    pid: int
    model_path: str
    max_model_len: int
    max_request_tokens: int  # the most tokens one request may hold: model limit or KV pool
    vocab_size: int


class CoreOutputs(msgspec.Struct, tag="out", array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: EngineStats | None = None
    rejected: list[tuple[str, str]] = []  # (request id, reason): adds the core refused


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str


CoreMessage = CoreReady | CoreOutputs | CoreFailed
