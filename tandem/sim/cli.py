"""`tandem sim run --cluster FILE`: simulate a cluster on a workload and print what
`tandem bench serve` would (same metrics, same JSON keys), plus cost and utilisation. Every
figure it prints is simulated."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DATASETS = ("random", "shared-prefix", "mooncake", "azure")


def add_parser(sub) -> None:
    p = sub.add_parser("sim", help="simulate a cluster with the real scheduler on a virtual clock")
    s = p.add_subparsers(dest="sim_command", required=True)
    r = s.add_parser("run", help="one workload on one cluster")
    r.add_argument(
        "--cluster", required=True, help="cluster YAML or JSON (see tandem/sim/cluster.py)"
    )
    r.add_argument("--dataset-name", default="random", choices=DATASETS)
    r.add_argument("--dataset-path", default=None, help="a Mooncake JSONL or Azure CSV trace")
    r.add_argument("--num-prompts", type=int, default=1000)
    r.add_argument("--random-input-len", type=int, default=1024)
    r.add_argument("--random-output-len", type=int, default=128)
    r.add_argument("--random-range-ratio", type=float, default=0.0)
    r.add_argument("--prefix-groups", type=int, default=8)
    r.add_argument("--prefix-len", type=int, default=512)
    r.add_argument("--request-rate", type=float, default=float("inf"))
    r.add_argument("--burstiness", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--goodput", nargs="*", default=None, help="SLOs as ttft:MS tpot:MS e2el:MS")
    r.add_argument("--save-result", default=None, help="write the result JSON here")


def workload(args):
    from tandem.sim import workload as w

    if args.dataset_name == "random":
        return w.random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                 args.request_rate, args.seed, args.random_range_ratio,
                                 args.burstiness)  # fmt: skip
    if args.dataset_name == "shared-prefix":
        return w.shared_prefix_requests(args.num_prompts, args.prefix_groups, args.prefix_len,
                                        args.random_input_len, args.random_output_len,
                                        args.request_rate, args.seed)  # fmt: skip
    if not args.dataset_path:
        raise ValueError(f"dataset: --dataset-name {args.dataset_name} needs --dataset-path")
    if args.dataset_name == "mooncake":
        return w.mooncake_trace(args.dataset_path, args.num_prompts)
    return w.azure_trace(args.dataset_path, args.num_prompts, args.seed)


def parse_goodput(items) -> dict[str, float] | None:
    if not items:
        return None
    out = {}
    for item in items:
        key, _, ms = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not ms:
            raise ValueError(f"goodput: {item!r} is not ttft:MS, tpot:MS or e2el:MS")
        out[key] = float(ms)
    return out


def run(args: argparse.Namespace) -> int:
    from tandem.bench.results import format_summary
    from tandem.sim.cluster import ClusterSpec
    from tandem.sim.report import summarize
    from tandem.sim.simulator import Simulation

    cluster = ClusterSpec.load(args.cluster)
    requests = workload(args)
    sim = Simulation(cluster, requests)
    t0 = time.perf_counter()
    records = sim.run()
    wall = time.perf_counter() - t0
    goodput = parse_goodput(args.goodput)
    result = summarize(sim, records, goodput=goodput) | {
        "cluster": str(args.cluster),
        "dataset_name": args.dataset_name,
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "seed": args.seed,
        "wall_seconds": wall,
    }
    print("SIMULATED (tandem sim): figures below come from the cost model, not hardware")
    print(format_summary(result, goodput=bool(goodput)))
    cost = result["cost_per_million_output_tokens"]
    print(f"simulated {result['simulated_seconds']:.1f} s in {wall:.1f} s of wall time "
          f"({result['simulated_seconds'] / max(wall, 1e-9):.0f}x); {result['num_steps']} steps")  # fmt: skip
    if cost is not None:
        print(f"cost per million output tokens: ${cost:.3f}")
    for name, g in result["groups"].items():
        print(f"  group {name}: {g['instances']} x {g['hardware']} (tp {g['tp']}), "
              f"utilisation {g['utilization']:.0%}")  # fmt: skip
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0
