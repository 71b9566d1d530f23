"""Routing policies: plain Python, no torch, no I/O, so the simulator can run them too.

    order = policy.rank(workers, request)   # preference order among healthy workers
    receipt = policy.routed(worker, request)  # what the worker now holds (prefix-aware)
    policy.withdraw(worker_id, receipt)     # ... unless the request failed there (retried)
    policy.forget(worker_id)                # a worker removed or restarted

A policy never sees sockets: the pool (router/pool.py) hands it `WorkerState`s, refreshed
from each worker's /metrics and from the router's own count of requests in flight.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from tandem.core.cost_model import CostModel, StepShape

CHARS_PER_TOKEN = 4  # the router does not tokenize; a prompt's tokens are estimated from it


@dataclass
class WorkerState:
    id: str
    url: str
    healthy: bool = True
    in_flight: int = 0  # requests the router has sent and not yet finished
    pending_prefill_tokens: int = 0  # estimated prompt tokens sent, no first byte back yet
    running: int = 0  # from the worker's /metrics
    waiting: int = 0
    kv_usage: float = 0.0
    draining: bool = False  # being removed (autoscaler): no new requests

    @property
    def load(self) -> int:
        return max(self.in_flight, self.running + self.waiting)


@dataclass(frozen=True)
class RouteRequest:
    text: str  # the prompt as the router sees it (completions prompt, or chat messages)
    session: str | None = None  # the agent session it is a turn of (SessionAffinity's)

    @property
    def tokens(self) -> int:
        return max(1, len(self.text) // CHARS_PER_TOKEN)


class RoutingPolicy(Protocol):
    reads_text: bool

    def rank(self, workers: list[WorkerState], request: RouteRequest) -> list[WorkerState]: ...

    def routed(self, worker: WorkerState, request: RouteRequest) -> object: ...

    def withdraw(self, worker_id: str, receipt: object) -> None: ...

    def forget(self, worker_id: str) -> None: ...


class RoundRobin:
    reads_text = False  # does it read the prompt's text? (a simulator need not make it)

    def __init__(self) -> None:
        self._turn = itertools.count()

    def rank(self, workers, request):
        if not workers:
            return []
        first = next(self._turn) % len(workers)
        return workers[first:] + workers[:first]

    def routed(self, worker, request) -> object:
        return None

    def withdraw(self, worker_id, receipt) -> None:
        pass

    def forget(self, worker_id) -> None:
        pass


class LeastLoad(RoundRobin):
    """Fewest requests running and waiting (ties in turn, so equal workers share)."""

    def rank(self, workers, request):
        return sorted(super().rank(workers, request), key=lambda w: (w.load, w.kv_usage))


class PrefixTree:
    """An approximate radix tree of what one worker has cached: the chained hashes of a
    prompt's fixed-size character chunks, as the engine hashes token blocks, with LRU
    eviction. `match` counts a prompt's leading chunks it holds."""

    def __init__(self, chunk_chars: int = 64, capacity: int = 200_000) -> None:
        self.chunk_chars, self.capacity = chunk_chars, capacity
        self._seen: OrderedDict[int, None] = OrderedDict()

    def _chain(self, text: str):
        h = 0
        for i in range(0, len(text) - self.chunk_chars + 1, self.chunk_chars):
            h = hash((h, text[i : i + self.chunk_chars]))
            yield h

    def chunks(self, text: str) -> int:
        return len(text) // self.chunk_chars

    def match(self, text: str) -> int:
        n = 0
        for h in self._chain(text):
            if h not in self._seen:
                break
            n += 1
        return n

    def insert(self, text: str) -> list[int]:
        """Record the prompt's chunks; -> the ones that were new (what `remove` takes back)."""
        new = []
        for h in self._chain(text):
            if h not in self._seen:
                new.append(h)
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return new

    def remove(self, chunks: list[int]) -> None:
        for h in chunks:
            self._seen.pop(h, None)

    def __len__(self) -> int:
        return len(self._seen)


class PrefixAware(LeastLoad):
    """SGLang's cache-aware rule: while the load is balanced, send a request to the worker
    holding the longest part of its prompt (if that part is at least `cache_threshold` of
    it), else to the least loaded, caching least; once the busiest worker has `balance_abs` more requests
    than the idlest and `balance_rel` times as many, least load decides alone."""

    reads_text = True

    def __init__(
        self, cache_threshold: float = 0.3, balance_abs: int = 8, balance_rel: float = 1.5
    ) -> None:
        super().__init__()
        self.cache_threshold, self.balance_abs, self.balance_rel = (
            cache_threshold, balance_abs, balance_rel,
        )  # fmt: skip
        self.trees: dict[str, PrefixTree] = {}
        self.matched_chunks = self.queried_chunks = 0  # the router's hit-rate estimate

    def _tree(self, worker_id: str) -> PrefixTree:
        return self.trees.setdefault(worker_id, PrefixTree())

    def rank(self, workers, request):
        by_load = super().rank(workers, request)
        if not by_load:
            return by_load
        loads = [w.load for w in by_load]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(
            loads
        ):
            return by_load
        total = self._tree(by_load[0].id).chunks(request.text)
        matches = {w.id: self._tree(w.id).match(request.text) for w in by_load}
        best = max(by_load, key=lambda w: matches[w.id])  # the least loaded among equals
        self.queried_chunks += total
        self.matched_chunks += matches[best.id]
        if total and matches[best.id] / total >= self.cache_threshold:
            return [best] + [w for w in by_load if w is not best]
        # a new prompt: the least loaded, then the one caching least (room for it), as SGLang
        return sorted(by_load, key=lambda w: (w.load, len(self._tree(w.id))))

    def routed(self, worker, request) -> object:
        return self._tree(worker.id).insert(request.text)

    def withdraw(self, worker_id, receipt) -> None:
        """The request failed on the worker before it computed anything: the chunks its
        routing added there are not cached there after all."""
        tree = self.trees.get(worker_id)
        if tree is not None and receipt:
            tree.remove(receipt)

    def forget(self, worker_id) -> None:
        self.trees.pop(worker_id, None)


