"""A step's budget: how much one scheduling step may take on. `TokenBudget` counts tokens
(max_num_batched_tokens, today's rule); `TimeBudget` also predicts the step's seconds with the
cost model and cuts prefill chunks so the step stays inside a latency limit (the tightest
running TPOT), while every running decode keeps its place."""

from __future__ import annotations

import math
from typing import Protocol

from tandem.core.cost_model import StepShape
from tandem.core.request import Request


class StepBudget(Protocol):
    @property
    def exhausted(self) -> bool: ...

    def fit(self, request: Request, start: int, wanted: int) -> int:
        """How many of `wanted` new tokens (from position `start`) the step can take."""
        ...

    def spend(self, request: Request, start: int, n: int) -> None: ...

    def release(self, request: Request) -> None:
        """The request was preempted before it was scheduled: return what was set aside."""
        ...


def is_decode(request: Request, start: int, n: int) -> bool:
    return n == 1 and start >= request.num_prompt_tokens


class TokenBudget:
    def __init__(self, tokens: int) -> None:
        self.left = tokens

    @property
    def exhausted(self) -> bool:
        return self.left <= 0

    def fit(self, request: Request, start: int, wanted: int) -> int:
        return min(wanted, self.left)

    def spend(self, request: Request, start: int, n: int) -> None:
        self.left -= n

    def release(self, request: Request) -> None:
        pass


class TimeBudget(TokenBudget):
    """Tokens, and predicted seconds: the running decodes in `decodes` are set aside up front
    (they run, and they set the limit); other rows get what keeps the predicted step within
    `seconds`: a decode not set aside runs only if it fits (it can wait a step), a prefill
    chunk is cut to fit, yet gets at least `min_prefill` tokens a step so prompts progress."""

    def __init__(
        self,
        cost_model,
        seconds: float,
        tokens: int,
        decodes: list[Request],
        min_prefill: int,
        time_left=lambda request: None,
    ) -> None:
        super().__init__(tokens)
        self.cost, self.seconds, self.min_prefill = cost_model, seconds, min_prefill
        # seconds until a request's first-token deadline (None: it has none); a prompt that
        # completes in this step caps the step at that
        self.time_left = time_left
        self._reserved = {r.request_id: r.num_computed_tokens for r in decodes}  # its context
        self.shape = StepShape(0, len(decodes), sum(self._reserved.values()))
        self._prefilled = 0

    def fit(self, request: Request, start: int, wanted: int) -> int:
        n = min(wanted, self.left)
        if request.request_id in self._reserved or n <= 0 or math.isinf(self.seconds):
            return n
        if self._predict_with(request, start, n) <= self.seconds:
            return n
        if is_decode(request, start, n):
            return 0
        # The largest chunk that keeps the step inside the limit (cost grows with the chunk),
        # but never below what this step still owes prompts.
        lo, hi = min(n, max(0, self.min_prefill - self._prefilled)), n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            fits = self._predict_with(request, start, mid) <= self.seconds
            lo, hi = (mid, hi) if fits else (lo, mid)
        return lo

    def _predict_with(self, request: Request, start: int, n: int) -> float:
        return self.cost.predict(self.shape.with_row(request, start, n))

    def spend(self, request: Request, start: int, n: int) -> None:
        self.left -= n
        if self._reserved.pop(request.request_id, None) is None:
            self.shape = self.shape.with_row(request, start, n)
            if not is_decode(request, start, n):
                self._prefilled += n
            left = self.time_left(request) if start + n == request.num_tokens else None
            if left is not None:
                self.seconds = min(self.seconds, left)

    def release(self, request: Request) -> None:
        kv = self._reserved.pop(request.request_id, None)
        if kv is not None:
            self.shape = self.shape.plus(decode_rows=-1, kv_tokens=-kv)


class AdapterLimit:
    """Another budget, and at most `max_loras` distinct LoRA adapters in the step (the runner
    has that many slots): a request of one more adapter gets nothing this step. Base-model
    requests (adapter 0) never count."""

    def __init__(self, inner: StepBudget, max_loras: int) -> None:
        self.inner, self.max_loras = inner, max_loras
        self.adapters: set[int] = set()

    @property
    def exhausted(self) -> bool:
        return self.inner.exhausted

    def fit(self, request: Request, start: int, wanted: int) -> int:
        lid = request.lora_id
        if lid and lid not in self.adapters and len(self.adapters) >= self.max_loras:
            return 0
        return self.inner.fit(request, start, wanted)

    def spend(self, request: Request, start: int, n: int) -> None:
        if request.lora_id:
            self.adapters.add(request.lora_id)
        self.inner.spend(request, start, n)

    def release(self, request: Request) -> None:
        self.inner.release(request)


def limit_adapters(budget: StepBudget, max_loras: int | None) -> StepBudget:
    return budget if max_loras is None else AdapterLimit(budget, max_loras)
