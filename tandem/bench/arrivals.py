"""When each session starts: all at once, or a Poisson (gamma, with burstiness) process.

Arrival times are drawn up front from a seeded generator, so a run repeats exactly.
As in `vllm bench serve`, inter-arrival gaps are Gamma(shape=burstiness, scale=1 / (rate *
burstiness)): burstiness 1 is a Poisson process, below 1 burstier, above 1 more even. For a
fixed number of requests the gaps are rescaled so the last arrival lands at n / rate, as
vLLM does, which steadies throughput across seeds.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Offsets in seconds from the start of the run, one per session, non-decreasing."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate {rate} and burstiness {burstiness} must be positive")
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    gaps = _gaps(n, rate, burstiness, seed)
    times = np.cumsum(gaps)
    times *= (n / rate) / times[-1]
    return times.tolist()


def arrival_times_until(
    duration: float, rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Offsets of every arrival before `duration` seconds (unscaled: the process as drawn)."""
    if math.isinf(rate):
        raise ValueError("--duration with an infinite rate needs --max-concurrency")
    times, t, chunk = [], 0.0, max(16, int(duration * rate * 1.5))
    rng_seed = seed
    while True:
        for gap in _gaps(chunk, rate, burstiness, rng_seed):
            t += gap
            if t >= duration:
                return times
            times.append(t)
        rng_seed += 1_000_003  # a fresh, still seeded, stream for the next chunk


def _gaps(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def parse_rates(text: str) -> list[float]:
    """'inf', '4' or '1,2,4,8' (a sweep)."""
    try:
        rates = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"request rate: {text!r} is not a list of positive rates")
    return rates
