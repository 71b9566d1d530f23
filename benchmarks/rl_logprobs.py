"""Rollout logprobs against the trainer's: sampled rollouts from tandem, each sampled
token's logprob against HF transformers' recomputation on the same weights and tokens (what
a trainer computes for its importance ratio), in float32 and in bf16.

Reported per dtype: the largest and mean |difference|, and TRL#6789's statistic: the share of
tokens whose probability ratio exp(ours - trainer's) leaves [0.9, 1.1]. The default model's
float weights (`--quantization none`: its GGUF blocks dequantized, which is also the
converted folder HF loads), so both sides hold exactly the same weights.

    python benchmarks/rl_logprobs.py [--prompts 16] [--n 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import math

import torch

from tandem import LLM, SamplingParams
from tandem.bench.workloads import CHAT_PROMPTS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="sampled answers per prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    print(f"{args.prompts} prompts x {args.n} answers of {args.max_tokens} tokens, temperature 1")
    print(f"{'dtype':10} {'max |diff|':>11} {'mean |diff|':>12} {'ratio outside [0.9, 1.1]':>26}")
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, quantization="none", kv_cache_memory=0.2)
        tok = llm.get_tokenizer()
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )  # fmt: skip
            for p in list(CHAT_PROMPTS)[: args.prompts]
        ]
        ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
        params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.n, logprobs=0, seed=0, ignore_eos=True)  # fmt: skip
        outs = llm.generate(ids, params, use_tqdm=False)
        hf = AutoModelForCausalLM.from_pretrained(str(llm.model_path), dtype=getattr(torch, dtype)).eval()  # fmt: skip
        diffs = []
        for prompt, out in zip(ids, outs):
            for c in out.outputs:
                ours = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
                with torch.no_grad():
                    logits = hf(torch.tensor([prompt + list(c.token_ids)])).logits[0, len(prompt) - 1 : -1]  # fmt: skip
                theirs = torch.log_softmax(logits.float(), -1)[torch.arange(len(c.token_ids)), torch.tensor(c.token_ids)]  # fmt: skip
                diffs += [a - b for a, b in zip(ours, theirs.tolist())]
        outside = sum(not 0.9 <= math.exp(d) <= 1.1 for d in diffs) / len(diffs)
        mean = sum(abs(d) for d in diffs) / len(diffs)
        print(f"{dtype:10} {max(abs(d) for d in diffs):11.2e} {mean:12.2e} {outside:25.2%}")


if __name__ == "__main__":
    main()
