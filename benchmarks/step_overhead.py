"""Where a decode step's time goes at N running requests: scheduling, input preparation,
model forward (including the LM head), sampling, and the update that appends tokens.

    python benchmarks/step_overhead.py [--running 32] [--context 256] [--steps 20] [--quantization none]
        [--kv-cache-dtype int8] [--activation-quantization int8]

Prints the mean of each phase and the share of the step spent outside the model forward.
"""

from __future__ import annotations

import argparse
import random
import statistics

from tandem import LLM, SamplingParams
from tandem.engine.messages import EngineCoreRequest


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--running", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--quantization", default=None, help="as tandem serve's (default: the model's)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="as tandem serve's")
    ap.add_argument("--activation-quantization", default="none", help="as tandem serve's")
    args = ap.parse_args()

    llm = LLM(
        args.model,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        activation_quantization=args.activation_quantization,
    )
    engine = llm.engine
    rng = random.Random(0)
    vocab = llm.model_config.vocab_size
    # long enough that nobody finishes while the rest are still in prefill or being measured
    # (the first prompt decodes a token a step while the rest prefill, steps of >= 256 tokens)
    max_tokens = args.running * args.context // 256 + args.steps + 10
    for i in range(args.running):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(args.context)]
        params = SamplingParams(
            temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True
        )
        params.eos_token_ids = engine.eos_token_ids
        engine.add_request(EngineCoreRequest(str(i), prompt, params, 0.0))
    while engine.scheduler.num_waiting or any(r.is_prefill for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()

    samples: dict[str, list[float]] = {}
    for _ in range(args.steps):
        engine.step()
        assert engine.scheduler.num_running == args.running
        for k, v in engine.last_step_timings.items():
            samples.setdefault(k, []).append(v)
    means = {k: statistics.mean(v) * 1e3 for k, v in samples.items()}
    total = sum(means.values())
    print(
        f"decode step at {args.running} running requests, ~{args.context} tokens of context each:"
    )
    for k, v in means.items():
        print(f"  {k:9s} {v:8.2f} ms  {v / total:6.1%}")
    outside = total - means["forward"]
    print(
        f"  step {total:.1f} ms ({args.running / total * 1e3:.0f} tok/s); outside the forward: "
        f"{outside:.2f} ms = {outside / total:.1%}"
    )


if __name__ == "__main__":
    main()
