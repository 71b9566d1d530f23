"""When to move an instance between the prefill and the decode pool: a plain policy over each
pool's predicted wait (no torch, no I/O, its clock given), so a fake clock tests it and the
simulator runs it (sim/roles.py) as `tandem router --pd-ratio auto` does.

    policy = PDRatioPolicy(PDRatioConfig(ttft_target=2.0, tpot_target=0.1))
    move = policy.decide(now, prefill=PoolSignals(...), decode=PoolSignals(...))
    # -> RoleMove("decode", "prefill", reason) or None

Each pool's pressure is its predicted wait over the target it threatens: the prefill pool's
queued prompt tokens, priced by the cost model and shared by its instances, over the TTFT
target, or the share of its time the prompts arriving need (over the last minute) over
`max_prefill_busy`, whichever is higher (a queue comes and goes between arrivals; the rate
says where it is heading); the decode pool's step time at its mean batch over the TPOT target (or its fullest
KV cache over `max_kv_usage`, when that is higher: a full decode pool makes new requests
wait for room). One instance moves from the calmer pool to the pressed one when the pressed
one's pressure is past `min_pressure` and `margin` times the other's, the move would not
simply swap which pool is pressed (pressures scale with 1/instances), the donor keeps its
minimum, all held for `sustain` seconds; then `cooldown` seconds pass before the next move.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from tandem.core.cost_model import StepShape

PROMPT_CHUNK = 2048  # the prompt tokens a prefill step is priced at, per token


@dataclass(frozen=True)
class PDRatioConfig:
    ttft_target: float = 2.0  # seconds: what the prefill pool's wait is judged against
    tpot_target: float = 0.1  # seconds: ... the decode pool's step time
    max_kv_usage: float = 0.9  # a decode pool this full is as pressed as one at its TPOT target
    max_prefill_busy: float = 0.8  # ... a prefill pool this busy, at its TTFT target
    margin: float = 1.5  # the pressed pool's pressure over the other's before a move
    min_pressure: float = 0.5  # below this a pool needs no help, whatever the other's
    sustain: float = 10.0  # seconds the imbalance must hold
    cooldown: float = 30.0  # seconds after a move before the next
    min_prefill: int = 1
    min_decode: int = 1

    def check(self) -> None:
        for name in ("ttft_target", "tpot_target", "max_kv_usage", "max_prefill_busy", "min_pressure"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.margin >= 1:
            raise ValueError(f"margin must be >= 1, got {self.margin!r}")
        for name in ("sustain", "cooldown"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 (seconds), got {getattr(self, name)!r}")
        for name in ("min_prefill", "min_decode"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class PoolSignals:
    instances: int  # serving in this role
    wait: float  # predicted seconds: prefill_wait or decode_wait
    kv_usage: float = 0.0  # the fullest instance's KV cache, 0-1 (read for the decode pool)
    busy: float = 0.0  # the share of its time the work arriving needs (prefill_busy)


@dataclass(frozen=True)
class RoleMove:
    source: str  # "prefill" | "decode": the pool that gives an instance
    target: str
    reason: str


def prefill_wait(cost_model, instances: int, pending_tokens: int) -> float:
    """Seconds to compute the prompt tokens queued on the pool, shared by its instances."""
    per_token = cost_model.predict(StepShape.prompt(PROMPT_CHUNK)) / PROMPT_CHUNK
    return per_token * pending_tokens / max(1, instances)


def prefill_busy(cost_model, instances: int, tokens_per_second: float) -> float:
    """The share of the pool's time the prompt tokens arriving at this rate need."""
    per_token = cost_model.predict(StepShape.prompt(PROMPT_CHUNK)) / PROMPT_CHUNK
    return per_token * tokens_per_second / max(1, instances)


class RateWindow:
    """Amounts over the last `window` seconds, per second (prompt tokens sent to prefill)."""

    def __init__(self, window: float = 60.0) -> None:
        self.window = window
        self._events: deque[tuple[float, float]] = deque()
        self._total = 0.0

    def add(self, now: float, amount: float) -> None:
        self._events.append((now, amount))
        self._total += amount

    def rate(self, now: float) -> float:
        while self._events and self._events[0][0] <= now - self.window:
            self._total -= self._events.popleft()[1]
        return self._total / self.window


def decode_wait(cost_model, instances: int, rows: int, kv_tokens: int) -> float:
    """Seconds a decode step takes at the pool's mean batch (rows decoding, context read)."""
    n = max(1, instances)
    return cost_model.predict(StepShape(decode_rows=max(1, math.ceil(rows / n)), kv_tokens=kv_tokens // n))  # fmt: skip


def pool_signals(cost_model, prefill: int, queued_tokens: int, tokens_per_second: float,
                 decode: int, rows: int, kv_tokens: int, kv_usage: float) -> tuple[PoolSignals, PoolSignals]:  # fmt: skip
    """Both pools' signals, priced by the cost model, from what the router (disagg/roles.py)
    and the simulator (sim/roles.py) count: prefill instances, prompt tokens queued on them
    and sent per second; decode instances, their running rows, context tokens (0 where
    unknown) and fullest KV cache."""
    return (PoolSignals(prefill, prefill_wait(cost_model, prefill, queued_tokens),
                        busy=prefill_busy(cost_model, prefill, tokens_per_second)),
            PoolSignals(decode, decode_wait(cost_model, decode, rows, kv_tokens), kv_usage))  # fmt: skip


class PDRatioPolicy:
    def __init__(self, config: PDRatioConfig) -> None:
        config.check()
        self.config = config
        self._since: float | None = None  # when the current imbalance began
        self._toward: str | None = None  # ... toward which pool
        self._last_move = -math.inf

    def pressures(self, prefill: PoolSignals, decode: PoolSignals) -> tuple[float, float]:
        c = self.config
        return (max(prefill.wait / c.ttft_target, prefill.busy / c.max_prefill_busy),
                max(decode.wait / c.tpot_target, decode.kv_usage / c.max_kv_usage))  # fmt: skip

    def decide(self, now: float, prefill: PoolSignals, decode: PoolSignals) -> RoleMove | None:
        c = self.config
        p, d = self.pressures(prefill, decode)
        toward = self._pressed(p, d, prefill.instances, decode.instances)
        if toward != self._toward:
            self._toward, self._since = toward, now
        if toward is None or now - self._since < c.sustain or now - self._last_move < c.cooldown:
            return None
        self._last_move, self._toward, self._since = now, None, None
        source = "decode" if toward == "prefill" else "prefill"
        return RoleMove(source, toward, f"{toward} pressure {max(p, d):.2f} > {c.margin:g} x "
                                        f"{source} pressure {min(p, d):.2f}")  # fmt: skip

    def _pressed(self, p: float, d: float, n_prefill: int, n_decode: int) -> str | None:
        """The pool that should take an instance from the other now, if any."""
        c = self.config
        for target, pt, nt, ps, ns, floor in (("prefill", p, n_prefill, d, n_decode, c.min_decode),
                                              ("decode", d, n_decode, p, n_prefill, c.min_prefill)):  # fmt: skip
            if ns <= floor or pt < c.min_pressure or pt < c.margin * ps:
                continue
            # after the move: the target's share of its work shrinks, the source's grows
            if pt * nt / (nt + 1) > ps * ns / (ns - 1):
                return target
        return None
