"""Structured output: what a grammar costs, and whether its outputs hold.

    python benchmarks/structured_output.py [--model PATH] [--only compile|correctness|throughput]

compile      100 function-calling schemas (tandem/bench/data/tool_schemas.json): cold compile
             plus the first mask (llguidance compiles lazily, so its cost shows there), p50
             and p99; then the cache hit of each.
correctness  300 schemas (the 100 tools and 200 generated ones that use minItems, pattern,
             enum, anyOf, $ref, nested objects and bounded numbers) sampled at temperature
             0.8 on the model, offline: every finished output must validate with jsonschema
             (formats checked too); 50 regexes must fullmatch; 50 choice lists must hold.
throughput   `tandem serve`, JSON-schema requests (the json-schema workload of `tandem bench
             serve`) at 16 and 64 in flight, against the same prompts unconstrained with
             ignore_eos and max_tokens set to the very token counts the constrained run gave:
             the same tokens with and without the grammar. Rounds alternate; prints the
             ratio of output tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


# ---- compile -------------------------------------------------------------------------
def bench_compile(folder: Path, tools: list[dict]) -> None:
    import xgrammar as xgr

    from tandem.engine.tokenizer import load_tokenizer
    from tandem.structured.compiler import GrammarCompiler
    from tandem.structured.params import StructuredOutputsParams as S

    tok = load_tokenizer(folder)
    cfg = json.loads((folder / "config.json").read_text())
    vocab = cfg["vocab_size"]
    compiler = GrammarCompiler(lambda: tok, vocab, [tok.eos_token_id])
    compiler.prepare().result()  # the vocabulary prepared, as at a server's start
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    cold, hit, backends = [], [], {}
    for t in tools:
        so = S(json=t["function"]["parameters"])
        t0 = time.perf_counter()
        compiled = compiler.compile(so)
        compiled.backend.matcher(compiled.grammar).fill(bitmask, 0)
        cold.append(time.perf_counter() - t0)
        backends[compiled.backend.name] = backends.get(compiled.backend.name, 0) + 1
    for t in tools:
        so = S(json=t["function"]["parameters"])
        t0 = time.perf_counter()
        compiler.compile(so)
        hit.append(time.perf_counter() - t0)
    print(f"compile + first mask, {len(tools)} tool schemas ({backends}): "
          f"p50 {pct(cold, 50) * 1e3:.1f} ms, p99 {pct(cold, 99) * 1e3:.1f} ms, "
          f"max {max(cold) * 1e3:.1f} ms")  # fmt: skip
    print(f"cache hit: p50 {pct(hit, 50) * 1e6:.0f} us, p99 {pct(hit, 99) * 1e6:.0f} us")
    compiler.close()


# ---- correctness ---------------------------------------------------------------------
def generated_schemas(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def leaf(depth: int) -> dict:
        k = rng.randrange(9 if depth < 2 else 6)
        if k == 0:
            return {"type": "string", "enum": rng.sample(["red", "green", "blue", "a b", "é"], 3)}
        if k == 1:
            lo = rng.randrange(-50, 50)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.randrange(1, 500)}
        if k == 2:
            return {
                "type": "string",
                "pattern": rng.choice(
                    ["^[a-z]{3,8}$", "^[A-Z][0-9]{2}-[a-z]+$", "^(yes|no)$", "^[0-9a-f]{4,8}$"]
                ),
            }
        if k == 3:
            return {"type": "boolean"}
        if k == 4:
            return {"type": "string", "maxLength": rng.randrange(3, 12)}
        if k == 5:
            return {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 9}]}
        if k == 6:
            return {"type": "array", "items": leaf(depth + 1), "minItems": rng.randrange(1, 3),
                    "maxItems": rng.randrange(3, 5)}  # fmt: skip
        if k == 7:
            return {"$ref": "#/$defs/Point"}
        return obj(depth + 1)

    def obj(depth: int) -> dict:
        props = {f"f{i}": leaf(depth) for i in range(rng.randrange(1, 5))}
        required = [k for k in props if rng.random() < 0.7]
        return {"type": "object", "properties": props, "required": required,
                "additionalProperties": False}  # fmt: skip

    point = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
             "y": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["x", "y"],
             "additionalProperties": False}  # fmt: skip
    return [{**obj(0), "$defs": {"Point": point}} for _ in range(n)]


REGEXES = [r"[a-z]{3}-[0-9]{2,4}", r"(cat|dog|fish)s?", r"[A-Z][a-z]+ [A-Z][a-z]+",
           r"\d{4}-\d{2}-\d{2}", r"#[0-9a-f]{6}", r"(yes|no|maybe)", r"[a-z]+@[a-z]+\.(com|org)",
           r"\(\d{3}\) \d{3}-\d{4}", r"v\d+\.\d+\.\d+", r"[01]{8}"]  # fmt: skip


def bench_correctness(model: str | None) -> None:
    import jsonschema

    from tandem import LLM, SamplingParams
    from tandem.structured.params import StructuredOutputsParams as S

    tools = load_tools()
    schemas = [t["function"]["parameters"] for t in tools] + generated_schemas(200)
    llm = LLM(model)
    checker = jsonschema.FormatChecker()
    ask = "Give a JSON example that follows this schema: "
    prompts = [[{"role": "user", "content": ask + json.dumps(s)[:400]}] for s in schemas]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=256, structured_outputs=S(json=s))
              for i, s in enumerate(schemas)]  # fmt: skip
    t0 = time.perf_counter()
    outs = llm.chat(prompts, params, use_tqdm=False)
    stopped = valid = 0
    for s, o in zip(schemas, outs):
        c = o.outputs[0]
        if c.finish_reason != "stop":
            continue
        stopped += 1
        try:
            jsonschema.validate(json.loads(c.text), s, format_checker=checker)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            print(f"  INVALID: {str(e)[:200]}\n  {c.text[:200]}")
    print(f"json_schema: {valid}/{stopped} finished outputs valid ({len(schemas) - stopped} of "
          f"{len(schemas)} cut at max_tokens 256), {time.perf_counter() - t0:.0f} s")  # fmt: skip
    rng = random.Random(1)
    regexes = [REGEXES[i % len(REGEXES)] for i in range(50)]
    outs = llm.generate(["Write one: "] * 50, [
        SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs=S(regex=r))
        for i, r in enumerate(regexes)], use_tqdm=False)  # fmt: skip
    done = [(r, o.outputs[0].text) for r, o in zip(regexes, outs)
            if o.outputs[0].finish_reason == "stop"]  # fmt: skip
    for r, text in done:
        if not re.fullmatch(r, text):
            print(f"  NO MATCH: {r!r}: {text!r}")
    ok = sum(bool(re.fullmatch(r, text)) for r, text in done)
    print(
        f"regex: {ok}/{len(done)} finished outputs fullmatch ({50 - len(done)} of 50 cut at "
        "max_tokens 64)"
    )
    choices = [
        rng.sample(["alpha", "beta", "gamma delta", "ε", "42", "x y z"], 3) for _ in range(50)
    ]
    outs = llm.generate(["Pick one: "] * 50, [
        SamplingParams(temperature=1.0, seed=i, max_tokens=16, structured_outputs=S(choice=c))
        for i, c in enumerate(choices)], use_tqdm=False)  # fmt: skip
    ok = sum(o.outputs[0].text in c for c, o in zip(choices, outs))
    print(f"choice: {ok}/50 outputs are one of their choices")


# ---- throughput ----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one(client, url, body: dict) -> int:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


async def run_round(url: str, bodies: list[dict], c: int) -> tuple[float, list[int]]:
    gate = asyncio.Semaphore(c)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=1200, limits=limits) as client:

        async def go(body):
            async with gate:
                return await one(client, url, body)

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(go(b) for b in bodies))
        return sum(counts) / (time.perf_counter() - t0), counts


def bench_throughput(model: str | None, rounds: int, input_len: int, output_len: int) -> None:
    from tandem.bench.workloads import LengthRange, json_schema_workload
    from tandem.engine.tokenizer import load_tokenizer
    from tandem.model.loader import resolve_model

    tok = load_tokenizer(resolve_model(model))
    port = free_port()
    log = Path("/tmp/structured_output_server.log")
    cmd = [sys.executable, "-m", "tandem.cli", "serve", *([model] if model else []), "--port",
           str(port), "--disable-uvicorn-access-log", "--max-num-seqs", "64"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"server failed:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        for c in (16, 64):
            sessions = json_schema_workload(tok, 4 * c, LengthRange(input_len, input_len),
                                            LengthRange(output_len, output_len), seed=c)  # fmt: skip
            reqs = [s.requests[0] for s in sessions]
            base = [{"model": name, "messages": [{"role": "user", "content": r.prompt}],
                     "max_tokens": r.output_len, "temperature": 0} for r in reqs]  # fmt: skip
            constrained = [{**b, **r.body} for b, r in zip(base, reqs)]
            warm = [{**b, "max_tokens": 1} for b in constrained]
            asyncio.run(run_round(url, warm, c))  # every grammar compiled before timing
            with_grammar, without = [], []
            for _ in range(rounds):
                # each round's own counts: greedy is not batch-invariant, so they may differ
                rate, counts = asyncio.run(run_round(url, constrained, c))
                with_grammar.append(rate)
                plain = [{**b, "max_tokens": max(1, n), "ignore_eos": True}
                         for b, n in zip(base, counts)]  # fmt: skip
                without.append(asyncio.run(run_round(url, plain, c))[0])
            g, u = statistics.mean(with_grammar), statistics.mean(without)
            print(
                f"c={c}: {len(reqs)} requests, {sum(counts)} output tokens; json_schema "
                f"{g:.1f} tok/s {[round(x, 1) for x in with_grammar]}, unconstrained "
                f"{u:.1f} tok/s {[round(x, 1) for x in without]}: ratio {g / u:.3f}"
            )
    finally:
        proc.terminate()
        proc.wait(30)


def load_tools() -> list[dict]:
    from tandem.bench.workloads import tool_schemas

    return tool_schemas()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    p.add_argument("--only", choices=["compile", "correctness", "throughput"], default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args()
    import platform

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    print(f"CPU: {cpu}")
    from tandem.model.loader import resolve_model

    if args.only in (None, "compile"):
        bench_compile(resolve_model(args.model), load_tools())
    if args.only in (None, "correctness"):
        bench_correctness(args.model)
    if args.only in (None, "throughput"):
        bench_throughput(args.model, args.rounds, args.input_len, args.output_len)


if __name__ == "__main__":
    main()
