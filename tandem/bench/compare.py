"""`tandem bench compare --peer vllm|llamacpp`: the same seeded workload against tandem and
a peer, one after the other on this machine and model, then both side by side.

Each server is started (tandem with `tandem serve`, the peer with its recipe under
benchmarks/peers/), run through every point of the workload, and stopped before the
other starts, so they never share the CPU. `--tandem-url` / `--peer-url` use servers
that are already running instead.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from tandem.bench import serve as bench
from tandem.bench.results import save_json
from tandem.bench.servers import install_peer, peer_server, tandem_server

# (label, result key, higher is better)
COLUMNS = [
    ("out tok/s", "output_throughput", True),
    ("TTFT mean ms", "mean_ttft_ms", False),
    ("TTFT p99 ms", "p99_ttft_ms", False),
    ("TPOT mean ms", "mean_tpot_ms", False),
    ("TPOT p99 ms", "p99_tpot_ms", False),
]
# Shown only when the run had SLOs (--goodput or multi-class SLOs).
SLO_COLUMNS = [
    ("goodput req/s", "request_goodput", True),
    ("SLO attain %", "slo_attainment_pct", True),
]


def metric(result: dict, key: str) -> float | None:
    if key == "slo_attainment_pct":
        slo = result.get("slo_attainment")
        return 100.0 * slo["all"]["attainment"] if slo else None
    return result.get(key)


def columns(row: dict) -> list[tuple[str, str, bool]]:
    """The metrics both servers reported for this row."""
    return [c for c in COLUMNS + SLO_COLUMNS if c[1] in row]


def scenario(result: dict) -> str:
    s = f"{result['dataset_name']} rate={result['request_rate']}"
    if result.get("max_concurrency"):
        s += f" c={result['max_concurrency']}"
    return s


def ratio(ours: float, theirs: float) -> float | None:
    return ours / theirs if theirs else None


def compare_rows(ours: list[dict], theirs: list[dict]) -> list[dict]:
    """One row per point both servers ran: each metric for both, and tandem / peer."""
    rows = []
    for a, b in zip(ours, theirs):
        row = {"scenario": scenario(a), "completed": (a["completed"], b["completed"])}
        for _, key, _ in COLUMNS + SLO_COLUMNS:
            ours, theirs = metric(a, key), metric(b, key)
            if ours is not None and theirs is not None:
                row[key] = {"tandem": ours, "peer": theirs, "ratio": ratio(ours, theirs)}
        rows.append(row)
    return rows


def format_table(rows: list[dict], peer: str) -> str:
    """Metric by metric: tandem, the peer, and tandem / peer (above 1 is better for tok/s,
    below 1 is better for latencies)."""
    lines = []
    head = f"{'metric':<14} {'tandem':>10} {peer:>10} {'ratio':>7}"
    for row in rows:
        done = row["completed"]
        lines += ["", f"== {row['scenario']}  (completed {done[0]} / {done[1]})", head]
        for label, key, higher_better in columns(row):
            cell = row[key]
            r = "-" if cell["ratio"] is None else f"{cell['ratio']:.2f}x"
            mark = "" if cell["ratio"] is None else _better(cell["ratio"], higher_better)
            lines.append(f"{label:<14} {cell['tandem']:>10.1f} {cell['peer']:>10.1f} {r:>7} {mark}")
    lines.append("")
    lines.append("ratio = tandem / peer; '+' where tandem is ahead")
    return "\n".join(lines)


def _better(r: float, higher_better: bool) -> str:
    return "+" if (r > 1) == higher_better and r != 1 else ""


def bench_server(args, prep, server, url: str | None, label: str) -> list:
    if url:
        return asyncio.run(bench.run_points(args, prep, url.rstrip("/"), label))
    with server:
        server.wait_ready(args.startup_timeout)
        return asyncio.run(bench.run_points(args, prep, server.base_url, label))


def run(args: argparse.Namespace) -> int:
    out = Path(args.result_dir)
    doc_path = out / (args.result_filename or f"compare-{args.dataset_name}-{args.peer}.json")
    name = doc_path.stem
    prep = bench.prepare(args)
    print(
        f"workload: {args.dataset_name}, {bench.num_requests(prep.sessions)} requests, seed {args.seed}"
    )
    if not args.peer_url and not args.no_install:
        install_peer(args.peer, args.peer_recipe)
    tandem = tandem_server(
        args.tandem_port, args.tandem_model, args.tandem_args.split(), out / f"{name}-tandem.log"
    )
    ours = bench_server(args, prep, tandem, args.tandem_url, "tandem")
    peer = peer_server(args.peer, args.peer_port, out / f"{name}-{args.peer}.log", args.peer_recipe)
    theirs = bench_server(args, prep, peer, args.peer_url, args.peer)
    ours = [p for p in ours if not p.result.get("search_probe")]  # probes differ per server
    theirs = [p for p in theirs if not p.result.get("search_probe")]
    rows = compare_rows([p.result for p in ours], [p.result for p in theirs])
    print(format_table(rows, args.peer))
    doc = {
        "peer": args.peer,
        "rows": rows,
        "tandem": [p.result for p in ours],
        args.peer: [p.result for p in theirs],
    }
    print(f"comparison saved to {save_json(doc, doc_path)}")
    if args.plot:
        _plot(out, name, args.peer, ours, theirs)
    return 1 if bench.report_failures(ours + theirs) else 0


def _plot(out: Path, name: str, peer: str, ours, theirs) -> None:
    from tandem.bench import plots

    for i, (a, b) in enumerate(zip(ours, theirs)):
        runs = {"tandem": a.run.results, peer: b.run.results}
        plots.latency_cdfs(runs, out / f"{name}-cdf{i}.png", title=scenario(a.result))
    finite = [
        (a.result, b.result) for a, b in zip(ours, theirs) if a.result["request_rate"] != "inf"
    ]
    if len(finite) > 1:
        plots.sweep(
            {"tandem": [a for a, _ in finite], peer: [b for _, b in finite]},
            out / f"{name}-sweep.png",
            title=name,
        )
    print(f"plots saved under {out}/{name}-*.png")