class CostAware(PrefixAware):
    """Lowest predicted time to first token: the prompt tokens the worker must compute (its
    uncached part, from the prefix estimate) plus those queued ahead of it, priced by the
    step-latency cost model with the worker's running requests decoding alongside."""

    def __init__(self, cost_model: CostModel, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cost_model = cost_model

    def predicted_ttft(self, worker: WorkerState, request: RouteRequest) -> float:
        tree = self._tree(worker.id)
        cached = tree.match(request.text) * tree.chunk_chars // CHARS_PER_TOKEN
        tokens = max(1, request.tokens - cached) + worker.pending_prefill_tokens
        shape = StepShape.prompt(tokens, worker.running)
        return self.cost_model.predict(shape) + worker.waiting * self.cost_model.predict(
            StepShape(decode_rows=max(1, worker.running))
        )

    def rank(self, workers, request):
        by_load = LeastLoad.rank(self, workers, request)
        return sorted(by_load, key=lambda w: self.predicted_ttft(w, request))


class SessionAffinity:
    """A turn of an agent session goes to the worker its session lives on (exact ids: a
    dict, never a prefix match), ahead of whatever the inner policy prefers; a session's first
    turn, or one whose worker is gone, goes where the inner policy says and is bound there.
    The binding yields when it would make the load too uneven: past `max_load_ratio` times
    the least loaded worker's load (plus `slack` requests) the inner policy decides."""

    def __init__(
        self, inner: RoutingPolicy, max_load_ratio: float = 2.0, slack: int = 4,
        capacity: int = 100_000,
    ) -> None:  # fmt: skip
        self.inner, self.max_load_ratio, self.slack = inner, max_load_ratio, slack
        self.reads_text = inner.reads_text
        self.bound: OrderedDict[str, str] = OrderedDict()  # session -> worker id, LRU
        self.capacity = capacity

    def __getattr__(self, name: str):
        """What the inner policy exposes (its prefix trees and hit counts), as its own."""
        if name == "inner":  # (not set yet: unpickling, copying)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def worker_of(self, session: str) -> str | None:
        return self.bound.get(session)

    def bind(self, session: str, worker_id: str) -> None:
        self.bound[session] = worker_id
        self.bound.move_to_end(session)
        while len(self.bound) > self.capacity:
            self.bound.popitem(last=False)

    def unbind(self, session: str) -> None:
        self.bound.pop(session, None)

    def rank(self, workers, request):
        order = self.inner.rank(workers, request)
        home = self.bound.get(request.session) if request.session else None
        mine = next((w for w in order if w.id == home), None)
        if mine is None:
            return order
        least = min(w.load for w in order)
        if mine.load > self.max_load_ratio * least + self.slack:
            return order  # too uneven: the session moves (its worker's KV stays behind)
        return [mine] + [w for w in order if w is not mine]

    def routed(self, worker, request) -> object:
        if request.session:
            self.bind(request.session, worker.id)
        return self.inner.routed(worker, request)

    def withdraw(self, worker_id, receipt) -> None:
        self.inner.withdraw(worker_id, receipt)

    def forget(self, worker_id) -> None:
        for session in [s for s, w in self.bound.items() if w == worker_id]:
            del self.bound[session]
        self.inner.forget(worker_id)


def session_of(body, headers) -> str | None:
    """The agent session a request names, as tandem serve reads it: `session_id`, SGLang's
    `session_params.id`, or the `x-session-id` header."""
    if isinstance(body, dict):
        if isinstance(body.get("session_id"), str):
            return body["session_id"]
        params = body.get("session_params")
        if isinstance(params, dict) and isinstance(params.get("id"), str):
            return params["id"]
    for name, value in headers.items():
        if name.lower() == "x-session-id":
            return value
    return None


def prompt_text(body) -> str:
    """What the router sees of a prompt, for prefix-aware routing."""
    if not isinstance(body, dict):
        return ""
    if "messages" in body and isinstance(body["messages"], list):
        parts = []
        for m in body["messages"]:
            if isinstance(m, dict):
                content = m.get("content")
                parts.append(
                    f"<{m.get('role')}>{content if isinstance(content, str) else json.dumps(content)}"
                )
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return " ".join(map(str, prompt))
    return json.dumps(prompt) if prompt is not None else ""


POLICIES = ("round_robin", "least_load", "prefix_aware", "cost")


def build_policy(name: str, cost_model: CostModel | None = None) -> SessionAffinity:
    """The named policy, inside session affinity (requests without a session pass through)."""
    return SessionAffinity(_inner_policy(name, cost_model))


def _inner_policy(name: str, cost_model: CostModel | None) -> RoutingPolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "prefix_aware":
        return PrefixAware()
    if name == "cost":
        from tandem.core.cost_model import DEFAULT_PRIOR

        return CostAware(cost_model or DEFAULT_PRIOR)
    raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
