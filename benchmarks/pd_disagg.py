"""Prefill/decode disaggregation through `tandem proxy`, one run, all instances on this
machine (so prefill, decode and the colocated reference share its cores):

    python benchmarks/pd_disagg.py [--conversations 8] [--burst 16]

1. Multi-turn agent-style workload (`tandem bench serve --dataset-name multi-turn`: each turn
   resends the growing context plus a new message): KV bytes the decode instance received per
   request with its radix cache and with --no-enable-prefix-caching, against the KV of the
   new suffixes alone (the least any scheme must send).
2. A burst of long prompts: TTFT and TPOT of 1 prefill + 1 decode instance through the proxy
   against one colocated instance.
For transfer throughput against raw pyzmq, see benchmarks/kv_transfer.py.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def bench(url: str, out: Path, name: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "tandem.cli", "bench", "serve", "--base-url", url,
           "--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir", str(out),
           "--result-filename", f"{name}.json", "--request-rate", "inf", *extra]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads((out / f"{name}.json").read_text())


def suffix_tokens(args) -> tuple[int, int]:
    """(new-suffix tokens over the workload, prompt tokens over it): each conversation's last
    prompt holds every earlier turn's new tokens once."""
    from tandem.bench.serve import build_workload, load_tokenizer

    _, tokenizer = load_tokenizer(args.model)
    ns = argparse.Namespace(
        dataset_name="multi-turn", num_prompts=args.conversations * args.turns,
        random_input_len=args.turn_input, random_output_len=args.turn_output,
        random_range_ratio=0.0, turns=args.turns,
    )  # fmt: skip
    sessions = build_workload(ns, tokenizer, [], args.seed)
    new = sum(s.requests[-1].prompt_len for s in sessions)
    total = sum(r.prompt_len for s in sessions for r in s.requests)
    return new, total


def multi_turn(args, out: Path, proxy: str, decode: str, name: str) -> dict:
    names = ("tandem:kv_transfer_received_bytes_total", "tandem:prompt_tokens_total",
             "tandem:kv_transfer_cached_prompt_tokens_total")  # fmt: skip
    before = [metric(decode, n) for n in names]
    result = bench(proxy, out, name, [
        "--dataset-name", "multi-turn", "--num-prompts", str(args.conversations * args.turns),
        "--turns", str(args.turns), "--random-input-len", str(args.turn_input),
        "--random-output-len", str(args.turn_output), "--random-range-ratio", "0",
        "--seed", str(args.seed),
    ])  # fmt: skip
    received, prompt, cached = (metric(decode, n) - b for n, b in zip(names, before))
    return {"requests": result["completed"], "bytes": received, "prompt_tokens": prompt,
            "cached_tokens": cached}  # fmt: skip


def burst(args, out: Path, url: str, name: str) -> dict:
    r = bench(url, out, name, [
        "--dataset-name", "random", "--num-prompts", str(args.burst),
        "--random-input-len", str(args.burst_input), "--random-output-len",
        str(args.burst_output), "--random-range-ratio", "0", "--seed", str(args.seed),
    ])  # fmt: skip
    keys = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "output_throughput")
    return {k: r[k] for k in keys} | {"completed": r["completed"]}


