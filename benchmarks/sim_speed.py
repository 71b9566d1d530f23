"""How fast `tandem sim` runs: simulated seconds per wall second on a 16-instance cluster at
50 requests/s (the issue's scale: an hour of it should take under five minutes).

    python benchmarks/sim_speed.py [--seconds 60] [--rate 50] [--instances 16] [--processes N]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    from tandem.sim.cluster import ClusterSpec
    from tandem.sim.shards import default_processes
    from tandem.sim.simulator import Simulation
    from tandem.sim.workload import random_requests

    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0, help="simulated seconds of arrivals")
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--hardware", default="H100")
    ap.add_argument("--processes", type=int, default=default_processes(),
                    help="processes stepping the instances (tandem sim's default)")  # fmt: skip
    args = ap.parse_args()
    cluster = ClusterSpec.from_dict({"model": "llama-3-8b", "router": "least_load", "groups": [
        {"hardware": args.hardware, "count": args.instances}]})  # fmt: skip
    n = int(args.seconds * args.rate)
    requests = random_requests(n, 1024, 256, args.rate, seed=0, range_ratio=0.5)
    sim = Simulation(cluster, requests, args.processes)
    t0, cpu0 = time.perf_counter(), time.process_time()
    records = sim.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    simulated = max(r.finished for r in records)
    print(f"{n} requests at {args.rate:g}/s on {args.instances} x {args.hardware}, "
          f"{args.processes} processes: "
          f"{simulated:.0f} simulated s in {wall:.1f} s wall = {simulated / wall:.1f} simulated "
          f"s per wall s; {sim.num_steps} steps ({sim.num_steps / wall:.0f} steps/s); an hour "
          f"would take {3600 / (simulated / wall) / 60:.1f} min ({3600 / (simulated / cpu) / 60:.1f} "
          f"min of CPU time)")  # fmt: skip


if __name__ == "__main__":
    main()
