"""A request as the scheduler sees it: token ids, progress counters and its KV blocks."""

from __future__ import annotations

import enum

from tandem.core.sampling_params import SamplingParams
from tandem.core.slo import DEFAULT_CLASS, SLOClass


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # reserved: its prompt's KV arrives from another instance
    LOADING_KV = "loading_kv"  # part of its prompt's KV is being loaded from a KV tier
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"
    FINISHED_SHED = "finished_shed"  # could no longer meet its SLO; its class says shed it

    # Members are singletons: hash by identity (Enum's own hashes the name in Python, and the
    # step loop asks every row's status whether it is final).
    __hash__ = object.__hash__

    @property
    def finished(self) -> bool:
        return self in FINISH_REASONS


# The one map from a final status to the OpenAI finish_reason.
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_SHED: "shed",  # the server answers it with a 503, not a choice
}


class Request:
    """One sequence to generate. `num_computed_tokens` counts tokens whose KV is in the cache;
    whether the request is still in prefill is derived from it, never stored."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float = 0.0,
        priority: int = 0,
        slo: SLOClass = DEFAULT_CLASS,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.priority = priority
        self.slo = slo
        # Output budget; None means "until max_model_len", resolved by the scheduler on intake.
        self.max_tokens = sampling_params.max_tokens
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.block_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.last_token_time: float | None = None  # the scheduler's clock, at each new token
        # Where a prefill instance sends this request's prompt KV (engine.messages.
        # KVTransferParams); None for a request served here.
        self.kv_transfer = None
        # Tokens a proposer guessed to follow the last one (speculative decoding): the next
        # step computes them too and keeps those the model agrees with. Never in
        # all_token_ids until verified.
        self.draft_token_ids: list[int] = []
        self.lora_id = 0  # the LoRA adapter it runs with (0: the base model)
        # Its tenant's cache namespace (vLLM's cache_salt): requests share cached KV only
        # within one salt; None shares with every unsalted request.
        self.cache_salt: str | None = None
        # The agent session it is a turn of (None: none): at its end the engine pins its
        # prefix for the session, session_ttl seconds (core/pins.py).
        self.session_id: str | None = None
        self.session_ttl = 0.0
        # The weights it was admitted under (KVCacheManager.new_weight_epoch): its blocks are
        # keyed by them, so no request under other weights shares them.
        self.weight_epoch = 0
        # Its compiled grammar (structured output; opaque here), held from admission so
        # the runner makes its matcher from it whatever the compile cache has dropped.
        self.grammar = None
        # Its full blocks' hashes (core/block_hash.py), computed as the KV tiers need them.
        self.block_hashes: list[bytes] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
