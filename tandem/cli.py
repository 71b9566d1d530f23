"""`tandem serve | generate | bench`: each subcommand lives in its package and is imported
only when used, so `tandem --help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module with add_parser(subparsers) and run(args)
SUBCOMMANDS = {
    "generate": "tandem.engine.generate_cli",
    "serve": "tandem.server.cli",
    "bench": "tandem.bench.cli",
}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM's."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB for the KV cache pool")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--tokenizer", default=None)


def engine_config_from_args(args: argparse.Namespace, model: str | None):
    from tandem.engine.config import EngineConfig

    return EngineConfig(
        model=model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tandem", description="LLM inference serving")
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    modules = {}
    for name, path in SUBCOMMANDS.items():
        if wanted is None or name == wanted:
            modules[name] = importlib.import_module(path)
            modules[name].add_parser(sub)
        else:
            sub.add_parser(name)
    args = parser.parse_args(argv)
    try:
        return modules[args.command].run(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
