"""`tandem generate [--model PATH] "prompt"` (or `--file prompts.txt`): offline generation."""

from __future__ import annotations

import argparse
import time


def add_parser(sub) -> None:
    from tandem.engine.config import add_engine_args

    p = sub.add_parser("generate", help="generate completions offline and print them")
    p.add_argument("prompt", nargs="*", help="prompt text (one completion per argument)")
    p.add_argument(
        "--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M)"
    )
    p.add_argument("--file", default=None, help="a text file with one prompt per line")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the chat template",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("-n", type=int, default=1)
    p.add_argument("--ignore-eos", action="store_true")
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    from tandem import LLM, SamplingParams
    from tandem.engine.config import engine_config_from_args
    from tandem.logs import setup_logging

    setup_logging()  # a first run says it is compiling, not a silent minute

    prompts = list(args.prompt)
    if args.file:
        with open(args.file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("prompt: give at least one prompt or --file")
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    cfg = engine_config_from_args(args, args.model)
    llm = LLM(**vars(cfg))
    start = time.perf_counter()
    if args.chat:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 1
        )
    else:
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    elapsed = time.perf_counter() - start
    num_tokens = 0
    for prompt, out in zip(prompts, outputs):
        for c in out.outputs:
            num_tokens += len(c.token_ids)
            tag = f" [{c.index}]" if len(out.outputs) > 1 else ""
            print(f"--- {prompt!r}{tag} ({len(c.token_ids)} tokens, {c.finish_reason})")
            print(c.text)
    print(f"--- {num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} output tokens/s")
    return 0
