"""Agents over a shared server: sessions that pin each agent's context through its tool
pauses, against the same agents without sessions, in one run on one server.

Each agent runs turns over one growing context: a streamed completion (TTFT measured), a tool
pause of 0.2-5 s, then the tool's output (100-250 words) and the answer appended. Meanwhile
background traffic of distinct long prompts keeps the KV pool oversubscribed, so whatever is
not pinned is evicted during the pauses. Reported per mode: the share of each turn's previous
context served from cache (usage.prompt_tokens_details.cached_tokens), mean TTFT of turns 2
on, and the last turn's TTFT over the second's; then the ratio of mean TTFTs.

    python benchmarks/agentic.py [--agents 5] [--turns 6] [--pause 0.2 5] [--num-kv-blocks 900]
        [--url http://127.0.0.1:8000]   # an already running server (sessions must exist)

Without --url it starts `tandem serve` on the default model with a pool of --num-kv-blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

from tandem.bench.client import RequestSpec, first_model, make_client, send
from tandem.bench.servers import tandem_server
from tandem.bench.workloads import BenchRequest

WORDS = (
    "file function error test build module import return value config path line stack trace "
    "assert result output input string number list dict class method call argument option "
    "patch diff commit branch merge repository directory search match query index cache"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def agent(client, base, model, rng, args, sessions: bool, results: list) -> None:
    sid = None
    if sessions:
        r = await client.post(f"{base}/open_session", json={"ttl_s": 120})
        r.raise_for_status()
        sid = r.json()
    spec = RequestSpec(f"{base}/v1/completions", model, ignore_eos=True)
    context = f"You are agent {rng.random():.6f}. Task: {words(rng, args.task_words)}\n"
    previous = 0
    for turn in range(args.turns):
        body = {"session_id": sid} if sid else None
        req = BenchRequest(context, 0, args.output_len, body=body)
        out = await send(client, spec, req)
        if not out.success:
            raise RuntimeError(f"turn {turn}: {out.error}")
        results.append((turn, out.ttft, out.cached_tokens or 0, previous, out.prompt_len))
        previous = out.prompt_len
        await asyncio.sleep(rng.uniform(*args.pause))  # the tool runs
        context += out.generated_text + f"\nTool output: {words(rng, rng.randint(100, 250))}\n"
    if sid:
        await client.post(f"{base}/close_session", json={"session_id": sid})


async def background(client, base, model, rng, stop: asyncio.Event, args) -> int:
    """Distinct long prompts, two at a time, until `stop`: -> how many were sent."""
    spec = RequestSpec(f"{base}/v1/completions", model, ignore_eos=True)
    sent = 0

    async def one():
        nonlocal sent
        while not stop.is_set():
            await send(client, spec, BenchRequest(words(rng, args.background_words), 0, 4))
            sent += 1

    await asyncio.gather(one(), one())
    return sent


async def run_mode(base: str, sessions: bool, seed: int, args) -> dict:
    rng = random.Random(seed)
    async with make_client(timeout=600) as client:
        model = await first_model(base)
        stop = asyncio.Event()
        noise = asyncio.create_task(
            background(client, base, model, random.Random(seed + 1), stop, args)
        )
        results: list = []
        start = time.perf_counter()
        await asyncio.gather(
            *(agent(client, base, model, random.Random(rng.random()), args, sessions, results)
              for _ in range(args.agents))
        )  # fmt: skip
        elapsed = time.perf_counter() - start
        stop.set()
        sent = await noise
    later = [r for r in results if r[0] >= 1]
    by_turn = {t: statistics.mean(r[1] for r in results if r[0] == t) for t in range(args.turns)}
    return {
        "computed": sum(n - c for _, _, c, _, n in later),  # prompt tokens of turns 2+ computed
        "hit": statistics.mean(min(1.0, c / p) for _, _, c, p, _ in later if p),
        "ttft": statistics.mean(r[1] for r in later),
        "growth": by_turn[args.turns - 1] / by_turn[1],
        "context": statistics.mean(r[4] for r in results if r[0] == args.turns - 1),
        "elapsed": elapsed,
        "background": sent,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--agents", type=int, default=5)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--task-words", type=int, default=1400, help="the first turn's prompt")
    ap.add_argument("--pause", type=float, nargs=2, default=(0.2, 5.0), help="a tool's seconds")
    ap.add_argument("--background-words", type=int, default=800)
    ap.add_argument("--num-kv-blocks", type=int, default=900)
    ap.add_argument("--max-pinned-fraction", type=float, default=0.9)
    ap.add_argument("--port", type=int, default=18931)
    args = ap.parse_args()

    async def both(base: str) -> tuple[dict, dict]:
        return await run_mode(base, False, 1, args), await run_mode(base, True, 2, args)

    if args.url:
        plain, pinned = asyncio.run(both(args.url))
    else:
        extra = ["--num-kv-blocks", str(args.num_kv_blocks),
                 "--max-pinned-fraction", str(args.max_pinned_fraction)]  # fmt: skip
        log = Path(tempfile.mkdtemp(prefix="agentic-")) / "server.log"
        with tandem_server(args.port, args.model, extra, log) as server:
            server.wait_ready(600)
            plain, pinned = asyncio.run(both(server.base_url))
    print(f"{args.agents} agents x {args.turns} turns, {args.output_len} tokens out a turn, "
          f"background prompts of ~{args.background_words} words, a pool of "
          f"{args.num_kv_blocks} blocks")  # fmt: skip
    for name, r in (("no sessions", plain), ("sessions", pinned)):
        print(f"  {name:11}  previous context from cache {100 * r['hit']:5.1f}%  "
              f"mean TTFT (turns 2+) {1000 * r['ttft']:7.1f} ms  last/second turn TTFT "
              f"{r['growth']:.2f}x  final context {r['context']:.0f} tokens  "
              f"{r['computed']} prompt tokens computed in turns 2+  "
              f"{r['elapsed']:.0f} s, {r['background']} background prompts")  # fmt: skip
    print(
        f"turns 2+: mean TTFT {plain['ttft'] / pinned['ttft']:.2f}x lower with sessions, "
        f"prompt tokens computed {plain['computed'] / max(1, pinned['computed']):.2f}x fewer"
    )


if __name__ == "__main__":
    main()
