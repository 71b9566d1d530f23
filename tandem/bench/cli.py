"""`tandem bench serve | compare`: flags named as `vllm bench serve`'s where it has them."""

from __future__ import annotations

import argparse
import os

DATASETS = [
    "random", "sharegpt", "shared-prefix", "multi-turn", "multi-class", "json-schema", "custom",
]  # fmt: skip


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark an OpenAI-compatible server")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)

    s = bench_sub.add_parser(
        "serve",
        help="drive a running server (tandem, vLLM, SGLang, llama.cpp) with a workload",
        description="Drive any OpenAI-compatible server the way `vllm bench serve` does.",
    )
    s.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    add_common_args(s)

    c = bench_sub.add_parser(
        "compare",
        help="run one seeded workload against tandem and a peer, and compare",
        description="Start tandem, run the workload, stop it; start the peer from its recipe "
        "(benchmarks/peers/), run the same workload, stop it; print both with ratios.",
    )
    c.add_argument("--peer", required=True, choices=["vllm", "llamacpp"])
    c.add_argument("--peer-recipe", default=None, help="a recipe script other than the bundled one")
    c.add_argument("--peer-url", default=None, help="use a peer already running at this URL")
    c.add_argument("--peer-port", type=int, default=8100)
    c.add_argument("--tandem-url", default=None, help="use a tandem server already running here")
    c.add_argument("--tandem-port", type=int, default=8090)
    c.add_argument("--tandem-model", default=None, help="model for `tandem serve` (default model)")
    c.add_argument("--tandem-args", default="", help="extra flags for `tandem serve`, one string")
    c.add_argument(
        "--startup-timeout", type=float, default=900.0, help="seconds to wait per server"
    )
    c.add_argument("--no-install", action="store_true", help="skip the recipe's install step")
    add_common_args(c)


def add_common_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server API")
    g.add_argument(
        "--backend",
        default="openai",
        choices=["openai", "openai-chat"],
        help="openai: /v1/completions; openai-chat: /v1/chat/completions",
    )
    g.add_argument("--endpoint", default=None, help="path to POST to (default from --backend)")
    g.add_argument("--model", default=None, help="model name to send (default: /v1/models)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY, as vLLM's bench)",
    )
    g.add_argument(
        "--tokenizer", default=None, help="HF folder or .gguf to count tokens (default model)"
    )
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos (vLLM, tandem, llama.cpp)"
    )
    g.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    g.add_argument("--request-timeout", type=float, default=None, help="seconds per request")
    g.add_argument(
        "--ready-timeout",
        "--ready-check-timeout-sec",
        type=float,
        default=600.0,
        help="wait this long for a starting server: /v1/models, then one test request (0: "
        "skip the test request)",
    )

    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random", choices=DATASETS)
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON, or JSONL for custom")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests (multi-turn: all turns)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--random-input-len", type=int, default=1024, help="(suffix / user turn) tokens")
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths in len*(1±r)")
    g.add_argument("--prefix-groups", type=int, default=4, help="shared-prefix: number of prefixes")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: prefix tokens")
    g.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    g.add_argument(
        "--think-time", type=float, default=0.0, help="multi-turn: seconds between turns"
    )
    g.add_argument(
        "--class",
        dest="cls",
        action="append",
        metavar="SPEC",
        help="multi-class: name=N,share=F,input=A-B,output=A-B,priority=P,ttft=MS,tpot=MS,e2el=MS",
    )
    g.add_argument(
        "--send-slo-class",
        action="store_true",
        help="send each request's class name as `slo_class` (for `tandem serve --slo-classes`)",
    )
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g.add_argument("--custom-output-len", type=int, default=256)

    g = p.add_argument_group("arrivals")
    g.add_argument("--request-rate", default="inf", help="req/s: inf, 4, or a sweep 1,2,4,8")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    g.add_argument(
        "--max-concurrency", default=None, help="open requests at most (or a list 1,16,64)"
    )
    g.add_argument(
        "--duration", type=float, default=None, help="seconds, instead of every prompt once"
    )

    g = p.add_argument_group("measurement")
    g.add_argument(
        "--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS"
    )
    g.add_argument("--metric-percentiles", default="90,99")
    g.add_argument(
        "--find-max-rate",
        action="store_true",
        help="search the highest Poisson rate whose SLO attainment is at least --slo-target",
    )
    g.add_argument("--slo-target", type=float, default=0.9)
    g.add_argument("--max-probes", type=int, default=8)

    g = p.add_argument_group("output")
    g.add_argument("--label", default=None)
    g.add_argument("--save-result", action="store_true")
    g.add_argument("--save-detailed", action="store_true", help="per-request fields in the JSON")
    g.add_argument("--result-dir", default="bench-results")
    g.add_argument(
        "--result-filename",
        default=None,
        help="the JSON file's name inside --result-dir (a sweep adds each point's suffix)",
    )
    g.add_argument("--plot", action="store_true", help="write PNG plots to --result-dir")
    g.add_argument("--disable-tqdm", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "compare":
        from tandem.bench import compare

        return compare.run(args)
    from tandem.bench import serve

    return serve.run(args)
