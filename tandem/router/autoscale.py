"""When to add or remove a worker: a plain policy over the router's own signals (no torch, no
I/O, its clock given), so a fake clock tests it and the simulator can run it.

    policy = AutoscalePolicy(AutoscaleConfig(min_workers=1, max_workers=4))
    decision = policy.decide(now, FleetSignals(...))   # -> ScaleDecision(desired, reason)

Pressure (scale up): the mean queue per worker above `target_queue_per_worker`, the mean
load (requests running or waiting) per worker above `target_load_per_worker` where set (it
acts before a queue forms: a worker's TTFT grows with its batch), the fullest KV cache above
`max_kv_usage`, the cost model's predicted TTFT on the best worker above
`max_predicted_ttft`, or the SLO attainment of the worst class over the last minute below
`min_slo_attainment` (the workers' own per-class counters: `AttainmentWindow`), held for
`sustain` seconds. Slack (scale down): nothing queued, the
fleet's load would fit one worker fewer (at `scale_down_fraction` of the load target, or of
the queue target without one), every KV cache under half of `max_kv_usage`, no class under
its attainment floor, held as long. Each direction waits its cooldown after any change; a fleet below
`min_workers` is raised at once. A scale-up asks for as many workers as the queue needs
(ceil(queued / target)), one at least, never past `max_workers`; a scale-down removes one.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class AutoscaleConfig:
    min_workers: int = 1
    max_workers: int = 4
    target_queue_per_worker: float = 4.0  # requests waiting per worker the fleet aims under
    target_load_per_worker: float | None = None  # requests running or waiting; None: off
    scale_down_fraction: float = 0.5  # of the target, per worker, that the fleet shrinks to
    max_kv_usage: float = 0.9  # a worker's KV cache fuller than this is pressure
    max_predicted_ttft: float | None = None  # seconds; None: not a signal
    min_slo_attainment: float | None = None  # 0-1, the worst class's; None: not a signal
    # seconds ahead the load is projected on its trend over `trend_window` (a least-squares
    # line through its samples): a worker asked for now serves only after its cold start, so
    # scaling up judges the load it will meet (the higher of it and today's); scaling down
    # waits for the load itself to fall. 0: the load as it is.
    lookahead: float = 0.0
    trend_window: float = 120.0
    sustain: float = 10.0  # seconds a signal must hold before it acts
    up_cooldown: float = 30.0  # seconds after a change before the next scale-up
    down_cooldown: float = 120.0  # ... before the next scale-down

    def check(self) -> None:
        if not (isinstance(self.min_workers, int) and self.min_workers >= 0):
            raise ValueError(f"min_workers must be an integer >= 0, got {self.min_workers!r}")
        if not (isinstance(self.max_workers, int) and self.max_workers >= max(1, self.min_workers)):  # fmt: skip
            raise ValueError(
                f"max_workers must be an integer >= max(1, min_workers = {self.min_workers}), "
                f"got {self.max_workers!r}"
            )
        for name in ("target_queue_per_worker", "max_kv_usage"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("sustain", "up_cooldown", "down_cooldown"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 (seconds), got {getattr(self, name)!r}")
        if self.target_load_per_worker is not None and not self.target_load_per_worker > 0:
            raise ValueError(f"target_load_per_worker must be > 0, got {self.target_load_per_worker!r}")  # fmt: skip
        if not 0 < self.scale_down_fraction < 1:
            raise ValueError(f"scale_down_fraction must be in (0, 1), got {self.scale_down_fraction!r}")  # fmt: skip
        if not (self.lookahead >= 0 and self.trend_window > 0):
            raise ValueError(f"lookahead must be >= 0 and trend_window > 0 (seconds), got {self.lookahead!r}, {self.trend_window!r}")  # fmt: skip
        if self.min_slo_attainment is not None and not 0 < self.min_slo_attainment <= 1:
            raise ValueError(f"min_slo_attainment must be in (0, 1], got {self.min_slo_attainment!r}")  # fmt: skip
        if self.max_predicted_ttft is not None and not self.max_predicted_ttft > 0:
            raise ValueError(f"max_predicted_ttft must be > 0 (seconds), got {self.max_predicted_ttft!r}")  # fmt: skip


@dataclass(frozen=True)
class FleetSignals:
    serving: int  # workers taking requests (healthy, not draining)
    starting: int = 0  # workers started and not yet serving
    queued: int = 0  # requests waiting, over the serving workers
    load: int = 0  # requests running or waiting, over the serving workers
    max_kv_usage: float = 0.0  # the fullest serving worker's KV cache, 0-1
    predicted_ttft: float | None = None  # seconds, on the best serving worker
    slo_attainment: float | None = None  # the worst class's over the last minute, 0-1


@dataclass(frozen=True)
class ScaleDecision:
    desired: int  # workers the fleet should have (serving and starting)
    reason: str


class AutoscalePolicy:
    def __init__(self, config: AutoscaleConfig) -> None:
        config.check()
        self.config = config
        self._pressure_since: float | None = None
        self._slack_since: float | None = None
        self._last_change = -math.inf
        self._loads: deque[tuple[float, int]] = deque()  # (when, load): the trend's samples

    def decide(self, now: float, s: FleetSignals) -> ScaleDecision:
        c = self.config
        fleet = s.serving + s.starting
        if c.lookahead > 0:  # scale up for the load a new worker will meet; down on today's
            s = dataclasses.replace(s, load=max(s.load, self._projected(now, s.load)))
        if fleet < c.min_workers:
            return self._changed(now, c.min_workers, f"below min_workers {c.min_workers}")
        if fleet > c.max_workers:
            return self._changed(now, c.max_workers, f"above max_workers {c.max_workers}")
        pressure = self._pressure(s)
        slack = pressure is None and s.starting == 0 and self._slack(s)
        self._pressure_since = (self._pressure_since if self._pressure_since is not None else now) if pressure else None  # fmt: skip
        self._slack_since = (self._slack_since if self._slack_since is not None else now) if slack else None  # fmt: skip
        if pressure and now - self._pressure_since >= c.sustain and now - self._last_change >= c.up_cooldown:  # fmt: skip
            if s.starting == 0 and fleet < c.max_workers:
                return self._changed(now, min(c.max_workers, fleet + self._needed(s)), pressure)
        if slack and now - self._slack_since >= c.sustain and now - self._last_change >= c.down_cooldown:  # fmt: skip
            if s.serving > max(1, c.min_workers):
                return self._changed(now, fleet - 1, "load fits one worker fewer")
        return ScaleDecision(fleet, "steady")

    def _projected(self, now: float, load: int) -> int:
        """The load `lookahead` seconds from now on its recent trend (never below 0); the load
        itself until half the trend window has samples."""
        c, samples = self.config, self._loads
        samples.append((now, load))
        while samples[0][0] < now - c.trend_window:
            samples.popleft()
        if samples[-1][0] - samples[0][0] < c.trend_window / 2:
            return load
        n = len(samples)
        mt = sum(t for t, _ in samples) / n
        ml = sum(v for _, v in samples) / n
        var = sum((t - mt) ** 2 for t, _ in samples)
        slope = sum((t - mt) * (v - ml) for t, v in samples) / var if var else 0.0
        return max(0, round(ml + slope * (now + c.lookahead - mt)))

    def _pressure(self, s: FleetSignals) -> str | None:
        c = self.config
        if s.serving == 0:
            return "no worker serving"
        if s.queued / s.serving > c.target_queue_per_worker:
            return f"queue {s.queued / s.serving:.1f} per worker > {c.target_queue_per_worker:g}"
        if c.target_load_per_worker is not None and s.load / s.serving > c.target_load_per_worker:
            return f"load {s.load / s.serving:.1f} per worker > {c.target_load_per_worker:g}"
        if s.max_kv_usage > c.max_kv_usage:
            return f"KV cache {s.max_kv_usage:.0%} full > {c.max_kv_usage:.0%}"
        if c.max_predicted_ttft is not None and s.predicted_ttft is not None and s.predicted_ttft > c.max_predicted_ttft:  # fmt: skip
            return f"predicted TTFT {s.predicted_ttft:.2f} s > {c.max_predicted_ttft:g} s"
        if self._short_of_slo(s):
            return f"SLO attainment {s.slo_attainment:.0%} < {c.min_slo_attainment:.0%}"
        return None

    def _short_of_slo(self, s: FleetSignals) -> bool:
        c = self.config
        return (c.min_slo_attainment is not None and s.slo_attainment is not None
                and s.slo_attainment < c.min_slo_attainment)  # fmt: skip

    def _needed(self, s: FleetSignals) -> int:
        """Workers to add: enough for the queue (and the load, where targeted), one at least."""
        c = self.config
        if not s.serving:
            return 1
        needed = math.ceil(s.queued / c.target_queue_per_worker)
        if c.target_load_per_worker is not None:
            needed = max(needed, math.ceil(s.load / c.target_load_per_worker) - s.serving)
        return max(1, needed)

    def _slack(self, s: FleetSignals) -> bool:
        c = self.config
        fewer = s.serving - 1
        target = c.target_load_per_worker or c.target_queue_per_worker
        return (
            fewer >= 1
            and s.load / fewer <= target * c.scale_down_fraction
            and s.queued == 0
            and s.max_kv_usage <= c.max_kv_usage / 2
            and not self._short_of_slo(s)
        )

    def _changed(self, now: float, desired: int, reason: str) -> ScaleDecision:
        self._last_change = now
        self._pressure_since = self._slack_since = None
        return ScaleDecision(desired, reason)


class AttainmentWindow:
    """SLO attainment per class over the last `window` seconds, from cumulative counters
    (each worker's `tandem:slo_requests_total` and `tandem:slo_met_total` by class): each
    look adds what finished since the last; a counter that went back (a restarted worker)
    starts over. A class with fewer than `min_requests` finished in the window says nothing."""

    def __init__(self, window: float = 60.0, min_requests: int = 10) -> None:
        self.window, self.min_requests = window, min_requests
        self._last: dict[tuple[str, str], tuple[float, float]] = {}
        self._events: list[tuple[float, str, float, float]] = []  # (when, class, done, met)

    def observe(self, now: float, totals: dict[tuple[str, str], tuple[float, float]]) -> None:
        """totals: (worker, class) -> (requests finished, requests that met their SLO)."""
        for key, (done, met) in totals.items():
            last_done, last_met = self._last.get(key, (0.0, 0.0))
            if done < last_done or met < last_met:  # restarted: its counters began again
                last_done = last_met = 0.0
            if done > last_done:
                self._events.append((now, key[1], done - last_done, met - last_met))
            self._last[key] = (done, met)
        self._events = [e for e in self._events if e[0] > now - self.window]

    def worst(self) -> float | None:
        """The lowest attainment of a class with enough requests in the window, or None."""
        done: dict[str, float] = {}
        met: dict[str, float] = {}
        for _, cls, d, m in self._events:
            done[cls] = done.get(cls, 0.0) + d
            met[cls] = met.get(cls, 0.0) + m
        rates = [met[c] / done[c] for c in done if done[c] >= self.min_requests]
        return min(rates, default=None)
