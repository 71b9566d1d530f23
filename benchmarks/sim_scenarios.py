"""Scenario studies with `tandem sim` (every figure simulated: roofline H100/A100 profiles of
Llama-3-8B, assumed prices), written as markdown tables and PNGs for docs/simulator.md:

    python benchmarks/sim_scenarios.py [--only pd,hetero,slo] [--out docs]

1. pd: colocated vs prefill/decode disaggregated on a prefill-heavy workload (4k-token
   prompts, 128 out; TTFT 1 s, TPOT 25 ms): SLO attainment against rate on 8 H100s.
2. hetero: prefill on H100s, decode on cheaper A100s across a 100 or 25 Gb/s link, with and
   without the decode-side radix cache, on a multi-turn workload; against colocated H100s.
3. slo: fcfs vs priority vs slo scheduling on 16 H100s, 30% interactive / 70% batch.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tandem.bench.workloads import RequestClass
from tandem.sim.cluster import ClusterSpec
from tandem.sim.report import attained, simulate
from tandem.sim.workload import multi_class_requests, multi_turn_requests, random_requests

ENGINE = {"max_num_batched_tokens": 2048}


def cluster(groups, router="least_load", policy="fcfs", links=(), prefill_router="least_load"):
    return ClusterSpec.from_dict({"model": "llama-3-8b", "router": router, "engine": ENGINE,
                                  "scheduling_policy": policy, "groups": groups,
                                  "links": list(links), "prefill_router": prefill_router})  # fmt: skip


def pd_groups(p: int, d: int, decode_hw="H100", caching=True):
    return [{"name": "prefill", "role": "prefill", "hardware": "H100", "count": p},
            {"name": "decode", "role": "decode", "hardware": decode_hw, "count": d,
             "prefix_caching": caching}]  # fmt: skip


def link(gbs: float, latency_ms: float):
    return [{"from": "prefill", "to": "decode", "bandwidth_gbs": gbs, "latency_ms": latency_ms}]


def max_rate(points: list[dict], target=0.9) -> float | None:
    ok = [p["request_rate"] for p in points if attained(p) >= target]
    return max(ok) if ok else None


def study_pd(out: Path, lines: list[str]) -> None:
    from tandem.bench import plots

    slo = {"ttft": 1000.0, "tpot": 25.0}
    rates = [8, 16, 24, 32, 40, 48, 56]
    clusters = {
        "colocated 8 x H100": cluster([{"hardware": "H100", "count": 8}]),
        "4P + 4D H100": cluster(pd_groups(4, 4), links=link(50, 0.05)),
        "5P + 3D H100": cluster(pd_groups(5, 3), links=link(50, 0.05)),
    }
    sweeps = {}
    for name, c in clusters.items():
        sweeps[name] = []
        for rate in rates:
            reqs = random_requests(int(rate * 60), 4096, 128, rate, seed=0, range_ratio=0.5)
            sweeps[name].append(simulate(c, reqs, slo) | {"request_rate": rate})
    plots.sweep(sweeps, out / "sim-pd-vs-colocated.png", "simulated: 8 x H100, 4k in / 128 out")
    lines += ["| cluster | " + " | ".join(f"{r}/s" for r in rates) + " | max rate at 90% |",
              "|---|" + "---|" * (len(rates) + 1)]  # fmt: skip
    for name, points in sweeps.items():
        cells = " | ".join(f"{attained(p):.0%}" for p in points)
        lines.append(f"| {name} | {cells} | {max_rate(points) or '-'} |")
    lines.append("")
    lines += ["| cluster at 32/s | TTFT mean | TTFT p99 | TPOT mean | TPOT p99 |",
              "|---|---|---|---|---|"]  # fmt: skip
    for name, points in sweeps.items():
        p = next(p for p in points if p["request_rate"] == 32)
        lines.append(f"| {name} | {p['mean_ttft_ms']:.0f} | {p['p99_ttft_ms']:.0f} | "
                     f"{p['mean_tpot_ms']:.1f} | {p['p99_tpot_ms']:.1f} |")  # fmt: skip


def study_hetero(out: Path, lines: list[str]) -> None:
    reqs = multi_turn_requests(240, 5, 1024, 128, 4.0, 20.0, seed=0)
    clusters = {
        "colocated 4 x H100": cluster([{"hardware": "H100", "count": 4}], "prefix_aware"),
        "2P H100 + 2D H100, 50 GB/s, decode cache": cluster(pd_groups(2, 2), "prefix_aware",
                                                            links=link(50, 0.05)),
    }  # fmt: skip
    for gbs, what in ((12.5, "100 GbE"), (3.125, "25 GbE")):  # between clusters
        for caching in (False, True):
            name = f"2P H100 + 2D A100, {what}, {'decode cache' if caching else 'no decode cache'}"
            clusters[name] = cluster(pd_groups(2, 2, "A100", caching), "prefix_aware",
                                     links=link(gbs, 1.0))  # fmt: skip
    clusters["2P H100 + 2D A100, 25 GbE, decode cache, prefix-aware prefill"] = cluster(
        pd_groups(2, 2, "A100"), "prefix_aware", links=link(3.125, 1.0),
        prefill_router="prefix_aware")  # fmt: skip
    lines += ["| cluster | $/hour | TTFT mean | TTFT p99 | TPOT mean | KV sent (GB) | "
              "$/M output tokens |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    results = {}
    for name, c in clusters.items():
        r = results[name] = simulate(c, reqs)
        price = sum(g.price_per_hour * g.count for g in c.groups)
        lines.append(f"| {name} | {price:.2f} | {r['mean_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
                     f"{r['mean_tpot_ms']:.1f} | {r['kv_transfer_bytes'] / 1e9:.1f} | "
                     f"{r['cost_per_million_output_tokens']:.3f} |")  # fmt: skip

    plt = __import__("tandem.bench.plots", fromlist=["_pyplot"])._pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    names = list(results)
    for ax, key, label in ((axes[0], "mean_ttft_ms", "mean TTFT (ms)"),
                           (axes[1], "cost_per_million_output_tokens", "$ per M output tokens")):  # fmt: skip
        ax.barh(range(len(names)), [results[n][key] for n in names])
        ax.set_yticks(range(len(names)), names if ax is axes[0] else [], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(label)
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle("simulated: multi-turn (5 turns, 1024 new tokens a turn), Llama-3-8B")
    fig.tight_layout()
    fig.savefig(out / "sim-hetero-pd.png", dpi=110)


def study_slo(out: Path, lines: list[str]) -> None:
    plt = __import__("tandem.bench.plots", fromlist=["_pyplot"])._pyplot()
    classes = [
        RequestClass.parse("name=interactive,share=0.3,input=128-512,output=64-192,priority=0,"
                           "ttft=500,tpot=30"),
        RequestClass.parse("name=batch,share=0.7,input=1024-3072,output=128-384,priority=1,"
                           "ttft=20000,tpot=200"),
    ]  # fmt: skip
    rates = [80, 120, 160, 200, 240]
    found: dict[str, list[dict]] = {}
    for policy in ("fcfs", "priority", "slo"):
        c = cluster([{"hardware": "H100", "count": 16}], policy=policy)
        found[policy] = []
        for rate in rates:
            reqs = multi_class_requests(int(rate * 30), classes, rate, seed=0)
            found[policy].append(simulate(c, reqs) | {"request_rate": rate})
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for policy, points in found.items():
        for ax, key in zip(axes, ("interactive", "batch", "all")):
            ax.plot(rates, [p["slo_attainment"][key]["attainment"] for p in points], "o-",
                    label=policy)  # fmt: skip
            ax.set_title(f"{key} SLO attainment")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("simulated: 16 x H100, Llama-3-8B, 30% interactive / 70% batch")
    fig.tight_layout()
    fig.savefig(out / "sim-slo-16x.png", dpi=110)
    lines += ["| policy | " + " | ".join(f"{r}/s interactive / batch / goodput" for r in rates)
              + " |", "|---|" + "---|" * len(rates)]  # fmt: skip
    for policy, points in found.items():
        cells = []
        for p in points:
            a = p["slo_attainment"]
            good = a["all"]["attainment"] * p["completed"] / p["duration"]
            cells.append(f"{a['interactive']['attainment']:.0%} / {a['batch']['attainment']:.0%}"
                         f" / {good:.0f}")  # fmt: skip
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="pd,hetero,slo")
    ap.add_argument("--out", default="docs")
    args = ap.parse_args()
    out = Path(args.out)
    studies = {"pd": study_pd, "hetero": study_hetero, "slo": study_slo}
    for name in args.only.split(","):
        lines: list[str] = []
        t0 = time.perf_counter()
        studies[name](out, lines)
        print(f"\n## {name} (simulated; {time.perf_counter() - t0:.0f} s of wall time)\n")
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
