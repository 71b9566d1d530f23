"""`tandem sim run --cluster FILE`: simulate a cluster on a workload and print what
`tandem bench serve` would (same metrics, same JSON keys), plus cost and utilisation; a rate
sweep, `--find-max-rate` and `--plot` as `tandem bench serve` has them.

`tandem sim plan`: the cheapest cluster (accelerator, TP, colocated or prefill/decode
counts) that meets SLOs at a rate, with the frontier it explored. Every figure is simulated."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import time
from pathlib import Path

DATASETS = ("random", "shared-prefix", "multi-turn", "multi-class", "mooncake", "azure")
BANNER = "SIMULATED (tandem sim): figures below come from the cost model, not hardware"


def add_parser(sub) -> None:
    p = sub.add_parser("sim", help="simulate a cluster with the real scheduler on a virtual clock")
    s = p.add_subparsers(dest="sim_command", required=True)
    r = s.add_parser("run", help="one workload on one cluster")
    r.add_argument(
        "--cluster", required=True, help="cluster YAML or JSON (see tandem/sim/cluster.py)"
    )
    _workload_args(r)
    r.add_argument("--request-rate", default="inf", help="req/s: inf, 4, or a sweep 1,2,4,8")
    r.add_argument(
        "--find-max-rate",
        action="store_true",
        help="search the highest Poisson rate whose SLO attainment is at least --slo-target",
    )
    r.add_argument("--max-probes", type=int, default=10)
    r.add_argument("--save-result", default=None, help="write the result JSON here")
    r.add_argument("--plot", default=None, help="write a PNG of a sweep or search here")

    o = s.add_parser(
        "rollout", help="RL rollouts: synchronous against partial (APRIL's), finished tok/s"
    )
    from tandem.sim.rollout import RolloutSpec

    for f in dataclasses.fields(RolloutSpec):
        o.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)

    q = s.add_parser("plan", help="the cheapest cluster that meets SLOs at a request rate")
    q.add_argument("--model", default="llama-3-8b", help="a built-in spec or a config.json")
    q.add_argument("--hardware", nargs="+", default=["H100"], help="accelerators to consider")
    q.add_argument("--tp", nargs="+", type=int, default=[1], help="tensor-parallel degrees")
    q.add_argument(
        "--pp", nargs="+", type=int, default=[1], help="pipeline-parallel degrees (stages)"
    )
    q.add_argument(
        "--ep", nargs="+", choices=("off", "on"), default=["off"],
        help="a mixture of experts' experts split by columns (off) or spread whole over the "
        "tp devices (on, all-to-all); both: compare",
    )  # fmt: skip
    q.add_argument("--mode", choices=("colocated", "disaggregated", "both"), default="both")
    q.add_argument("--max-instances", type=int, default=16)
    q.add_argument("--router", default="least_load")
    q.add_argument("--scheduling-policy", default="fcfs")
    q.add_argument("--link-gbs", type=float, default=50.0, help="prefill->decode GB/s")
    q.add_argument("--link-latency-ms", type=float, default=0.05)
    q.add_argument("--request-rate", type=float, required=True)
    _workload_args(q)
    q.add_argument("--save-result", default=None, help="write every probe as JSON here")
    q.add_argument("--plot", default=None, help="write a PNG of price against attainment here")


def _workload_args(p) -> None:
    p.add_argument("--dataset-name", default="random", choices=DATASETS)
    p.add_argument("--dataset-path", default=None, help="a Mooncake JSONL or Azure CSV trace")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-groups", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--turns", type=int, default=5, help="multi-turn: turns a conversation")
    p.add_argument(
        "--think-time", type=float, default=20.0, help="multi-turn: seconds between turns"
    )
    p.add_argument(
        "--class",
        dest="classes",
        action="append",
        default=[],
        help="multi-class: name=...,share=...,input=64-256,output=128,priority=0,ttft=MS,tpot=MS",
    )
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs as ttft:MS tpot:MS e2el:MS")
    p.add_argument("--slo-target", type=float, default=0.9)
    p.add_argument(
        "--processes",
        type=int,
        default=None,
        help="processes stepping a colocated cluster's instances (default: one per core)",
    )


def workload(args, rate: float):
    from tandem.bench.workloads import RequestClass
    from tandem.sim import workload as w

    if args.dataset_name == "random":
        return w.random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                 rate, args.seed, args.random_range_ratio,
                                 args.burstiness)  # fmt: skip
    if args.dataset_name == "shared-prefix":
        return w.shared_prefix_requests(args.num_prompts, args.prefix_groups, args.prefix_len,
                                        args.random_input_len, args.random_output_len,
                                        rate, args.seed)  # fmt: skip
    if args.dataset_name == "multi-turn":  # the rate is of conversations
        conversations = max(1, args.num_prompts // args.turns)
        return w.multi_turn_requests(conversations, args.turns, args.random_input_len,
                                     args.random_output_len, rate, args.think_time, args.seed)  # fmt: skip
    if args.dataset_name == "multi-class":
        classes = [RequestClass.parse(c) for c in args.classes]
        return w.multi_class_requests(args.num_prompts, classes, rate, args.seed, args.burstiness)
    if not args.dataset_path:
        raise ValueError(f"dataset: --dataset-name {args.dataset_name} needs --dataset-path")
    if args.dataset_name == "mooncake":
        return w.mooncake_trace(args.dataset_path, args.num_prompts)
    return w.azure_trace(args.dataset_path, args.num_prompts, args.seed)


def parse_goodput(items) -> dict[str, float] | None:
    from tandem.bench.metrics import parse_slos

    return parse_slos(items) if items else None


def run(args: argparse.Namespace) -> int:
    if args.sim_command == "plan":
        return plan(args)
    if args.sim_command == "rollout":
        return rollout(args)
    from tandem.bench.arrivals import parse_rates
    from tandem.bench.results import format_summary, format_sweep, rate_value
    from tandem.sim.cluster import ClusterSpec

    cluster = ClusterSpec.load(args.cluster)
    goodput = parse_goodput(args.goodput)
    rates = parse_rates(args.request_rate)
    if args.find_max_rate and not (goodput or args.classes):
        raise ValueError("--find-max-rate needs SLOs: --goodput ttft:MS ... or classes with SLOs")
    if args.find_max_rate and args.dataset_name in ("mooncake", "azure"):
        raise ValueError("--find-max-rate: a trace sets its own arrival times")
    print(BANNER)
    results = []

    def one(rate: float) -> dict:
        result = _simulate(cluster, workload(args, rate), goodput, args.processes) | {
            "cluster": str(args.cluster),
            "dataset_name": args.dataset_name,
            "request_rate": rate_value(rate),
            "seed": args.seed,
        }
        results.append(result)
        return result

    if args.find_max_rate:
        from tandem.bench.search import find_max_rate
        from tandem.sim.report import attained

        async def probe(rate: float) -> float:
            return attained(one(rate))

        start = next((r for r in rates if math.isfinite(r)), 1.0)
        found = asyncio.run(find_max_rate(probe, args.slo_target, start, args.max_probes))
        results.sort(key=lambda r: r["request_rate"])
        print(format_sweep(results))
        print(
            f"max rate with SLO attainment >= {args.slo_target:.0%}: "
            + (f"{found.max_rate:.3g} req/s" if found.max_rate else "none of the rates probed")
        )
        for r in results:
            r["max_rate_found"] = found.max_rate
    else:
        for rate in rates:
            one(rate)
        if len(results) == 1:
            _print_one(results[0], format_summary(results[0], goodput=bool(goodput)))
        else:
            print(format_sweep(results))
    if args.plot and len(results) > 1:
        from tandem.bench import plots

        title = "simulated: " + Path(args.cluster).name
        print(f"plot saved to {plots.sweep({Path(args.cluster).stem: results}, args.plot, title)}")
    if args.save_result:
        doc = results[0] if len(results) == 1 else results
        Path(args.save_result).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return 0


def _simulate(cluster, requests, goodput, processes: int | None) -> dict:
    from tandem.sim.report import simulate
    from tandem.sim.shards import default_processes

    t0 = time.perf_counter()
    result = simulate(cluster, requests, goodput, processes or default_processes())
    return result | {"wall_seconds": time.perf_counter() - t0}


def _print_one(result: dict, summary: str) -> None:
    print(summary)
    wall = result["wall_seconds"]
    print(f"simulated {result['simulated_seconds']:.1f} s in {wall:.1f} s of wall time "
          f"({result['simulated_seconds'] / max(wall, 1e-9):.0f}x); {result['num_steps']} steps")  # fmt: skip
    cost = result["cost_per_million_output_tokens"]
    if cost is not None:
        print(f"cost per million output tokens: ${cost:.3f}")
    for name, g in result["groups"].items():
        print(f"  group {name}: {g['instances']} x {g['hardware']} (tp {g['tp']}, pp {g.get('pp', 1)}), "
              f"utilisation {g['utilization']:.0%}")  # fmt: skip
    if "pd_handoff_stage_ms" in result:
        print("handoff stages, mean ms: " + ", ".join(
            f"{k} {v:.1f}" for k, v in result["pd_handoff_stage_ms"].items()))  # fmt: skip


def plan(args: argparse.Namespace) -> int:
    from tandem.sim.cluster import ClusterSpec
    from tandem.sim.plan import Planner, format_plan

    goodput = parse_goodput(args.goodput)
    if not (goodput or args.classes):
        raise ValueError("plan: give the SLOs to meet (--goodput ttft:MS tpot:MS, or --class)")
    requests = workload(args, args.request_rate)
    base = {"model": args.model, "router": args.router,
            "scheduling_policy": args.scheduling_policy,
            "link": {"bandwidth_gbs": args.link_gbs, "latency_ms": args.link_latency_ms}}  # fmt: skip

    def evaluate(cluster: dict) -> dict:
        return _simulate(ClusterSpec.from_dict(cluster), requests, goodput, args.processes)

    def price(cluster: dict) -> float:
        return sum(g.price_per_hour * g.count for g in ClusterSpec.from_dict(cluster).groups)

    planner = Planner(base, evaluate, args.slo_target, args.max_instances, price)
    best = planner.search(args.hardware, args.tp, colocated=args.mode != "disaggregated",
                          disaggregated=args.mode != "colocated", pps=args.pp,
                          eps=tuple(e == "on" for e in args.ep))  # fmt: skip
    print(BANNER)
    print(f"{len(requests)} requests at {args.request_rate:g} req/s, SLO attainment target "
          f"{args.slo_target:.0%}; {len(planner.probes)} clusters simulated")  # fmt: skip
    print(format_plan(planner))
    if best is None:
        print(f"no cluster of at most {args.max_instances} instances meets the target")
    else:
        print(f"cheapest that meets it: {best.layout.describe()} at "
              f"${best.price_per_hour:.2f}/hour ({best.attainment:.1%} attained)")  # fmt: skip
    if args.save_result:
        doc = [{"cluster": p.layout.describe(), "price_per_hour": p.price_per_hour,
                "attainment": p.attainment, **p.result} for p in planner.probes.values()]  # fmt: skip
        Path(args.save_result).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if args.plot:
        from tandem.sim.plan import plot_plan

        print(f"plot saved to {plot_plan(planner, args.plot)}")
    return 0 if best is not None else 1


def rollout(args: argparse.Namespace) -> int:
    from tandem.sim.rollout import RolloutSpec, compare

    spec = RolloutSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RolloutSpec)})
    sync, partial = compare(spec)
    print(f"{spec.steps} RL steps of {spec.batch} rollouts, {spec.model} on one {spec.hardware}, "
          f"outputs lognormal (median {spec.median_output}, sigma {spec.sigma}, at most "
          f"{spec.max_output}), {spec.update_s:g} s a weight update")  # fmt: skip
    for r in (sync, partial):
        print(f"  {r.mode:8} {r.seconds:9.1f} s  {r.rollouts:6d} rollouts  "
              f"{r.tokens_per_s:9.0f} finished tok/s")  # fmt: skip
    print(f"partial rollout (over {spec.over:g}): {partial.tokens_per_s / sync.tokens_per_s:.2f}x "
          "the finished tokens per second of synchronous rollout")  # fmt: skip
    return 0
