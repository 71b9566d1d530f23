"""How far int8 activations move the default model's predictions, judged as llama.cpp's own
quality tooling judges a quantization: perplexity, KL divergence from the float path, and
how often the most likely next token is the same, over real conversations.

The first ShareGPT conversations (the `bench` extra), in the chat template, are scored token
by token through each path's own paged cache (runner/scoring.py), all paths in lockstep:
  float32   the GGUF's weights dequantized to float32 (`--quantization none --dtype float32`),
            the reference
  bf16      the GGUF's blocks with bf16 activations (the default until now)
  int8      the same blocks with `--activation-quantization int8`
For each path against float32: perplexity and its change, the mean KL(float32 || path) per
token over the whole vocabulary (and its 99th percentile), and the share of positions whose
argmax agrees. `--chunk 256` runs the prefill path, where int8 activations apply (the steps
of 9-512 rows; a step of up to 8 keeps bf16 rows); `--batch-invariant` makes int8 apply at
every row count, chunks of 1 included.

    python benchmarks/activation_quality.py                  # ~4k tokens, chunks of 256
    python benchmarks/activation_quality.py --tokens 16384 --chunk 256
"""

from __future__ import annotations

import argparse
import math

import torch

from tandem.bench.sharegpt import chat_token_ids
from tandem.engine.builder import build_engine
from tandem.engine.config import EngineConfig
from tandem.engine.tokenizer import load_tokenizer
from tandem.runner.scoring import chunk_distributions

PATHS = {
    "float32": dict(quantization="none", dtype="float32"),
    "bf16": dict(activation_quantization="none"),
    "int8": dict(activation_quantization="int8"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of text scored in all")
    ap.add_argument("--longest", type=int, default=1024, help="tokens kept of each conversation")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per step (1: the decode path)")
    ap.add_argument("--batch-invariant", action="store_true", help="int8 at every row count")
    args = ap.parse_args()

    cores = {}
    for name, kw in PATHS.items():
        config = EngineConfig(batch_invariant=args.batch_invariant, **kw)
        cores[name], loaded = build_engine(config)
    docs = chat_token_ids(load_tokenizer(loaded.model_path), args.tokens, args.longest)
    print(f"{sum(map(len, docs))} tokens of {len(docs)} ShareGPT conversations, chunks of "
          f"{args.chunk}{', batch-invariant' if args.batch_invariant else ''}")  # fmt: skip
    nll = {name: 0.0 for name in cores}
    kl = {name: [] for name in cores}
    agree = {name: 0 for name in cores}
    count = 0
    for doc in docs:
        streams = {name: chunk_distributions(core, doc, args.chunk) for name, core in cores.items()}
        for steps in zip(*streams.values()):
            by_path = dict(zip(streams, steps))
            targets, ref = by_path["float32"]
            top = ref.argmax(-1)
            count += len(targets)
            for name, (_, logprobs) in by_path.items():
                nll[name] -= logprobs.gather(1, targets[:, None]).sum().item()
                # KL(ref || path) = sum p_ref (log p_ref - log p_path), per position
                kl[name] += (ref.exp() * (ref - logprobs)).sum(-1).tolist()
                agree[name] += (logprobs.argmax(-1) == top).sum().item()
    base = math.exp(nll["float32"] / count)
    print(f"{'path':8s} {'perplexity':>10s} {'vs float32':>10s} {'mean KL':>9s} {'p99 KL':>8s} "
          f"{'top-1 agree':>11s}")  # fmt: skip
    for name in cores:
        ppl = math.exp(nll[name] / count)
        values = torch.tensor(kl[name])
        print(f"{name:8s} {ppl:10.4f} {ppl / base - 1:+10.3%} {values.mean().item():9.5f} "
              f"{values.quantile(0.99).item():8.4f} {agree[name] / count:11.2%}")  # fmt: skip


if __name__ == "__main__":
    main()
