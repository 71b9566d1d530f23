"""What crosses the boundary between the engine core and its clients: requests in, token ids
and stats out, and the control messages of the engine-core process. msgspec structs only, so
a process that builds or reads them (the HTTP server) never imports torch or the model.

    server (AsyncLLM) ──PUSH: ADD | RESERVE | ABORT | SHUTDOWN──▶ core
    server (AsyncLLM) ◀──PUSH: CoreReady, then CoreOutputs... | CoreFailed── core

RESERVE is ADD on a decode instance whose prompt KV a prefill instance computes: the core
reserves blocks and answers in CoreOutputs.reserved how many prompt tokens it already holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from tandem.core.runner import TokenLogprobs
from tandem.core.sampling_params import SamplingParams
from tandem.core.slo import DEFAULT_CLASS, SLOClass
from tandem.kv_transfer.tiers import LoadStats, TierStats
from tandem.spec.stats import SpecDecodeStats

# Message kinds, server -> core: the first frame of a multipart message.
ADD, RESERVE, ABORT, SHUTDOWN = b"add", b"reserve", b"abort", b"shutdown"
# Agent sessions: CLOSE_SESSION (the session id, utf-8) unpins the session's prefix.
CLOSE_SESSION = b"close_session"
# LoRA adapters: LOAD_LORA (LoRAOp with a path), UNLOAD_LORA (LoRAOp without); the core
# answers each in CoreOutputs.lora_results (op id, error; "" when it worked).
LOAD_LORA, UNLOAD_LORA = b"load_lora", b"unload_lora"
# A control call (UtilityCall: RL's weight updates, pause and resume, cache resets), run
# between two steps; answered in CoreOutputs.utility_results (op id, error, result).
UTILITY = b"utility"


class UtilityCall(msgspec.Struct, array_like=True):
    op_id: str
    method: str  # one of core_proc.UTILITIES
    args: dict = {}


class LoRAOp(msgspec.Struct, array_like=True):
    op_id: str
    lora_id: int
    path: str | None = None


class KVTransferParams(msgspec.Struct, array_like=True):
    """Where a prefill instance sends a request's prompt KV: the decode instance's KV
    address, the decode side's id for the request, and the first prompt position it lacks."""

    address: str
    remote_request_id: str
    start: int


class EngineCoreRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    slo: SLOClass = DEFAULT_CLASS  # its class and targets, resolved by the front end
    kv_transfer: KVTransferParams | None = None  # prefill here, decode elsewhere
    lora_id: int = 0  # the LoRA adapter to run with (0: the base model)
    cache_salt: str | None = None  # shares cached KV only with requests of the same salt
    session_id: str | None = None  # a turn of this agent session: its prefix is pinned after
    session_ttl: float = 0.0  # for this many seconds from its end


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per new token
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
    num_steps: int = 0  # cumulative: steps that ran the model
    execute_seconds: float = 0.0  # cumulative: their time (the engine's busy time)
    execute_cpu_seconds: float = 0.0  # cumulative: the core process's CPU time in them
    # prefill/decode disaggregation, cumulative: KV tensor bytes sent (prefill) and received
    # (decode), prompt tokens a reservation found in the decode-side cache, transfers failed
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    kv_cached_tokens: int = 0
    kv_transfer_failures: int = 0
    # seconds from reservation to commit of the transfers done since the last stats
    kv_transfer_seconds: list[float] = field(default_factory=list)
    spec_decode: SpecDecodeStats | None = None  # cumulative; None: no speculation here
    # KV tiers (kv_transfer/): each tier's counters and the loads', cumulative; the seconds
    # of the loads that ended since the last stats
    kv_tiers: list[TierStats] = field(default_factory=list)
    kv_tier_loads: LoadStats | None = None
    kv_load_seconds: list[float] = field(default_factory=list)
    # a mixture of experts: tokens routed to each expert, summed over the layers, cumulative
    # (empty for a dense model)
    expert_tokens: list[int] = field(default_factory=list)
    # agent sessions: blocks pinned between turns now, and the most they may take
    num_pinned_blocks: int = 0
    max_pinned_blocks: int = 0


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    pid: int
    model_path: str
    max_model_len: int
    max_request_tokens: int  # the most tokens one request may hold: model limit or KV pool
    vocab_size: int
    kv_address: str | None = None  # a decode instance's: where prefill instances send KV
    quantization: str = "none"  # the weights' format (quantize_model's description)


class CoreOutputs(msgspec.Struct, tag="out", array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: EngineStats | None = None
    rejected: list[tuple[str, str]] = []  # (request id, reason): adds the core refused
    reserved: list[tuple[str, int]] = []  # (request id, prompt tokens held; -1: no room)
    lora_results: list[tuple[str, str]] = []  # (op id, error; "": done)
    # (op id, error ("": done), result): control calls answered, before this message's
    # outputs: tokens below were computed after every call answered here
    utility_results: list[tuple[str, str, object]] = []


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str


CoreMessage = CoreReady | CoreOutputs | CoreFailed
