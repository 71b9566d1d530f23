"""Server overhead: output tokens/s through HTTP streaming vs offline `LLM.generate`.

The same seeded requests (default: 48 prompts of 128 random token ids, 64 greedy output
tokens each, ignore_eos) run twice on the same model and engine flags:

  offline  `LLM.generate`, all requests at once, in this process;
  server   `tandem serve` as a subprocess, 16 concurrent streaming clients (httpx, SSE).

Both engines get --max-num-seqs = the client concurrency, so both run batches of the same
size and the ratio measures what HTTP, the process boundary, tokenizing and detokenizing
cost, not a difference in batching. The clients count tokens from each stream's usage chunk
and otherwise do not parse the chunks. Target: server >= 90% of offline.

    python benchmarks/server_overhead.py [--model PATH] [--num-requests 48] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def workload(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(input_len)] for _ in range(n)]


def engine_flags(args) -> dict:
    return dict(
        dtype=args.dtype,
        max_num_seqs=args.concurrency,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
    )


def run_offline(args, prompts) -> tuple[float, int]:
    from tandem import LLM, SamplingParams

    llm = LLM(args.model, **engine_flags(args))
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for r in results for c in r.outputs)
    del llm
    return elapsed, tokens


def start_server(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tandem.cli", "serve"] + ([args.model] if args.model else [])
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    for flag, value in engine_flags(args).items():
        cmd += [f"--{flag.replace('_', '-')}", str(value)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not ready; see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)


async def run_clients(url: str, prompts, output_len: int, concurrency: int) -> tuple[float, int]:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            body = {
                "prompt": queue.get_nowait(),
                "max_tokens": output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            last = None
            async with http.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage"' in line:
                        last = line
            tokens += json.loads(last[6:])["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await http.post("/v1/completions", json={"prompt": prompts[0][:8], "max_tokens": 2})
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return time.perf_counter() - start, tokens


def run_server(args, prompts) -> tuple[float, int]:
    log_path = Path(tempfile.gettempdir()) / "tandem-server-overhead.log"
    proc, url = start_server(args, log_path)
    try:
        return asyncio.run(run_clients(url, prompts, args.output_len, args.concurrency))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from tandem.core.model_config import ModelConfig
    from tandem.model.loader import resolve_model

    vocab = ModelConfig.from_folder(resolve_model(args.model)).vocab_size
    prompts = workload(args.num_requests, args.input_len, vocab, args.seed)
    expected = args.num_requests * args.output_len

    print(f"{args.num_requests} requests, {args.input_len} in / {args.output_len} out, "
          f"{args.concurrency} concurrent", flush=True)  # fmt: skip
    server_s, server_tokens = run_server(args, prompts)
    print(f"server : {server_tokens} tokens in {server_s:.2f} s = "
          f"{server_tokens / server_s:.1f} output tok/s", flush=True)  # fmt: skip
    offline_s, offline_tokens = run_offline(args, prompts)
    print(f"offline: {offline_tokens} tokens in {offline_s:.2f} s = "
          f"{offline_tokens / offline_s:.1f} output tok/s", flush=True)  # fmt: skip
    assert server_tokens == offline_tokens == expected, (server_tokens, offline_tokens)
    ratio = (server_tokens / server_s) / (offline_tokens / offline_s)
    print(f"server / offline = {ratio:.1%} (target >= 90%)")


if __name__ == "__main__":
    main()
