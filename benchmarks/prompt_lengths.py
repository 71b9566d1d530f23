"""Prefill of prompts whose lengths the server has not seen before, with the dense matmuls'
rows padded to a multiple of `quant.DENSE_ROW_BUCKET` and without (bucket 1), in alternating
rounds in one process, so that drift on a shared machine hits both alike. oneDNN builds a
kernel for each matmul shape it meets; on an AMX Xeon that took 10-40 ms a prompt of a new
length, every new length a server saw. Both sides draw prompt lengths from the same range
(200-455 tokens); the unpadded side takes lengths neither side has run (none a multiple of the
bucket), the padded side any (its padded shapes repeat, as a server's would). Then a length
both have run (327: the steady-state cost, padding's 9 extra rows included).

    python benchmarks/prompt_lengths.py [--rounds 4] [--prompts 12]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tandem import LLM, SamplingParams
from tandem.model import quant


def mean_ms(llm: LLM, lengths: list[int], rng: random.Random) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for n in lengths:
        prompt = [rng.randrange(100, 40000) for _ in range(n)]
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.mean(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=12)
    args = ap.parse_args()
    llm = LLM(kv_cache_memory=0.2, max_model_len=2048)
    rng, bucket = random.Random(0), quant.DENSE_ROW_BUCKET
    fresh = [n for n in range(200, 456) if n % bucket and n != 327]
    rng.shuffle(fresh)
    mean_ms(llm, [327] * 4, rng)  # warm-up
    rows = {1: [], bucket: []}
    for r in range(args.rounds):
        for b in (1, bucket):
            quant.DENSE_ROW_BUCKET = b
            if b == 1:
                lengths = [fresh.pop() for _ in range(args.prompts)]
            else:
                lengths = [rng.randrange(200, 456) for _ in range(args.prompts)]
            new = mean_ms(llm, lengths, rng)
            seen = mean_ms(llm, [327] * args.prompts, rng)
            rows[b].append((new, seen, statistics.mean(lengths)))
            print(f"round {r} bucket {b:>2}: lengths not seen before {new:6.1f} ms a prompt "
                  f"(mean length {rows[b][-1][2]:.0f}), 327 tokens {seen:6.1f} ms", flush=True)  # fmt: skip
    quant.DENSE_ROW_BUCKET = bucket
    for b, runs in rows.items():
        print(f"bucket {b:>2}: {statistics.mean(n for n, _, _ in runs):.1f} ms a prompt of "
              f"those lengths, {statistics.mean(s for _, s, _ in runs):.1f} ms at 327 tokens")  # fmt: skip


if __name__ == "__main__":
    main()
