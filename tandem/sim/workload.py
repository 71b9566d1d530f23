"""Simulated requests at the token level: seeded generators (random lengths, shared
prefixes) with `tandem bench`'s arrival process, and replay of published traces (Mooncake's
JSONL with prefix-block hashes, Azure's LLM inference CSV). Prompts are token ids, so
requests that share a prefix share it token for token and the radix cache sees it."""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from tandem.bench.arrivals import arrival_times
from tandem.bench.workloads import LengthRange, RequestClass

VOCAB = 32000
MOONCAKE_BLOCK = 512  # tokens per hash id in Mooncake's traces


class RandomTokens(Sequence):
    """`n` token ids drawn from a seed, made each time they are read: an hour of traffic
    holds hundreds of millions of prompt tokens, which would not fit in memory as tuples,
    while only the requests in flight need theirs."""

    __slots__ = ("seed", "n")

    def __init__(self, seed: tuple[int, ...], n: int) -> None:
        self.seed, self.n = seed, n

    def _ids(self) -> list[int]:
        return np.random.default_rng(self.seed).integers(0, VOCAB, self.n).tolist()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return self._ids()[i]

    def __iter__(self):
        return iter(self._ids())

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == self.n and list(self) == list(other)

    def __hash__(self) -> int:
        return hash((self.seed, self.n))

    def __repr__(self) -> str:
        return f"RandomTokens(seed={self.seed}, n={self.n})"


@dataclass(frozen=True)
class SimRequest:
    arrival: float  # seconds from the start
    prompt: Sequence[int]  # token ids (a tuple, or RandomTokens)
    output_len: int
    cls: str = "default"
    priority: int | None = None  # lower is more urgent, as vLLM
    slo: dict[str, float] = field(default_factory=dict, hash=False)  # ttft | tpot | e2el -> ms


def random_requests(n: int, input_len: int, output_len: int, rate: float, seed: int = 0,
                    range_ratio: float = 0.0, burstiness: float = 1.0) -> list[SimRequest]:  # fmt: skip
    rng = random.Random(seed)
    times = arrival_times(n, rate, burstiness, seed)
    inp = LengthRange.around(input_len, range_ratio)  # vLLM's --random-range-ratio
    out = LengthRange.around(output_len, range_ratio)
    return [
        SimRequest(t, RandomTokens((seed, i), inp.draw(rng)), out.draw(rng))
        for i, t in enumerate(times)
    ]


def diurnal_requests(duration: float, trough: float, peak: float, input_len: int,
                     output_len: int, seed: int = 0, range_ratio: float = 0.0,
                     slo: dict[str, float] | None = None) -> list[SimRequest]:  # fmt: skip
    """Poisson arrivals whose rate swings from `trough` (at 0 and `duration`) to `peak`
    (halfway) requests/s, a day's curve in `duration` seconds (thinning a `peak`-rate
    process); lengths as random_requests'."""
    import math

    rng = random.Random(seed)
    inp = LengthRange.around(input_len, range_ratio)
    out = LengthRange.around(output_len, range_ratio)
    requests, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return requests
        rate = trough + (peak - trough) * (1 - math.cos(2 * math.pi * t / duration)) / 2
        if rng.random() < rate / peak:
            n = len(requests)
            requests.append(SimRequest(t, RandomTokens((seed, n), inp.draw(rng)), out.draw(rng),
                                       slo=dict(slo or {})))  # fmt: skip


def shifting_mix_requests(duration: float, rate: float, prompt_heavy: tuple[int, int],
                          decode_heavy: tuple[int, int], seed: int = 0, range_ratio: float = 0.0,
                          slo: dict[str, float] | None = None, high: float = 0.9,
                          low: float = 0.1) -> list[SimRequest]:  # fmt: skip
    """Poisson arrivals at `rate` requests/s, each prompt-heavy or decode-heavy ((input_len,
    output_len) pairs): the prompt-heavy share moves from `high` (at 0 and `duration`) to
    `low` (halfway) on a cosine, so the work shifts from prompts to decodes and back."""
    import math

    rng = random.Random(seed)
    kinds = [tuple(LengthRange.around(n, range_ratio) for n in pair) for pair in (prompt_heavy, decode_heavy)]  # fmt: skip
    requests, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return requests
        share = low + (high - low) * (1 + math.cos(2 * math.pi * t / duration)) / 2
        inp, out = kinds[0] if rng.random() < share else kinds[1]
        n = len(requests)
        requests.append(SimRequest(t, RandomTokens((seed, n), inp.draw(rng)), out.draw(rng),
                                   slo=dict(slo or {})))  # fmt: skip


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
    for i, t in enumerate(times):
        c = rng.choices(classes, weights)[0]
        prompt = RandomTokens((seed, i), c.input_len.draw(rng))
        out.append(SimRequest(t, prompt, c.output_len.draw(rng), c.name, c.priority, c.slo))
    return out


def from_bench(sessions, encode, rate: float, burstiness: float = 1.0,
               seed: int = 0) -> list[SimRequest]:  # fmt: skip
    """The requests a `tandem bench serve` run of these single-request sessions sends, at the
    arrival times it draws (same rate, burstiness and seed), each prompt as `encode` (the
    server's tokenizer) turns it into ids: a simulation of the very run."""
    times = arrival_times(len(sessions), rate, burstiness, seed)
    out = []
    for t, session in zip(times, sessions):
        if len(session.requests) != 1:
            raise ValueError("from_bench: multi-turn sessions depend on earlier replies")
        r = session.requests[0]
        out.append(SimRequest(t, tuple(encode(r.prompt)), r.output_len, r.cls, r.priority))
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


def multi_turn_requests(conversations: int, turns: int, input_len: int, output_len: int,
                        rate: float, think_time: float, seed: int = 0) -> list[SimRequest]:  # fmt: skip
    """Conversations starting at `rate` (Poisson); each turn resends the whole history (its
    earlier prompts and the replies, which simulated instances generate as SIM_TOKEN) plus
    input_len new tokens, `think_time` seconds after the previous turn began. The history is
    then exactly the tokens an instance that served the previous turn holds KV for."""
    from tandem.sim.runner import SIM_TOKEN

    out = []
    for c, start in enumerate(arrival_times(conversations, rate, 1.0, seed)):
        history: tuple[int, ...] = ()
        for t in range(turns):
            history += tuple(RandomTokens((seed, c, t), input_len))
            out.append(SimRequest(start + t * think_time, history, output_len, "multi-turn"))
            history += (SIM_TOKEN,) * output_len
    return sorted(out, key=lambda r: r.arrival)


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
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            stamp = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26]).timestamp()
            rows.append((stamp, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            if limit and len(rows) >= limit:
                break
    start = min((r[0] for r in rows), default=0.0)
    return [
        SimRequest(t - start, RandomTokens((seed, i), max(1, n)), max(1, m))
        for i, (t, n, m) in enumerate(rows)
    ]
