"""SamplingParams: what a request asks of the sampler, validated at construction.

Field names and defaults follow vLLM so that code written against vLLM works unchanged.
Every invalid value raises a ValueError that names the field and its allowed range.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from tandem.structured.params import StructuredOutputsParams

# Below this temperature a request is greedy (argmax), as in vLLM.
GREEDY_EPSILON = 1e-5
# n parallel samples at most: each is its own sequence, built when the request arrives.
MAX_N = 256
# Integers cross the process boundary as 64-bit (msgpack) and reach torch as int64.
INT64_MAX = 2**63 - 1


def _check(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r:.100}")


def _is_int(value, low: int = 0, high: int = INT64_MAX) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    ttft_ms: float | None = None  # this request's time-to-first-token target (SLO scheduling)
    tpot_ms: float | None = None  # and its time-per-output-token target
    # the output must match a JSON schema, regex, choice or grammar (tandem/structured)
    structured_outputs: StructuredOutputsParams | None = None
    # Filled in by the engine: the model's end-of-sequence ids (tokenizer + generation config).
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(_is_int(self.n, 1, MAX_N), "n", f"an integer in [1, {MAX_N}]", self.n)
        _check(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(_is_int(self.top_k), "top_k", "-1, 0 or a positive 64-bit integer", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _check(
            -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            "in [-2, 2]",
            self.presence_penalty,
        )
        _check(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "in [-2, 2]",
            self.frequency_penalty,
        )
        _check(self.repetition_penalty > 0, "repetition_penalty", "> 0", self.repetition_penalty)
        _check(
            self.max_tokens is None or _is_int(self.max_tokens, 1),
            "max_tokens",
            "an integer >= 1",
            self.max_tokens,
        )
        _check(_is_int(self.min_tokens), "min_tokens", "an integer >= 0", self.min_tokens)
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"<= max_tokens ({self.max_tokens})",
            self.min_tokens,
        )
        _check(
            self.logprobs is None or _is_int(self.logprobs),
            "logprobs",
            "an integer >= 0",
            self.logprobs,
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "a list of non-empty strings",
            self.stop,
        )
        _check(
            all(_is_int(t) for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of non-negative 64-bit integers",
            self.stop_token_ids,
        )
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            _check(
                value is None or (not isinstance(value, bool) and value > 0),
                name,
                "a number of milliseconds > 0",
                value,
            )
        # The i-th of n samples is seeded seed + i: all of them must be 64-bit.
        _check(
            self.seed is None or _is_int(self.seed, -(2**63), INT64_MAX - self.n + 1),
            "seed",
            f"a 64-bit integer (at most {INT64_MAX - self.n + 1} with n={self.n})",
            self.seed,
        )

    def check_for_model(
        self, vocab_size: int, max_logprobs: int, logprobs_field: str = "logprobs"
    ) -> None:
        """What depends on the model and engine: token ids must exist in the vocabulary, and
        logprobs stay within the engine's max_logprobs (logprobs_field: the name the client
        used, e.g. top_logprobs in chat)."""
        bad = next((t for t in self.stop_token_ids if t >= vocab_size), None)
        _check(bad is None, "stop_token_ids", f"token ids in [0, {vocab_size})", bad)
        limit = min(max_logprobs, vocab_size)
        _check(
            self.logprobs is None or self.logprobs <= limit,
            logprobs_field,
            f"an integer in [0, {limit}] (max_logprobs)",
            self.logprobs,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def child(self, index: int) -> SamplingParams:
        """Params for the index-th of n parallel samples: one sequence, its own seed."""
        params = copy.copy(self)
        params.n = 1
        if self.seed is not None:
            params.seed = self.seed + index
        return params
