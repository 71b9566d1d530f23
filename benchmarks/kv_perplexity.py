"""Perplexity of real conversations with the 8-bit KV caches (and int8 activations) against
the float cache.

The first ShareGPT conversations (the `bench` extra), in the model's chat template, are scored token by
token through the engine's own paged cache (tandem/runner/scoring.py): each chunk writes its
KV in the cache's format and reads the earlier chunks' KV back from it, as a served request
does. Chunks of 1 run the decode path (the C++ decode kernel on the CPU), longer chunks the
prefill path. The float cache is the model's dtype (`auto`); the issue's target is an 8-bit
cache within 1% of its perplexity. `--activations none,int8` scores the float cache with
--activation-quantization int8 too (int4 projections' steps of 3-512 rows: chunks past 2).

    python benchmarks/kv_perplexity.py                     # default model, ~4k tokens
    python benchmarks/kv_perplexity.py --tokens 8192 --chunks 1,256 --dtype float32
    python benchmarks/kv_perplexity.py --kv auto --activations none,int8 --chunks 256,16
"""

from __future__ import annotations

import argparse
import time

from tandem.bench.sharegpt import chat_token_ids
from tandem.engine.builder import build_engine
from tandem.engine.config import EngineConfig
from tandem.engine.tokenizer import load_tokenizer
from tandem.runner.scoring import perplexity, token_logprobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="HF folder or .gguf (default: bundled)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of text scored in all")
    ap.add_argument("--longest", type=int, default=1024, help="tokens kept of each conversation")
    ap.add_argument("--chunks", default="1,256", help="tokens per step: 1 = the decode path")
    ap.add_argument("--kv", default="auto,int8,fp8", help="KV cache dtypes; the first is the base")
    ap.add_argument("--dtype", default="auto", help="weights and float KV dtype")
    ap.add_argument("--activations", default="none", help="activation quantizations, each run")
    args = ap.parse_args()

    chunks = [int(c) for c in args.chunks.split(",")]
    kinds = [(kv, act) for act in args.activations.split(",") for kv in args.kv.split(",")]
    docs = None
    ppl: dict[tuple[tuple[str, str], int], float] = {}
    for kind in kinds:
        kv, act = kind
        config = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_dtype=kv, activation_quantization=act)  # fmt: skip
        core, loaded = build_engine(config)
        if docs is None:
            docs = chat_token_ids(load_tokenizer(loaded.model_path), args.tokens, args.longest)
            print(f"{loaded.model_path.name} ({loaded.dtype}), {len(docs)} ShareGPT conversations, "
                  f"{sum(map(len, docs))} tokens")  # fmt: skip
        for chunk in chunks:
            t0 = time.perf_counter()
            logprobs = [lp for doc in docs for lp in token_logprobs(core, doc, chunk)]
            ppl[kind, chunk] = perplexity(logprobs)
            base = ppl[kinds[0], chunk]
            print(f"kv {kv:>5}  activations {act:>4}  chunk {chunk:>4}  perplexity "
                  f"{ppl[kind, chunk]:8.4f}  {ppl[kind, chunk] / base - 1:+7.2%} vs {'/'.join(kinds[0])}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
