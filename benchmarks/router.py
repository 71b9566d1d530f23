"""`tandem router` policies on one machine, one run:

    python benchmarks/router.py [--conversations 12] [--turns 4]

1. Three workers (each one torch thread: this machine's cores are shared, say so) behind a
   router running round_robin, least_load and prefix_aware in turn on the same seeded
   multi-turn workload (`tandem bench serve --dataset-name multi-turn`, each turn resending
   the growing context): the workers' prefix-cache hit rate (their own counters) and mean TTFT.
   Each policy gets freshly started workers, so no policy inherits another's cache.
2. Router overhead: sequential one-token requests to a worker through a router and direct,
   alternating; p50 of the difference in latency.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("round_robin", "least_load", "prefix_aware")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def counters(url: str) -> tuple[float, float]:
    q = h = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("tandem:prefix_cache_queries_total"):
            q += float(line.rsplit(" ", 1)[1])
        elif line.startswith("tandem:prefix_cache_hits_total"):
            h += float(line.rsplit(" ", 1)[1])
    return q, h


def workers(args, out: Path, tag: str):
    from tandem.bench.servers import tandem_server

    servers = []
    for i in range(args.workers):
        s = tandem_server(free_port(), args.model, ["--kv-cache-memory", "1",
                          "--disable-uvicorn-access-log"], out / f"{tag}-worker{i}.log")  # fmt: skip
        s.env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        s.name = f"{tag}-worker{i}"
        servers.append(s)
    return servers


def router(out: Path, tag: str, urls: list[str], policy: str):
    from tandem.bench.servers import ManagedServer

    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "router", "--host", "127.0.0.1", "--port",
           str(port), "--policy", policy, "--worker", *urls]  # fmt: skip
    return ManagedServer(f"router-{tag}", cmd, f"http://127.0.0.1:{port}", out / f"{tag}.log")


def run_policy(args, out: Path, policy: str) -> dict:
    ws = workers(args, out, policy)
    for w in ws:
        w.start()
    r = router(out, policy, [w.base_url for w in ws], policy)
    try:
        for w in ws:
            w.wait_ready(600)
        r.start()
        r.wait_ready(60)
        cmd = [sys.executable, "-m", "tandem.cli", "bench", "serve", "--base-url", r.base_url,
               "--dataset-name", "multi-turn", "--num-prompts", str(args.conversations * args.turns),
               "--turns", str(args.turns), "--random-input-len", str(args.turn_input),
               "--random-output-len", str(args.turn_output), "--random-range-ratio", "0",
               "--request-rate", "inf", "--max-concurrency", str(args.concurrency),
               "--seed", str(args.seed), "--ignore-eos", "--disable-tqdm", "--save-result",
               "--result-dir", str(out), "--result-filename", f"{policy}.json"]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        result = json.loads((out / f"{policy}.json").read_text())
        q, h = map(sum, zip(*(counters(w.base_url) for w in ws)))
        return {"hit_rate": h / q if q else 0.0, "mean_ttft_ms": result["mean_ttft_ms"],
                "completed": result["completed"]}  # fmt: skip
    finally:
        r.stop()
        for w in ws:
            w.stop()


_INSTANT = """
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

async def answer(request):
    await request.body()
    return Response(b'{"choices": [{"index": 0, "text": "x"}]}', media_type="application/json")

async def ok(request):
    return Response(b"")

app = Starlette(routes=[Route("/v1/completions", answer, methods=["POST"]),
                        Route("/health", ok), Route("/metrics", ok), Route("/v1/models", ok)])
"""


def instant_worker(out: Path):
    """A worker that answers at once: what the router costs without a model beside it."""
    from tandem.bench.servers import ManagedServer

    (out / "instant_worker.py").write_text(_INSTANT)
    port = free_port()
    cmd = [sys.executable, "-m", "uvicorn", "--app-dir", str(out), "instant_worker:app",
           "--port", str(port), "--log-level", "warning"]  # fmt: skip
    return ManagedServer("instant", cmd, f"http://127.0.0.1:{port}", out / "instant.log")


def overhead(args, out: Path, instant: bool = False) -> dict:
    if instant:
        w = instant_worker(out)
    else:
        (w,) = workers(argparse.Namespace(**{**vars(args), "workers": 1}), out, "overhead")
    w.start()
    r = router(out, "overhead", [w.base_url], "prefix_aware")
    try:
        w.wait_ready(600)
        r.start()
        r.wait_ready(60)
        body = {"prompt": "hello", "max_tokens": 1, "temperature": 0}
        direct, routed = [], []
        with httpx.Client(timeout=30) as c:
            for i in range(args.overhead_requests + 10):
                for url, times in ((w.base_url, direct), (r.base_url, routed)):
                    t0 = time.perf_counter()
                    c.post(url + "/v1/completions", json=body).raise_for_status()
                    if i >= 10:  # warm-up
                        times.append(time.perf_counter() - t0)
        diffs = [a - b for a, b in zip(routed, direct)]
        return {"p50_direct_ms": statistics.median(direct) * 1e3,
                "p50_routed_ms": statistics.median(routed) * 1e3,
                "p50_overhead_ms": statistics.median(diffs) * 1e3}  # fmt: skip
    finally:
        r.stop()
        w.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-input", type=int, default=192)
    ap.add_argument("--turn-output", type=int, default=16)
    ap.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="conversations at once (a multiple of --workers lets round robin land each turn on "
        "its conversation's worker by accident, in lockstep)",
    )
    ap.add_argument("--overhead-requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-dir", default="bench-results/router")
    ap.add_argument("--only-overhead", action="store_true")
    args = ap.parse_args()
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {} if args.only_overhead else {p: run_policy(args, out, p) for p in POLICIES}
    cost = overhead(args, out)
    bare = overhead(args, out, instant=True)
    if args.only_overhead:
        print(cost, bare)
        return
    print(f"\n{args.workers} workers, {args.threads} torch thread each, on {os.cpu_count()} "
          f"cores; {args.conversations} conversations x {args.turns} turns, "
          f"{args.concurrency} at a time")  # fmt: skip
    print(f"  {'policy':<14} {'prefix hit rate':>16} {'mean TTFT ms':>13}")
    for p, r in results.items():
        print(f"  {p:<14} {r['hit_rate']:>16.1%} {r['mean_ttft_ms']:>13.0f}")
    rr, pa = results["round_robin"], results["prefix_aware"]
    print(f"  prefix_aware / round_robin hit rate: {pa['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x"
          f" (target >= 2x); mean TTFT {pa['mean_ttft_ms'] / rr['mean_ttft_ms']:.2f}x")  # fmt: skip
    print(f"router overhead, one-token requests: p50 direct {cost['p50_direct_ms']:.2f} ms, "
          f"through the router {cost['p50_routed_ms']:.2f} ms, p50 difference "
          f"{cost['p50_overhead_ms']:.2f} ms (target < 2 ms)")  # fmt: skip
    print(f"  against a worker that answers at once (no model competing for the cores): p50 "
          f"direct {bare['p50_direct_ms']:.2f} ms, routed {bare['p50_routed_ms']:.2f} ms, "
          f"difference {bare['p50_overhead_ms']:.2f} ms")  # fmt: skip
    (out / "router.json").write_text(json.dumps({"policies": results, "overhead": cost,
                                                 "overhead_instant_worker": bare,
                                                 "args": vars(args)}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
