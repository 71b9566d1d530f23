"""An autoscaled fleet against a static one in `tandem sim` (every figure simulated): an hour of
traffic whose rate swings 4x on a daily curve, Llama-3-8B on roofline L40S instances. The
static fleet is the smallest that meets the SLO target at the peak; the autoscaled one runs
the router's own policy (router/autoscale.py, as `tandem router --autoscale` does) between
one instance and that size, with a cold start per new instance. Prints SLO attainment and
instance-hours of both, and the saving.

    python benchmarks/elastic.py [--minutes 60] [--trough 2] [--peak 8] [--target 0.95]
                                 [--start-seconds 60] [--static-from N] [--target-load L]
                                 [--scale-down-fraction F] [--down-cooldown S] [--lookahead S]
                                 [--json F]

The policy's settings are `tandem router --autoscale`'s flags; docs/simulator.md has the run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tandem.router.autoscale import AutoscaleConfig
from tandem.sim.cluster import ClusterSpec
from tandem.sim.elastic import ElasticSimulation
from tandem.sim.report import attained, simulate, summarize
from tandem.sim.workload import diurnal_requests

SLO = {"ttft": 2000.0, "tpot": 100.0}  # ms, every request


def cluster(count: int, hardware: str) -> ClusterSpec:
    return ClusterSpec.from_dict({"model": "llama-3-8b", "router": "least_load",
                                  "engine": {"max_num_batched_tokens": 2048},
                                  "groups": [{"name": "g", "hardware": hardware, "count": count}]})  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--trough", type=float, default=2.0, help="requests/s at the ends")
    p.add_argument("--peak", type=float, default=8.0, help="requests/s halfway")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--hardware", default="L40S")
    p.add_argument("--target", type=float, default=0.95, help="SLO attainment to meet")
    p.add_argument("--start-seconds", type=float, default=60.0, help="a new instance's cold start")
    p.add_argument("--max-static", type=int, default=12)
    p.add_argument("--static-from", type=int, default=1, help="the first static size tried")
    d = AutoscaleConfig()
    p.add_argument("--target-queue", type=float, default=1.0, help="requests queued per instance")  # fmt: skip
    p.add_argument("--target-load", type=float, default=None, help="requests running or waiting per instance")  # fmt: skip
    p.add_argument("--scale-down-fraction", type=float, default=0.5)
    p.add_argument("--sustain", type=float, default=5.0)
    p.add_argument("--up-cooldown", type=float, default=15.0)
    p.add_argument("--down-cooldown", type=float, default=d.down_cooldown)
    p.add_argument("--lookahead", type=float, default=0.0,
                   help="seconds ahead the load is projected on its trend (0: off)")  # fmt: skip
    p.add_argument("--json", default=None)
    args = p.parse_args()
    duration = args.minutes * 60
    requests = diurnal_requests(duration, args.trough, args.peak, args.input_len,
                                args.output_len, seed=0, range_ratio=0.5, slo=SLO)  # fmt: skip
    print(f"{len(requests)} requests over {args.minutes:g} min, {args.trough:g} -> "
          f"{args.peak:g} -> {args.trough:g} req/s; SLO TTFT {SLO['ttft']:g} ms, TPOT "
          f"{SLO['tpot']:g} ms; llama-3-8b on {args.hardware} (roofline)")  # fmt: skip
    static = None
    for n in range(args.static_from, args.max_static + 1):
        t = time.perf_counter()
        result = simulate(cluster(n, args.hardware), requests)
        a = attained(result)
        print(f"  static {n}: attainment {a:.1%} ({time.perf_counter() - t:.0f} s to simulate)")
        if a >= args.target:
            static = (n, result)
            break
    if static is None:
        print(f"no static fleet up to {args.max_static} meets {args.target:.0%}")
        return 1
    n, static_result = static
    static_hours = n * static_result["simulated_seconds"] / 3600
    config = AutoscaleConfig(min_workers=1, max_workers=n, target_queue_per_worker=args.target_queue,
                             target_load_per_worker=args.target_load,
                             scale_down_fraction=args.scale_down_fraction,
                             sustain=args.sustain, up_cooldown=args.up_cooldown,
                             down_cooldown=args.down_cooldown, lookahead=args.lookahead)  # fmt: skip
    sim = ElasticSimulation(cluster(1, args.hardware), requests, config, args.start_seconds)
    records = sim.run()
    elastic = summarize(sim, records)
    elastic_hours = sim.instance_seconds(sim.end) / 3600
    a_static, a_elastic = attained(static_result), attained(elastic)
    saving = 1 - elastic_hours / static_hours
    print(f"static   {n} instances: attainment {a_static:.1%}, {static_hours:.2f} instance-hours")
    print(f"autoscaled 1-{n}: attainment {a_elastic:.1%}, {elastic_hours:.2f} instance-hours "
          f"(peak {sim.peak_instances()}, {len(sim.actions)} scale actions): "
          f"{saving:.0%} fewer instance-hours")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "elastic", "requests": len(requests), "static_instances": n,
                       "static_attainment": a_static, "static_instance_hours": static_hours,
                       "elastic_attainment": a_elastic, "elastic_instance_hours": elastic_hours,
                       "saving": saving, "actions": sim.actions, "args": vars(args)}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
