"""SamplingParams: what a request asks of the sampler, validated at construction.

Field names and defaults follow vLLM so that code written against vLLM works unchanged.
Every invalid value raises a ValueError that names the field and its allowed range.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

# Below this temperature a request is greedy (argmax), as in vLLM.
GREEDY_EPSILON = 1e-5
MAX_LOGPROBS = 20


def _check(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


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
        _check(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1", self.n)
        _check(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            "-1, 0 or a positive integer",
            self.top_k,
        )
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
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            "an integer >= 1",
            self.max_tokens,
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens",
            "an integer >= 0",
            self.min_tokens,
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"<= max_tokens ({self.max_tokens})",
            self.min_tokens,
        )
        _check(
            self.logprobs is None
            or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"an integer in [0, {MAX_LOGPROBS}]",
            self.logprobs,
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "a list of non-empty strings",
            self.stop,
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of non-negative integers",
            self.stop_token_ids,
        )
        _check(self.seed is None or isinstance(self.seed, int), "seed", "an integer", self.seed)

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
