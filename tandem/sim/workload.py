"""Simulated requests at the token level: seeded generators (random lengths, shared
prefixes) with `tandem bench`'s arrival process, and replay of published traces (Mooncake's
JSONL with prefix-block hashes, Azure's LLM inference CSV). Prompts are token ids, so
requests that share a prefix share it token for token and the radix cache sees it."""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tandem.bench.arrivals import arrival_times
from tandem.bench.workloads import RequestClass

VOCAB = 32000
MOONCAKE_BLOCK = 512  # tokens per hash id in Mooncake's traces


@dataclass(frozen=True)
class SimRequest:
    arrival: float  # seconds from the start
    prompt: tuple[int, ...]
    output_len: int
    cls: str = "default"
    priority: int | None = None  # lower is more urgent, as vLLM
    slo: dict[str, float] = field(default_factory=dict, hash=False)  # ttft | tpot | e2el -> ms


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def random_requests(n: int, input_len: int, output_len: int, rate: float, seed: int = 0,
                    range_ratio: float = 0.0, burstiness: float = 1.0) -> list[SimRequest]:  # fmt: skip
    rng = random.Random(seed)
    times = arrival_times(n, rate, burstiness, seed)
    return [
        SimRequest(
            t,
            tuple(rng.randrange(VOCAB) for _ in range(_lengths(rng, input_len, range_ratio))),
            _lengths(rng, output_len, range_ratio),
        )
        for t in times
    ]


def multi_class_requests(n: int, classes: list[RequestClass], rate: float, seed: int = 0,
                         burstiness: float = 1.0) -> list[SimRequest]:  # fmt: skip
    """Each request's class drawn by share (`tandem bench --class` specs); its lengths,
    priority and SLOs from its class."""
    if not classes:
        raise ValueError("classes: give at least one --class")
    rng = random.Random(seed)
    times = arrival_times(n, rate, burstiness, seed)
    weights = [c.share for c in classes]
    out = []
    for t in times:
        c = rng.choices(classes, weights)[0]
        prompt = tuple(rng.randrange(VOCAB) for _ in range(c.input_len.draw(rng)))
        out.append(SimRequest(t, prompt, c.output_len.draw(rng), c.name, c.priority, c.slo))
    return out


def shared_prefix_requests(n: int, groups: int, prefix_len: int, input_len: int,
                           output_len: int, rate: float, seed: int = 0) -> list[SimRequest]:  # fmt: skip
    """Each request: one of `groups` shared prefixes of prefix_len tokens, then its own
    input_len tokens."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(VOCAB) for _ in range(prefix_len)) for _ in range(groups)]
    times = arrival_times(n, rate, 1.0, seed)
    return [
        SimRequest(
            t,
            prefixes[i % groups] + tuple(rng.randrange(VOCAB) for _ in range(input_len)),
            output_len,
        )  # fmt: skip
        for i, t in enumerate(times)
    ]


def _block_tokens(hash_id: int, size: int) -> tuple[int, ...]:
    rng = random.Random(hash_id)
    return tuple(rng.randrange(VOCAB) for _ in range(size))


def mooncake_trace(path: str | Path, limit: int | None = None) -> list[SimRequest]:
    """Mooncake's JSONL: {"timestamp" (ms), "input_length", "output_length", "hash_ids"}; each
    hash id is a 512-token block, so equal ids are equal tokens (the last block is cut to
    input_length)."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            n = int(row["input_length"])
            tokens: tuple[int, ...] = ()
            for h in row.get("hash_ids") or []:
                tokens += _block_tokens(int(h), MOONCAKE_BLOCK)
            if len(tokens) < n:  # no (or too few) hashes: the rest is this request's own
                tokens += _block_tokens(hash((row["timestamp"], len(requests))), n - len(tokens))
            requests.append(
                SimRequest(float(row["timestamp"]) / 1000, tokens[:n], int(row["output_length"]))
            )
            if limit and len(requests) >= limit:
                break
    start = min((r.arrival for r in requests), default=0.0)
    return [SimRequest(r.arrival - start, r.prompt, r.output_len) for r in requests]


def azure_trace(path: str | Path, limit: int | None = None, seed: int = 0) -> list[SimRequest]:
    """Azure's LLM inference trace CSV: TIMESTAMP, ContextTokens, GeneratedTokens (no prefix
    information: prompts are random)."""
    rng = random.Random(seed)
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            stamp = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26]).timestamp()
            rows.append((stamp, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            if limit and len(rows) >= limit:
                break
    start = min((r[0] for r in rows), default=0.0)
    return [
        SimRequest(t - start, tuple(rng.randrange(VOCAB) for _ in range(max(1, n))), max(1, m))
        for t, n, m in rows
    ]
