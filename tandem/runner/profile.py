"""Measure engine steps on this hardware over a grid of plan shapes, for the cost model.

Each point is a real plan run by the real runner: P prefill tokens in K chunks (of different
requests, each after C_p tokens of context) beside D decode rows at context C_d. The KV the
rows read is whatever the pool holds (timing does not depend on it), its pages all mapped
first; blocks come from the engine's own KV manager and go back after each point.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from statistics import median

from tandem.core.cost_model import StepShape
from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class ProfileGrid:
    prefill_tokens: tuple[int, ...] = (0, 32, 128, 256, 512)
    prefill_chunks: tuple[int, ...] = (1, 4)  # the prefill tokens split over this many requests
    prefill_context: tuple[int, ...] = (0, 512)
    # on both sides of the weight-only kernels' 4-row passes and the quantized head's switch
    decode_rows: tuple[int, ...] = (0, 1, 5, 8, 12, 32)
    decode_context: tuple[int, ...] = (64, 512)

    def points(self):
        """(P, K, C_p, D, C_d) of every distinct step the grid describes."""
        for p, k, cp, d, cd in itertools.product(
            self.prefill_tokens, self.prefill_chunks, self.prefill_context, self.decode_rows,
            self.decode_context,
        ):  # fmt: skip
            no_prefill = p == 0 and not cp and k == self.prefill_chunks[0]
            if (no_prefill or p >= k > 0) and (d or p) and (d or cd == self.decode_context[0]):
                yield p, k, cp, d, cd


STATISTICS = ("min", "median")
# A decode-only step meets the weights where the step before left them: on a CPU, largely in
# its last-level cache while decode steps follow one another, evicted by a prefill step (an
# AMX Xeon: a 1-row decode 6.2 ms among decodes, 8.4 right after a 384-token prefill, back to
# 6.2 over 5-15 steps; an 80 MB sum 1.4 ms against 2.7). The engine runs decode steps back
# to back, so a decode-only point is timed so: after this many untimed runs of itself.
STEADY_RUNS = 8


def profile_steps(core, grid: ProfileGrid, vocab_size: int, repeats: int = 3, on_point=None,
                  statistic: str = "min", runs: list | None = None):  # fmt: skip
    """[(shape, seconds)] for every grid point that fits the pool and max_model_len. Each
    point's seconds are the fastest of its timed runs ("min": the clean cost, since on a
    shared machine noise only adds time) or their median (what a run of many steps meets).

    The grid is timed in passes, each running every point once, so a point's runs are spread
    over the whole profile: noise on a shared machine comes in bursts of seconds, and timing a
    point's runs back to back let one burst inflate all of them (two profiles minutes apart
    differed by up to 2x on single points when they were). `runs`, if given, receives each
    point's timed runs (a list of seconds per point, in the order of the result). A
    decode-only point is timed after STEADY_RUNS untimed runs of itself (see there)."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
    limit = core.scheduler.config.max_model_len
    ids = itertools.count()
    shapes = {}  # each point's StepShape

    def run(point) -> float | None:
        """Seconds of one step of the point's plan; None when the pool cannot hold it."""
        p, k, cp, d, cd = point
        rows = [_decode_row(next(ids), cd, vocab_size) for _ in range(d)]
        if p:
            rows += [_prefill_row(next(ids), cp, p // k, vocab_size) for _ in range(k)]
        shapes[point] = StepShape.of(rows)
        kv = core.scheduler.kv
        try:
            if not all(kv.allocate_slots(s.request, s.start + s.num_new_tokens) for s in rows):
                return None
            plan = SchedulerOutput(scheduled=rows)
            t0 = time.perf_counter()
            core.runner.execute(plan)
            return time.perf_counter() - t0
        finally:
            for s in rows:
                kv.free(s.request)

    def timed(point) -> float:
        for _ in range(STEADY_RUNS if point[0] == 0 else 0):
            run(point)
        return run(point)

    points = [(p, k, cp, d, cd) for p, k, cp, d, cd in grid.points()
              if cp + p < limit and cd + 1 < limit]  # fmt: skip
    # Steady-state steps, on mapped pages: the pool's first pass is a one-off cost of page
    # faults that made the first timed runs of some points up to 10x slow (its step noise's
    # 97.5th percentile 2.9x, against 1.04-1.10x on mapped pages)
    core.runner.map_kv_pool()
    points = [point for point in points if run(point) is not None]  # the warm-up pass
    seconds = {point: [] for point in points}
    for _ in range(repeats):
        for point in points:
            seconds[point].append(timed(point))
    # Up to 3x the repeats, more passes over the points whose two fastest runs differ by 3%.
    for _ in range(2 * repeats):
        unsettled = [pt for pt in points if sorted(seconds[pt])[1] > 1.03 * min(seconds[pt])]
        for point in unsettled:
            seconds[point].append(timed(point))
    results = []
    for point in points:
        times = seconds[point]
        results.append((shapes[point], min(times) if statistic == "min" else median(times)))
        if runs is not None:
            runs.append(times)
        if on_point is not None:
            on_point(*results[-1])
    return results


def _tokens(seed: int, n: int, vocab_size: int) -> list[int]:
    return [(seed * 7919 + i) % (vocab_size - 10) + 10 for i in range(n)]


def _decode_row(i: int, context: int, vocab_size: int) -> ScheduledRequest:
    prompt = _tokens(i, context, vocab_size)
    req = Request(f"d{i}", prompt, SamplingParams(temperature=0, max_tokens=2))
    req.append_token(11)  # one output token so far: the row decodes the next
    return ScheduledRequest(req, context, 1, True)


def _prefill_row(i: int, context: int, n: int, vocab_size: int) -> ScheduledRequest:
    prompt = _tokens(i, context + n, vocab_size)
    req = Request(f"p{i}", prompt, SamplingParams(temperature=0, max_tokens=1))
    return ScheduledRequest(req, context, n, True)
