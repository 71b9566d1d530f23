"""KV tiers behind the radix cache: what host memory and a shared Redis buy, and what they
cost when nothing hits. Real servers on loopback, the default model, one run; ratios.

    python benchmarks/kv_tiers.py [--model PATH] [--only multiround,sequential,redis,unique] [--json F]

multiround  LMCache's multi-round QA: 8 users x 6 rounds, all users at once, each round
            after that user's previous answer. A prompt is a 512-token system prompt shared
            by all, 1,024 tokens of the user's own context, then the conversation so far
            (32-token questions, 64-token answers). The KV pool holds a fifth of the working
            set. Mean TTFT of rounds >= 2, tiers off vs a host-memory tier.
sequential  The same conversations one request at a time (user 0's round 1, user 1's...):
            TTFT is then the prompt's own cost, not the queue's, and greedy output must be
            identical with the tier on and off.
redis       Two instances and one real redis-server on loopback. Instance A computes 16
            users' contexts (512 shared + 1,024 own tokens) and stores them in Redis; a fresh
            instance B then takes each user's follow-up, all 16 at once, and loads the
            context instead of computing it. Baseline: a fresh instance without tiers on the
            same 16 requests (recompute). Mean TTFT ratio, and the worst request's own ratio.
            Then one request at a time: B's first request for a prefix A computed against a
            cold instance's.
unique      0% hits: 64 all-new 512-token prompts, 128 output tokens, 16 in flight: output
            tokens per second with a host tier, and with host + Redis tiers (every block
            stored), vs tiers off; 3 rounds, each configuration first once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx

from tandem.bench.servers import ManagedServer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server(ManagedServer):
    """`tandem serve` on a free loopback port, started and ready."""

    def __init__(self, model: str | None, name: str, *flags: str) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "tandem.cli", "serve", *([model] if model else []),
               "--port", str(port), "--disable-uvicorn-access-log", *flags]  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        super().__init__(name, cmd, url, Path(f"/tmp/kv_tiers_{name}.log"))
        self.url = url
        self.start()
        self.wait_ready(600)

    def metric(self, name: str) -> float:
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(f"tandem:{name}"):
                total += float(line.rsplit(" ", 1)[1])
        return total


async def complete(client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[str]]:
    """(TTFT in seconds, the output tokens as the logprobs name them) of one streamed
    completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0}  # fmt: skip
    t0, ttft, tokens = time.perf_counter(), None, []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            got = (choice.get("logprobs") or {}).get("tokens") or []
            if got and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += got
    return ttft, tokens


def client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=1800, limits=limits)


async def at_once(
    url: str, prompts: list[list[int]], max_tokens: int
) -> list[tuple[float, list[int]]]:
    async with client() as c:
        return await asyncio.gather(*(complete(c, url, p, max_tokens) for p in prompts))


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


