"""A prefill/decode ratio that follows the load against every static ratio, in `tandem sim`
(every figure simulated): traffic whose mix shifts from long prompts with short answers
(RAG, summaries) to short prompts with long answers (chat, generation) and back, Llama-3-8B
on roofline L40S instances, one fixed fleet. Each static split P prefill + (N - P) decode
is simulated (the disaggregated layouts `tandem sim plan` searches, all of them at this
size); the dynamic fleet starts at the best one and runs the router's own policy
(router/pd_ratio.py, as `tandem router --pd-ratio auto` does). Prints SLO attainment and
goodput (requests meeting their SLO per second) of each, and the dynamic fleet's gain.

    python benchmarks/pd_ratio.py [--minutes 60] [--rate 4.25] [--instances 6] [--json F]

docs/simulator.md has the run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tandem.router.pd_ratio import PDRatioConfig
from tandem.sim.cluster import ClusterSpec
from tandem.sim.plan import Layout
from tandem.sim.report import attained, simulate, summarize
from tandem.sim.roles import RoleSimulation
from tandem.sim.workload import shifting_mix_requests

SLO = {"ttft": 2000.0, "tpot": 100.0}  # ms, every request
BASE = {"model": "llama-3-8b", "router": "least_load", "engine": {"max_num_batched_tokens": 2048},
        "link": {"bandwidth_gbs": 25, "latency_ms": 0.1}}  # fmt: skip


def cluster(prefill: int, decode: int, hardware: str) -> ClusterSpec:
    return ClusterSpec.from_dict(Layout(hardware, prefill=prefill, decode=decode).cluster(BASE))


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--rate", type=float, default=4.25, help="requests/s")
    p.add_argument("--instances", type=int, default=6)
    p.add_argument("--hardware", default="L40S")
    p.add_argument("--prompt-heavy", default="8192,16", help="input,output tokens")
    p.add_argument("--decode-heavy", default="1024,1024", help="input,output tokens")
    d = PDRatioConfig()
    p.add_argument("--margin", type=float, default=d.margin)
    p.add_argument("--sustain", type=float, default=d.sustain)
    p.add_argument("--cooldown", type=float, default=d.cooldown)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    duration = args.minutes * 60
    heavy = tuple(int(x) for x in args.prompt_heavy.split(","))
    light = tuple(int(x) for x in args.decode_heavy.split(","))
    requests = shifting_mix_requests(duration, args.rate, heavy, light, seed=0,
                                     range_ratio=0.5, slo=SLO)  # fmt: skip
    print(f"{len(requests)} requests over {args.minutes:g} min at {args.rate:g} req/s; "
          f"{heavy[0]}/{heavy[1]} tokens (in/out) for 90% of them at the ends, 10% halfway, "
          f"the rest {light[0]}/{light[1]}; SLO TTFT {SLO['ttft']:g} ms, TPOT {SLO['tpot']:g} "
          f"ms; llama-3-8b on {args.instances} {args.hardware} (roofline)")  # fmt: skip
    n, static = args.instances, {}
    for prefill in range(1, n):
        t = time.perf_counter()
        a = attained(simulate(cluster(prefill, n - prefill, args.hardware), requests))
        static[prefill] = a
        print(f"  static {prefill} prefill + {n - prefill} decode: attainment {a:.1%}, goodput "
              f"{a * len(requests) / duration:.2f} req/s ({time.perf_counter() - t:.0f} s to simulate)")  # fmt: skip
    best = max(static, key=lambda k: static[k])
    config = PDRatioConfig(ttft_target=SLO["ttft"] / 1000, tpot_target=SLO["tpot"] / 1000,
                           margin=args.margin, sustain=args.sustain, cooldown=args.cooldown)  # fmt: skip
    sim = RoleSimulation(cluster(best, n - best, args.hardware), requests, config)
    a = attained(summarize(sim, sim.run()))
    gain = a / static[best] - 1
    print(
        f"best static {best} prefill + {n - best} decode: attainment {static[best]:.1%}, "
        f"goodput {static[best] * len(requests) / duration:.2f} req/s"
    )
    print(f"dynamic (from it, {len(sim.moves)} role moves): attainment {a:.1%}, goodput "
          f"{a * len(requests) / duration:.2f} req/s: {gain:+.0%} goodput")  # fmt: skip
    ratios = sorted({p for _, p, _ in sim.ratio})
    print(f"  prefill instances over the run: {ratios[0]}-{ratios[-1]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "pd_ratio", "requests": len(requests), "static": static,
                       "best_static_prefill": best, "dynamic_attainment": a, "gain": gain,
                       "moves": sim.moves, "args": vars(args)}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
