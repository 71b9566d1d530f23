"""Decode steps of the default model on its GGUF's own 4/8-bit blocks against the same
model dequantized to float (`--quantization none`, bf16 or float32 as `dtype=auto` picks),
both loaded in one process and measured in alternating rounds, so that drift on a shared
machine hits both alike. For each batch size: the median ms per decode step (256 tokens of
context each), output tok/s, and quantized / float speed.

    python benchmarks/quant_decode.py [--batches 1,4,16,32,64] [--rounds 3] [--steps 5]
        [--kernel-max-rows N]   # rows up to which torch's int4 kernels run (then dense)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tandem import LLM, SamplingParams
from tandem.engine.messages import EngineCoreRequest
from tandem.model.quant import QuantizedLinear


def start_batch(llm: LLM, running: int, context: int, tag: str) -> None:
    engine = llm.engine
    rng = random.Random(0)
    for i in range(running):
        prompt = [rng.randrange(100, 40000) for _ in range(context)]
        params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        params.eos_token_ids = engine.eos_token_ids
        engine.add_request(EngineCoreRequest(f"{tag}-{i}", prompt, params, 0.0))
    while engine.scheduler.num_waiting or any(r.is_prefill for r in engine.scheduler.running):
        engine.step()


def finish_batch(llm: LLM, running: int, tag: str) -> None:
    llm.engine.abort_requests([f"{tag}-{i}" for i in range(running)])
    llm.engine.step()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16,32,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--kernel-max-rows", type=int, default=QuantizedLinear.KERNEL_MAX_ROWS)
    args = ap.parse_args()
    QuantizedLinear.KERNEL_MAX_ROWS = args.kernel_max_rows  # where torch's kernels stop
    llms = {"gguf": LLM(quantization="gguf"), "float": LLM(quantization="none")}
    weights = {name: llm.engine.runner.model.lm_head for name, llm in llms.items()}
    print(f"quantized: {getattr(weights['gguf'], 'fmt', '?')} head; float dtype: "
          f"{llms['float'].engine.runner.kv_cache.dtype}")  # fmt: skip
    print(f"{'batch':>5} {'gguf ms':>9} {'float ms':>9} {'gguf tok/s':>11} {'float tok/s':>12} {'speed-up':>9}")  # fmt: skip
    for n, running in enumerate(map(int, args.batches.split(","))):
        tag = f"b{n}"
        for llm in llms.values():
            start_batch(llm, running, args.context, tag)
        times = {name: [] for name in llms}
        for _ in range(args.rounds):
            for name, llm in llms.items():
                llm.engine.step()  # settle after the other model's round
                t = time.perf_counter()
                for _ in range(args.steps):
                    llm.engine.step()
                times[name].append((time.perf_counter() - t) / args.steps)
        q, f = (statistics.median(times[k]) for k in ("gguf", "float"))
        print(f"{running:>5} {q * 1e3:>9.1f} {f * 1e3:>9.1f} {running / q:>11.1f} "
              f"{running / f:>12.1f} {f / q:>8.2f}x", flush=True)  # fmt: skip
        for llm in llms.values():
            finish_batch(llm, running, tag)


if __name__ == "__main__":
    main()