# ---- multiround -----------------------------------------------------------------------
def multiround(model, users=8, rounds=6, system=512, context=1024, question=32, answer=64,
               concurrent=True):  # fmt: skip
    rng = random.Random(0)
    shared = tokens(rng, system)
    contexts = [shared + tokens(rng, context) for _ in range(users)]
    questions = [[tokens(rng, question) for _ in range(rounds)] for _ in range(users)]
    # what each user's client sends back as the answer in its next prompt: fixed ids, so
    # both runs send the same prompts whatever the model said
    answers = [[tokens(rng, answer) for _ in range(rounds)] for _ in range(users)]
    working_set = system + users * (context + rounds * (question + answer))
    pool_blocks = working_set // 5 // BLOCK
    print(f"multiround: {users} users x {rounds} rounds, working set {working_set} tokens, "
          f"pool {pool_blocks} blocks of {BLOCK} ({pool_blocks * BLOCK} tokens)")  # fmt: skip
    base = [
        "--num-kv-blocks",
        str(pool_blocks),
        "--block-size",
        str(BLOCK),
        "--max-num-seqs",
        str(users),
    ]

    histories = [list(ctx) for ctx in contexts]

    async def turn(c, url, u, r, ttfts, outs):
        histories[u] += questions[u][r]
        ttft, out = await complete(c, url, histories[u], answer)
        ttfts.append((r, ttft))
        outs.append((u, r, out))
        histories[u] += answers[u][r]  # the client's next prompt: ids for the answer's text

    async def user(c, url, u, ttfts, outs):
        for r in range(rounds):
            await turn(c, url, u, r, ttfts, outs)

    results = {}
    for name, flags in (("off", []), ("host", ["--kv-offloading-size", "2"])):
        server = Server(model, f"multiround_{name}", *base, *flags)
        try:
            ttfts, outs = [], []

            histories[:] = [list(ctx) for ctx in contexts]

            async def run(url=server.url, ttfts=ttfts, outs=outs):
                async with client() as c:
                    if concurrent:  # every user at once, each after its previous answer
                        await asyncio.gather(*(user(c, url, u, ttfts, outs) for u in range(users)))
                    else:  # one request at a time: user 0's round 1, user 1's round 1, ...
                        for r in range(rounds):
                            for u in range(users):
                                await turn(c, url, u, r, ttfts, outs)

            t0 = time.perf_counter()
            asyncio.run(run())
            took = time.perf_counter() - t0
            later = [t for r, t in ttfts if r >= 1]
            first = [t for r, t in ttfts if r == 0]
            loaded = server.metric("kv_offload_loaded_tokens_total")
            results[name] = dict(round1=statistics.mean(first), later=statistics.mean(later), total=took,
                                 loaded=loaded, outs=sorted(outs))  # fmt: skip
            print(f"  {name:5s} round 1 mean TTFT {statistics.mean(first):6.2f} s, rounds >= 2 "
                  f"{statistics.mean(later):6.2f} s (p90 {pct(later, 90):.2f}), all in {took:.0f} s, "
                  f"tokens loaded {loaded:.0f}")  # fmt: skip
        finally:
            server.stop()
    ratio = results["off"]["later"] / results["host"]["later"]
    # One at a time, every batch is one request, so greedy output must not change; all at
    # once, batches differ between the runs and bf16 greedy is not batch-invariant.
    same = results["off"]["outs"] == results["host"]["outs"]
    mode = "all users at once" if concurrent else "one request at a time"
    print(f"multiround ({mode}): rounds >= 2 mean TTFT {ratio:.2f}x lower with the host tier "
          f"(greedy outputs identical: {same})")  # fmt: skip
    return {"rounds_ge2_ttft_off_s": results["off"]["later"], "rounds_ge2_ttft_host_s": results["host"]["later"],
            "ttft_ratio": ratio, "outputs_identical": same}  # fmt: skip


def multiround_sequential(model):
    return multiround(model, concurrent=False)


# ---- redis --------------------------------------------------------------------------
def redis_shared(model, users=16, system=512, context=1024, question=32, answer=16):
    from tests.redis_server import RedisServer

    rng = random.Random(1)
    shared = tokens(rng, system)
    contexts = [shared + tokens(rng, context) for _ in range(users)]
    follow = [ctx + tokens(rng, question) for ctx in contexts]
    solo_ctx = [shared + tokens(rng, context) for _ in range(4)]
    redis = RedisServer(Path("/tmp"), maxmemory="4gb").start()
    base = ["--block-size", str(BLOCK), "--max-num-seqs", str(users)]
    tier = ["--kv-remote-url", redis.url]
    try:
        a = Server(model, "redis_a", *base, *tier)
        asyncio.run(at_once(a.url, contexts + solo_ctx, 1))  # computed, stored in Redis
        time.sleep(3)  # the writes behind the steps
        a.stop()
        b = Server(model, "redis_b", *base, *tier)
        cold = Server(model, "redis_cold", *base)
        try:
            warm = [tokens(rng, 64)]
            for s in (b, cold):
                asyncio.run(at_once(s.url, warm, 1))
            # one at a time: B's first request for a prefix A computed, vs a cold instance
            solo_hit, solo_cold = [], []
            for ctx in solo_ctx:
                q = ctx + tokens(rng, question)
                solo_hit.append(asyncio.run(at_once(b.url, [q], answer))[0][0])
                solo_cold.append(asyncio.run(at_once(cold.url, [q], answer))[0][0])
            hit = asyncio.run(at_once(b.url, follow, answer))
            recompute = asyncio.run(at_once(cold.url, follow, answer))
            loaded = b.metric("kv_offload_loaded_tokens_total")
        finally:
            b.stop(), cold.stop()
    finally:
        redis.kill()
    h, r = [t for t, _ in hit], [t for t, _ in recompute]
    mean_ratio = statistics.mean(h) / statistics.mean(r)
    worst = max(x / y for x, y in zip(h, r))
    print("redis: TTFT per request (s), loading / recomputing: "
          + ", ".join(f"{x:.2f}/{y:.2f}" for x, y in zip(h, r)))  # fmt: skip
    solo = statistics.mean(solo_hit) / statistics.mean(solo_cold)
    same = [o for _, o in hit] == [o for _, o in recompute]
    print(f"redis: {users} at once, mean TTFT {statistics.mean(h):.2f} s loading vs "
          f"{statistics.mean(r):.2f} s recomputing: {mean_ratio:.2f}x; worst request {worst:.2f}x "
          f"its recompute; tokens loaded {loaded:.0f}; outputs identical: {same}")  # fmt: skip
    print(f"redis: second instance's first request for a prefix the first computed, one at a time: "
          f"TTFT {statistics.mean(solo_hit) * 1e3:.0f} ms vs cold {statistics.mean(solo_cold) * 1e3:.0f} ms: "
          f"{solo:.2f}x")  # fmt: skip
    return {"c16_mean_ttft_ratio": mean_ratio, "c16_worst_request_ratio": worst,
            "second_instance_first_request_ratio": solo, "outputs_identical": same}  # fmt: skip


