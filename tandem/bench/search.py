"""`--find-max-rate`: the highest Poisson rate whose SLO attainment stays at or above a
target. The rate doubles from a start until a probe misses the target, then the bracket
[last good, first bad] is bisected until it is within `tolerance` (relative) or the
probes run out. Attainment is taken to fall as the rate rises."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass
class SearchResult:
    max_rate: float | None  # highest rate probed that met the target; None if none did
    probes: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment)


async def find_max_rate(
    probe: Callable[[float], Awaitable[float]],
    target: float = 0.9,
    start: float = 1.0,
    max_probes: int = 8,
    tolerance: float = 0.05,
    max_rate: float = 1024.0,
) -> SearchResult:
    if not 0 < target <= 1:
        raise ValueError(f"SLO target: {target} is not in (0, 1]")
    good, bad = 0.0, None
    rate, result = start, SearchResult(None)
    for _ in range(max_probes):
        attained = await probe(rate)
        result.probes.append((rate, attained))
        if attained >= target:
            good = rate
            result.max_rate = rate
            if bad is None and rate >= max_rate:
                break
            rate = rate * 2 if bad is None else (good + bad) / 2
        else:
            bad = rate
            rate = (good + bad) / 2
        if bad is not None and bad - good <= tolerance * bad:
            break
    return result
