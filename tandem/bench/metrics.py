"""Serving metrics from timed requests: pure functions, names as `vllm bench serve`'s.

Per request (seconds, from the client's clock):
- TTFT: sending to the first token;  E2EL: sending to the last token;
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests of two or more tokens;
- ITL: every gap between consecutive token chunks, pooled over all requests.
Per run: `completed` requests, their input and output tokens, request and token
throughput over the run's duration, and mean / median / std / pN of each latency in ms.

Goodput (DistServe): the rate of requests that meet every SLO given (`ttft`, `tpot`,
`e2el`, in ms); a request of one token has TPOT 0 for this test, as in vLLM. SLO
attainment is the fraction of *all* requests sent, failed ones included, that meet their
SLOs; each class may carry its own SLOs, else the run's apply.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from tandem.bench.client import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_slos(items: Iterable[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(
                f"goodput: {item!r} is not one of {', '.join(k + ':MS' for k in SLO_KEYS)}"
            )
        if float(value) < 0:
            raise ValueError(f"goodput: {item!r} is negative")
        slos[key] = float(value)
    return slos


def tpot(r: RequestResult) -> float | None:
    if not r.success or not r.output_len or r.output_len < 2:
        return None
    return (r.latency - r.ttft) / (r.output_len - 1)


def meets(r: RequestResult, slo: dict[str, float]) -> bool:
    """Whether a request met every SLO in `slo` (ms). A failed request never does."""
    if not r.success:
        return False
    measured = {"ttft": r.ttft, "tpot": tpot(r) or 0.0, "e2el": r.latency}
    return all(measured[k] * 1000 <= v for k, v in slo.items())


def latency_stats(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean, median, std and pN of values given in seconds, reported in ms (0 when empty)."""
    ms = np.asarray(values_s if len(values_s) else [0.0], dtype=float) * 1000
    stats = {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())}
    for p in percentiles:
        stats[f"p{_pword(p)}"] = float(np.percentile(ms, p))
    return stats


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float] = (90, 99),
    goodput: dict[str, float] | None = None,
) -> dict:
    """The run's metrics under vLLM's result keys."""
    done = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_len or 0 for r in done)
    per_metric = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for r in done if (t := tpot(r)) is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    out = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration if duration else 0.0,
        "request_goodput": (
            sum(meets(r, goodput) for r in done) / duration if goodput and duration else None
        ),
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        "max_concurrent_requests": peak_concurrency(done),
    }
    for name in LATENCY_METRICS:
        for stat, value in latency_stats(per_metric[name], percentiles).items():
            out[f"{stat}_{name}_ms"] = value
    return out


def peak_concurrency(results: Iterable[RequestResult]) -> int:
    """Most requests open at once, over half-open [start, start + latency) intervals."""
    events = sorted(
        ev for r in results for ev in ((r.start_time, 1), (r.start_time + r.latency, -1))
    )
    peak = level = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def attainment(
    results: Sequence[RequestResult],
    class_slos: dict[str, dict[str, float]] | None = None,
    default_slo: dict[str, float] | None = None,
) -> dict[str, dict]:
    """Per class and over all ('all'): requests sent, requests that met their SLOs, and the
    fraction, and under "met" how many met each target on its own (which SLO a class misses).
    Classes without SLOs of their own use `default_slo`; with neither, every completed
    request counts as good."""
    class_slos = class_slos or {}
    tally: dict[str, dict] = {}
    for r in results:
        slo = class_slos.get(r.cls) or default_slo or {}
        good = meets(r, slo)
        for key in (r.cls, "all"):
            t = tally.setdefault(key, {"requests": 0, "good": 0, "met": {}})
            t["requests"] += 1
            t["good"] += good
            for metric, target in slo.items():
                t["met"][metric] = t["met"].get(metric, 0) + meets(r, {metric: target})
    return {
        key: {"requests": t["requests"], "good": t["good"],
              "attainment": t["good"] / t["requests"], "met": t["met"]}
        for key, t in sorted(tally.items(), key=lambda kv: (kv[0] == "all", kv[0]))
    }  # fmt: skip
