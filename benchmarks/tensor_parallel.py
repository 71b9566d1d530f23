"""Tensor and pipeline parallelism on one CPU host: decode throughput of a split model against
the whole one, on the same work in one run. On one memory bus TP buys memory per process and
multi-socket bandwidth, not speed: the figure is what the split costs.

A random-init Llama (hidden 1024, 16 layers, 16 heads / 4 KV heads, MLP 2816, ~180M
parameters, the test tokenizer's 400-token vocabulary), bf16 where the CPU has it: 32 prompts
of 64 tokens, all running at once, 128 output tokens each. Decode tokens per second = 32 x 128
over (time to 129 tokens - time to 1 token, both measured). The whole model runs on every CPU
(torch's threads), each split rank on its share (--cpu-threads-bind auto). `--rounds`
alternations; medians.

    python benchmarks/tensor_parallel.py [--configs 1x1,2x1,1x2] [--rounds 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
            num_attention_heads=16, num_key_value_heads=4)  # fmt: skip


def decode_rate(path: Path, tp: int, pp: int, rounds: int) -> list[float]:
    from tandem import LLM, SamplingParams

    prompts = [[5 + (i * 31 + j * 7) % 390 for j in range(64)] for i in range(32)]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=129, ignore_eos=True)
    rates = []
    with LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp,
             enable_prefix_caching=False) as llm:  # fmt: skip
        llm.generate(prompts[:4], full, use_tqdm=False)  # warm-up
        for _ in range(rounds):
            t = time.perf_counter()
            llm.generate(prompts, first, use_tqdm=False)
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            llm.generate(prompts, full, use_tqdm=False)
            rates.append(32 * 128 / (time.perf_counter() - t - prefill))
    return rates


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--configs", default="1x1,2x1,1x2", help="TPxPP, the first the baseline")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from tests.conftest import build_checkpoint

    configs = [tuple(int(n) for n in c.split("x")) for c in args.configs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp) / "llama", "llama", **SIZE)
        rates = {c: [] for c in configs}
        for _ in range(args.rounds):  # alternate, so drift on a shared machine hits all alike
            for tp, pp in configs:
                rates[(tp, pp)] += decode_rate(path, tp, pp, 1)
    base = statistics.median(rates[configs[0]])
    report = {}
    print(f"{'TP x PP':>8} {'decode tok/s':>13} {'vs ' + 'x'.join(map(str, configs[0])):>8}")
    for (tp, pp), r in rates.items():
        m = statistics.median(r)
        report[f"{tp}x{pp}"] = dict(decode_tok_s=m, ratio=m / base, rounds=r)
        print(f"{tp:>4} x {pp:<2} {m:13.1f} {m / base:8.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "tensor_parallel", "model": SIZE, "running": 32, "results": report}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
