"""Offline throughput: tandem's LLM.generate vs HF transformers generate() on the same work.

A seeded mixed workload (default: 64 prompts, 32-512 prompt tokens, 16-256 output tokens) on
the default model. tandem gets all prompts at once (continuous batching); HF runs padded
static batches of 16, each until its longest requested output. Both count only the
requested output tokens, in the same dtype, in one run; the ratio is the figure.

    python benchmarks/offline_throughput.py [--num-prompts 64] [--hf-batch 16] [--model PATH]
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def workload(n: int, seed: int, vocab: int, in_range=(32, 512), out_range=(16, 256)):
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        prompts.append([rng.randrange(100, vocab - 100) for _ in range(rng.randint(*in_range))])
        outs.append(rng.randint(*out_range))
    return prompts, outs


def run_tandem(args, prompts, outs):
    from tandem import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    assert produced == sum(outs)
    dtype = llm.engine.runner.kv_cache.dtype
    del llm
    return elapsed, dtype


def run_hf(args, prompts, outs, dtype):
    from transformers import AutoModelForCausalLM

    from tandem.model.loader import resolve_model

    folder = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype, attn_implementation="sdpa"
    ).eval()
    pad = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch):
        batch, lens = prompts[i : i + args.hf_batch], outs[i : i + args.hf_batch]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
                pad_token_id=pad,
            )
        print(
            f"  HF batch {i // args.hf_batch + 1}/{-(-len(prompts) // args.hf_batch)} done "
            f"at {time.perf_counter() - start:.1f}s",
            flush=True,
        )
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    from tandem.core.model_config import ModelConfig
    from tandem.model.loader import resolve_model

    vocab = ModelConfig.from_folder(resolve_model(args.model)).vocab_size
    prompts, outs = workload(args.num_prompts, args.seed, vocab)
    total_out = sum(outs)
    print(
        f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {total_out} output tokens"
    )

    t_ours, dtype = run_tandem(args, prompts, outs)
    print(f"tandem: {t_ours:.1f} s, {total_out / t_ours:.1f} output tok/s ({dtype})")
    if args.skip_hf:
        return
    t_hf = run_hf(args, prompts, outs, dtype)
    print(
        f"HF transformers (static batches of {args.hf_batch}): {t_hf:.1f} s, {total_out / t_hf:.1f} output tok/s"
    )
    print(f"ratio tandem / HF: {t_hf / t_ours:.2f}x")


if __name__ == "__main__":
    main()
