"""The result of a run: a JSON document under `vllm bench serve`'s key names, and the
summary table printed in the terminal."""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

from tandem.bench.metrics import LATENCY_METRICS
from tandem.bench.runner import RunResult

METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def rate_value(rate: float) -> float | str:
    """vLLM writes an infinite rate as the string 'inf' (JSON has no infinity)."""
    return "inf" if math.isinf(rate) else rate


def build_result(
    meta: dict,
    metrics: dict,
    run: RunResult,
    slo_attainment: dict | None = None,
    detailed: bool = False,
) -> dict:
    result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), **meta, **metrics}
    if slo_attainment is not None:
        result["slo_attainment"] = slo_attainment
    if detailed:
        rs = run.results
        result |= {
            "input_lens": [r.prompt_len for r in rs],
            "output_lens": [r.output_len or 0 for r in rs],
            "ttfts": [r.ttft for r in rs],
            "itls": [r.itl for r in rs],
            "latencies": [r.latency for r in rs],
            "start_times": [r.start_time - run.start for r in rs],  # from the run's start
            "classes": [r.cls for r in rs],
            "generated_texts": [r.generated_text for r in rs],
            "errors": [r.error for r in rs],
        }
    return result


def save_json(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, allow_nan=False, default=_plain) + "\n")
    return path


def _plain(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    raise TypeError(f"not JSON: {type(x).__name__}")


def format_summary(result: dict, percentiles=(90, 99), goodput: bool = False) -> str:
    """The terminal table, laid out as vLLM's."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label, value, fmt="{:<10.2f}"):
        lines.append(f"{label:<40} " + fmt.format(value))

    row("Successful requests:", result["completed"], "{:<10}")
    row("Failed requests:", result["failed"], "{:<10}")
    if result.get("max_concurrency"):
        row("Maximum request concurrency:", result["max_concurrency"], "{:<10}")
    if result.get("request_rate") not in (None, "inf"):
        row("Request rate configured (RPS):", result["request_rate"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", result["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", result["request_throughput"])
    if goodput and result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    for name in LATENCY_METRICS:
        short, title = METRIC_TITLES[name]
        lines.append(f"{title:-^50}")
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", result[f"median_{name}_ms"])
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            row(f"P{word} {short} (ms):", result[f"p{word}_{name}_ms"])
    if result.get("spec_decode_num_draft_tokens"):
        lines.append("{:-^50}".format("Speculative Decoding"))
        row("Acceptance rate (%):", 100 * result["spec_decode_acceptance_rate"])
        row("Mean acceptance length:", result["spec_decode_mean_acceptance_length"])
        row("Drafted tokens:", result["spec_decode_num_draft_tokens"], "{:<10}")
        row("Accepted tokens:", result["spec_decode_num_accepted_tokens"], "{:<10}")
    if result.get("slo_attainment"):
        lines.append("{:-^50}".format("SLO attainment"))
        for cls, a in result["slo_attainment"].items():
            met = ", ".join(f"{k} {n}" for k, n in a.get("met", {}).items())
            lines.append(
                "{:<40} {:<10}".format(
                    f"{cls}:",
                    f"{a['attainment']:.1%} ({a['good']}/{a['requests']}"
                    + (f"; met {met})" if met else ")"),
                )
            )
    lines.append("=" * 50)
    return "\n".join(lines)


def format_sweep(points: list[dict]) -> str:
    """One line per rate of a sweep."""
    head = f"{'rate':>8} {'req/s':>8} {'out tok/s':>10} {'TTFT p99':>10} {'TPOT p99':>10} {'attain':>8}"
    lines = [head, "-" * len(head)]
    for p in points:
        att = (p.get("slo_attainment") or {}).get("all", {}).get("attainment")
        lines.append(
            f"{p['request_rate']!s:>8} {p['request_throughput']:>8.2f} {p['output_throughput']:>10.1f} "
            f"{p['p99_ttft_ms']:>10.1f} {p['p99_tpot_ms']:>10.1f} "
            f"{'' if att is None else f'{att:.1%}':>8}"
        )
    return "\n".join(lines)
