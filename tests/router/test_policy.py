"""Routing policies as plain objects: no sockets, no model, milliseconds."""

from __future__ import annotations

import subprocess
import sys

from tandem.core.cost_model import DEFAULT_PRIOR
from tandem.router.policy import (
    CostAware,
    LeastLoad,
    PrefixAware,
    PrefixTree,
    RoundRobin,
    RouteRequest,
    WorkerState,
)


def _workers(n=3, **loads) -> list[WorkerState]:
    ws = [WorkerState(f"w{i}", f"http://w{i}") for i in range(n)]
    for w in ws:
        w.running = loads.get(w.id, 0)
    return ws


def _route(policy, workers, text) -> WorkerState:
    request = RouteRequest(text)
    chosen = policy.rank(workers, request)[0]
    policy.routed(chosen, request)
    return chosen


def test_round_robin_takes_each_worker_in_turn():
    ws, rr = _workers(), RoundRobin()
    assert [rr.rank(ws, RouteRequest("x"))[0].id for _ in range(4)] == ["w0", "w1", "w2", "w0"]


def test_least_load_picks_the_idlest_and_shares_ties():
    ws, ll = _workers(w0=5, w1=1, w2=1), LeastLoad()
    assert {ll.rank(ws, RouteRequest("x"))[0].id for _ in range(4)} == {"w1", "w2"}


def test_the_prefix_tree_matches_leading_chunks_and_evicts_the_oldest():
    tree = PrefixTree(chunk_chars=4, capacity=3)
    tree.insert("aaaabbbbcccc")
    assert tree.match("aaaabbbbzzzz") == 2 and tree.match("zzzzaaaa") == 0
    tree.insert("ddddeeee")  # 5 chunks > capacity 3: the oldest go
    assert len(tree) == 3 and tree.match("aaaabbbb") == 0 and tree.match("ddddeeee") == 2


def test_prefix_aware_sends_a_conversation_back_where_its_prefix_is():
    ws, policy = _workers(), PrefixAware()
    history = "system prompt and tool output " * 20
    first = _route(policy, ws, history)
    others = {_route(policy, ws, f"another conversation {i} " * 20).id for i in range(2)}
    assert first.id not in others and len(others) == 2  # new prompts spread out
    for turn in range(3):
        history += f" turn {turn} asks for more rows"
        assert _route(policy, ws, history) is first
    assert policy.matched_chunks > 0


def test_prefix_aware_yields_to_load_when_workers_are_imbalanced():
    ws, policy = _workers(), PrefixAware(balance_abs=4, balance_rel=1.5)
    text = "shared context " * 40
    home = _route(policy, ws, text)
    home.running = 20  # now far busier than the rest
    assert _route(policy, ws, text) is not home


def test_cost_aware_prefers_the_cached_worker_until_its_queue_costs_more():
    ws, policy = _workers(), CostAware(DEFAULT_PRIOR)
    text = "long document " * 400
    home = _route(policy, ws, text)
    assert _route(policy, ws, text + " question") is home
    home.pending_prefill_tokens, home.waiting = 50_000, 30
    assert _route(policy, ws, text + " another question") is not home


def test_the_router_policies_import_no_torch():
    code = "import sys, tandem.router.policy, tandem.router.pool; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_request_withdrawn_after_failing_leaves_no_trace_on_that_worker():
    """The router retries a request that failed on a worker elsewhere: what its routing added
    to the failed worker's tree is taken back, what was there before stays."""
    ws, policy = _workers(), PrefixAware()
    shared = "a shared system prompt for every conversation " * 10
    first = _route(policy, ws, shared)
    request = RouteRequest(shared + " and a new question that failed " * 10)
    receipt = policy.routed(first, request)
    assert policy.trees[first.id].match(request.text) == policy.trees[first.id].chunks(request.text)
    policy.withdraw(first.id, receipt)
    tree = policy.trees[first.id]
    assert tree.match(request.text) == tree.match(shared) == tree.chunks(shared)


def test_a_restarted_worker_is_forgotten_when_its_health_names_another_instance():
    """The pool reads each worker's instance id from /health: a new id at the same URL (the
    process restarted, its cache is empty) makes the policy forget that worker's tree."""
    import asyncio

    import httpx

    from tandem.router.pool import WorkerPool

    instance = {"id": "first"}

    def worker(request: httpx.Request) -> httpx.Response:  # the worker, outside the pool
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok", "instance_id": instance["id"]})
        return httpx.Response(200, text="")

    async def run():
        client = httpx.AsyncClient(transport=httpx.MockTransport(worker))
        policy = PrefixAware()
        pool = WorkerPool(["http://w1"], policy, client)
        (w,) = pool.workers.values()
        await pool.probe(w)
        policy.routed(w.state, RouteRequest("cached context " * 20))
        await pool.probe(w)  # the same process: its tree stays
        assert policy.trees[w.state.id].match("cached context " * 20) > 0
        instance["id"] = "second"
        await pool.probe(w)
        assert policy.trees.get(w.state.id) is None and w.instance == "second"
        await client.aclose()

    asyncio.run(run())
