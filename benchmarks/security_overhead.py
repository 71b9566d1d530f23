"""What TLS, API keys and per-key limits cost: served throughput at concurrency 16 with all
of them on, against the same server with none, on the same requests in one run.

    python benchmarks/security_overhead.py [--model PATH] [--rounds 2] [--num-prompts 64]

Two `tandem serve` processes on loopback, one plain, one with --ssl-certfile/--ssl-keyfile
(a trustme CA), an --api-key-file of several keys with rpm and concurrency limits, an
--admin-api-key and --max-request-bytes. Rounds alternate plain and secured (so drift on a
shared machine hits both); each round sends the same streamed completions (random token
prompts, --ignore-eos) with 16 in flight, and counts output tokens per second. Prints each
round and the ratio secured / plain of the mean.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trustme

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", *args, "--port", str(port),
           "--disable-uvicorn-access-log"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT), port


def wait_ready(url: str, verify, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", verify=verify, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    sys.exit(f"server not ready:\n{log.read_text()[-3000:]}")


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> int:
    body = {"model": client.headers["x-model"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                tokens += len(json.loads(line[6:])["choices"])
    return tokens


async def round_(url: str, verify, headers: dict, prompts, max_tokens: int, c: int) -> float:
    gate = asyncio.Semaphore(c)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        verify=verify, headers=headers, timeout=600, limits=limits
    ) as client:
        models = await client.get(f"{url}/v1/models")
        client.headers["x-model"] = models.json()["data"][0]["id"]

        async def bounded(p):
            async with gate:
                return await one(client, url, p, max_tokens)

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(bounded(p) for p in prompts)))
        return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tandem-security-"))
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(work / "ca.pem")
    cert.private_key_pem.write_to_path(work / "server.key")
    (work / "server.pem").write_bytes(b"".join(b.bytes() for b in cert.cert_chain_pems))
    (work / "keys").write_text("".join(f"sk-{i} name=client{i} rpm=100000 concurrency=64\n"
                                       for i in range(8)))  # fmt: skip
    model = [args.model] if args.model else []
    plain, plain_port = start([*model], work / "plain.log")
    secured, secured_port = start(
        [*model, "--ssl-certfile", str(work / "server.pem"), "--ssl-keyfile", str(work / "server.key"),
         "--api-key-file", str(work / "keys"), "--admin-api-key", "sk-admin",
         "--rate-limit", "rpm=100000,concurrency=64", "--max-request-bytes", "1048576"],
        work / "secured.log",
    )  # fmt: skip
    sides = {
        "plain": (f"http://127.0.0.1:{plain_port}", True, {}),
        "secured": (f"https://127.0.0.1:{secured_port}", str(work / "ca.pem"),
                    {"Authorization": "Bearer sk-3"}),
    }  # fmt: skip
    try:
        for (url, verify, _), proc, name in zip(sides.values(), (plain, secured), sides):
            wait_ready(url, verify, proc, work / f"{name}.log")
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 20000) for _ in range(args.input_len)]
                   for _ in range(args.num_prompts)]  # fmt: skip
        for url, verify, headers in sides.values():  # warm-up: compile, caches
            asyncio.run(round_(url, verify, headers, prompts[:4], 8, 4))
        results: dict[str, list[float]] = {"plain": [], "secured": []}
        for r in range(args.rounds):
            for name, (url, verify, headers) in sides.items():
                rate = asyncio.run(round_(url, verify, headers, prompts, args.output_len,
                                          args.concurrency))  # fmt: skip
                results[name].append(rate)
                print(f"round {r + 1} {name:8s} {rate:8.1f} output tokens/s", flush=True)
        plain_mean = statistics.mean(results["plain"])
        secured_mean = statistics.mean(results["secured"])
        print(f"plain {plain_mean:.1f}, secured (TLS, keys, limits) {secured_mean:.1f} output "
              f"tokens/s at c={args.concurrency}: ratio secured/plain {secured_mean / plain_mean:.3f}")  # fmt: skip
    finally:
        for proc in (plain, secured):
            proc.terminate()
        for proc in (plain, secured):
            proc.wait(60)


if __name__ == "__main__":
    main()