def main() -> None:
    from tandem.bench.servers import ManagedServer, tandem_server

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-input", type=int, default=256, help="new tokens per turn")
    ap.add_argument("--turn-output", type=int, default=32)
    ap.add_argument("--burst", type=int, default=16, help="long prompts sent at once")
    ap.add_argument("--burst-input", type=int, default=1024)
    ap.add_argument("--burst-output", type=int, default=64)
    ap.add_argument(
        "--pd-threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="torch threads of each prefill and decode instance (the colocated one uses all)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="every instance's KV cache (int8/fp8: the wire carries its bytes and scales)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-dir", default="bench-results/pd")
    args = ap.parse_args()
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--kv-cache-memory", "1", "--disable-uvicorn-access-log",
              "--kv-cache-dtype", args.kv_cache_dtype]  # fmt: skip

    def serve(name, extra, threads=None):
        s = tandem_server(free_port(), args.model, [*common, *extra], out / f"{name}.log")
        s.name = name
        if threads:  # one core each, as instances on their own devices would have
            s.env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        return s

    def proxy(name, p, d):
        port = free_port()
        cmd = [sys.executable, "-m", "tandem.cli", "proxy", "--host", "127.0.0.1", "--port",
               str(port), "--prefill", p.base_url, "--decode", d.base_url]  # fmt: skip
        return ManagedServer(name, cmd, f"http://127.0.0.1:{port}", out / f"{name}.log")

    colocated = serve("colocated", [])
    split = args.pd_threads
    prefill = serve("prefill", ["--role", "prefill"], split)
    decode = serve("decode", ["--role", "decode"], split)
    decode_nocache = serve(
        "decode-nocache", ["--role", "decode", "--no-enable-prefix-caching"], split
    )
    engines = [colocated, prefill, decode, decode_nocache]
    proxies = [proxy("proxy", prefill, decode), proxy("proxy-nocache", prefill, decode_nocache)]
    for s in engines + proxies:
        s.start()
    try:
        for s in engines + proxies:
            s.wait_ready(600)
        new, total = suffix_tokens(args)
        cached = multi_turn(args, out, proxies[0].base_url, decode.base_url, "multi-turn")
        uncached = multi_turn(
            args, out, proxies[1].base_url, decode_nocache.base_url, "multi-turn-nocache"
        )
        pd = burst(args, out, proxies[0].base_url, "burst-pd")
        local = burst(args, out, colocated.base_url, "burst-colocated")
    finally:
        for s in proxies + engines:
            s.stop()

    per_token = cached["bytes"] / max(1, cached["prompt_tokens"] - cached["cached_tokens"])
    print(f"\nKV cache {args.kv_cache_dtype}: {per_token:,.0f} bytes on the wire a prompt token")
    print(f"\nmulti-turn: {args.conversations} conversations x {args.turns} turns, "
          f"{args.turn_input} new tokens a turn; the workload's prompts hold {total} tokens, "
          f"{new} of them new")  # fmt: skip
    for label, r in (("with decode-side cache", cached), ("without", uncached)):
        print(f"  {label:<24} {r['bytes'] / r['requests'] / 1e6:8.2f} MB/request, "
              f"{r['cached_tokens']:.0f} of {r['prompt_tokens']:.0f} prompt tokens held")  # fmt: skip
    saved = 1 - cached["bytes"] / uncached["bytes"]
    print(f"  the cache sends {saved:.0%} fewer bytes (target >= 50%); "
          f"{cached['bytes'] / (new * per_token):.2f}x the new suffixes' KV")  # fmt: skip
    print(f"\nburst of {args.burst} prompts of {args.burst_input} tokens, {args.burst_output} out"
          f" (one machine of {os.cpu_count()} cores: the colocated instance uses them all, the"
          f" prefill and decode instances {args.pd_threads} each):")  # fmt: skip
    print(f"  {'':<22} {'TTFT mean':>10} {'TTFT p99':>10} {'TPOT mean':>10} {'TPOT p99':>10}")
    for label, r in (("1P1D through proxy", pd), ("colocated", local)):
        print(f"  {label:<22} {r['mean_ttft_ms']:>10.0f} {r['p99_ttft_ms']:>10.0f} "
              f"{r['mean_tpot_ms']:>10.1f} {r['p99_tpot_ms']:>10.1f}")  # fmt: skip
    doc = {"args": vars(args), "kv_bytes_per_prompt_token": per_token, "suffix_tokens": new, "workload_prompt_tokens": total,
           "multi_turn": {"cached": cached, "uncached": uncached}, "burst": {"pd": pd,
           "colocated": local}}  # fmt: skip
    (out / "pd-disagg.json").write_text(json.dumps(doc, indent=2))
    print(f"\nsaved {out / 'pd-disagg.json'}")


if __name__ == "__main__":
    main()
