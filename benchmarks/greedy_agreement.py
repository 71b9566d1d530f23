"""How far each numeric path's greedy replies follow the float32 path on the same weights.

The default model's GGUF dequantized to float32 is the reference; each other path answers the
same chat prompts (the quantization tests' 8, then the first user turns of ShareGPT, the
`bench` extra) greedily, and for each reply we count the tokens it agrees with the reference's
before the first difference. A small model meets many near-ties, so even bf16 (vLLM's dtype
on a CPU with native bf16) parts early on some prompts: the figure to read is a path against
bf16's. Also the reference replies' tokens scored by each path (teacher-forced, one prefill
step a reply): mean and largest |logprob - reference logprob|.

    python benchmarks/greedy_agreement.py                       # 32 prompts, 64 tokens
    python benchmarks/greedy_agreement.py --paths bf16,gguf,gguf-int8 --prompts 64

Paths: bf16 (`--quantization none --dtype bfloat16`), gguf (the GGUF's blocks, the default),
gguf-int8 (`--activation-quantization int8`, where the CPU takes it), gguf-f32 (the blocks
with float32 elsewhere).
"""

from __future__ import annotations

import argparse
import gc
import statistics

from tandem import LLM, SamplingParams
from tandem.bench.sharegpt import first_user_turns
from tandem.bench.workloads import CHAT_PROMPTS
from tandem.runner.scoring import token_logprobs

PATHS = {
    "float32": dict(dtype="float32", quantization="none"),
    "bf16": dict(dtype="bfloat16", quantization="none"),
    "gguf": dict(),
    "gguf-int8": dict(activation_quantization="int8"),
    "gguf-f32": dict(dtype="float32"),
}


def prompts(n: int) -> list[str]:
    """The tests' chat prompts, then ShareGPT's first user turns of 20-400 characters."""
    return [*CHAT_PROMPTS, *first_user_turns(n)][:n]


def agreed(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--paths", default="bf16,gguf,gguf-int8", help="compared with float32")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens a reply")
    args = ap.parse_args()

    msgs = [[{"role": "user", "content": p}] for p in prompts(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    ref, ref_lp, docs = None, None, None
    for name in ["float32", *args.paths.split(",")]:
        try:
            llm = LLM(kv_cache_memory=0.2, max_model_len=2048, **PATHS[name])
        except ValueError as e:  # e.g. int8 activations on a CPU without the kernel
            print(f"{name:>9}: skipped ({e})")
            continue
        outs = llm.chat(msgs, params, use_tqdm=False)
        replies = [o.outputs[0].token_ids for o in outs]
        if ref is None:
            ref, docs = replies, [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
        n = [len(d) - len(r) - 1 for d, r in zip(docs, ref)]  # logprobs before the replies
        lps = [token_logprobs(llm.engine, d, 256)[k:] for d, k in zip(docs, n)]
        if ref_lp is None:
            ref_lp = lps
            print(
                f"{len(msgs)} prompts, {args.tokens} greedy tokens; reference float32 ({llm.quantization})"
            )
        else:
            prefixes = [agreed(a, b) for a, b in zip(replies, ref)]
            diffs = [abs(x - y) for a, b in zip(lps, ref_lp) for x, y in zip(a, b)]
            half = sum(p >= args.tokens // 2 for p in prefixes)
            print(f"{name:>9}: agrees {statistics.mean(prefixes):5.1f} tokens on average, "
                  f"{half}/{len(prefixes)} replies >= {args.tokens // 2}, first token "
                  f"{sum(p > 0 for p in prefixes)}/{len(prefixes)}; |dlogprob| mean "
                  f"{statistics.mean(diffs):.4f} max {max(diffs):.3f}  ({llm.quantization})")  # fmt: skip
            print(f"{'':>11}first 8: {prefixes[:8]}", flush=True)
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