# ---- unique ---------------------------------------------------------------------------
def unique(model, n=64, prompt=512, output=128, c=16, rounds=3):
    from tests.redis_server import RedisServer

    redis = RedisServer(Path("/tmp"), maxmemory="4gb").start()
    base = ["--block-size", str(BLOCK), "--max-num-seqs", str(c)]
    host = ["--kv-offloading-size", "2"]
    servers = {"off": Server(model, "unique_off", *base),
               "host": Server(model, "unique_host", *base, *host),
               "host+redis": Server(model, "unique_redis", *base, *host, "--kv-remote-url", redis.url)}  # fmt: skip
    rates = {name: [] for name in servers}
    names = list(servers)
    try:
        rng = random.Random(2)
        for s in servers.values():
            asyncio.run(at_once(s.url, [tokens(rng, 64)], 4))
        for r in range(rounds):
            for name in names[r % 3 :] + names[: r % 3]:  # each first once: drift evens out
                prompts = [tokens(rng, prompt) for _ in range(n)]  # all new: nothing hits

                async def run(url=servers[name].url, prompts=prompts):
                    gate = asyncio.Semaphore(c)
                    async with client() as cl:

                        async def go(p):
                            async with gate:
                                return await complete(cl, url, p, output)

                        return await asyncio.gather(*(go(p) for p in prompts))

                t0 = time.perf_counter()
                outs = asyncio.run(run())
                rates[name].append(sum(len(o) for _, o in outs) / (time.perf_counter() - t0))
        stored = servers["host+redis"].metric("kv_offload_stored_bytes_total")
    finally:
        for s in servers.values():
            s.stop()
        redis.kill()
    off = statistics.mean(rates["off"])
    out = {"rounds": rounds}
    for name in ("host", "host+redis"):
        ratio = statistics.mean(rates[name]) / off
        out[f"{name}_throughput_ratio"] = ratio
        print(f"unique: 0% hits, {n} prompts of {prompt} tokens, c={c}: {name} "
              f"{statistics.mean(rates[name]):.1f} vs off {off:.1f} output tok/s: {ratio:.3f}x "
              f"(rounds: {', '.join(f'{x:.1f}' for x in rates[name])} vs "
              f"{', '.join(f'{x:.1f}' for x in rates['off'])})")  # fmt: skip
    print(f"unique: {stored / 2**20:.0f} MiB stored by host+redis (both tiers counted)")
    return out


def pct(values: list[float], q: int) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    p.add_argument("--only", default="multiround,sequential,redis,unique")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    out = {}
    for part in args.only.split(","):
        runs = {"multiround": multiround, "sequential": multiround_sequential,
                "redis": redis_shared, "unique": unique}  # fmt: skip
        out[part] = runs[part](args.model)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
