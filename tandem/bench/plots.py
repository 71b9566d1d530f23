"""PNG plots with matplotlib's Agg backend: latency CDFs for a run, and for a rate sweep
throughput, tail latency and SLO attainment against the offered rate."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tandem.bench.client import RequestResult
from tandem.bench.metrics import tpot


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_cdfs(runs: dict[str, list[RequestResult]], path: str | Path, title: str = "") -> Path:
    """One panel per metric (TTFT, TPOT, ITL, E2E), one curve per labelled run."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for label, results in runs.items():
        done = [r for r in results if r.success]
        series = {
            "TTFT (ms)": [r.ttft for r in done],
            "TPOT (ms)": [t for r in done if (t := tpot(r)) is not None],
            "ITL (ms)": [g for r in done for g in r.itl],
            "E2E latency (ms)": [r.latency for r in done],
        }
        for ax, (name, values) in zip(axes, series.items()):
            if values:
                xs = np.sort(np.asarray(values) * 1000)
                ax.plot(
                    xs, np.arange(1, len(xs) + 1) / len(xs), drawstyle="steps-post", label=label
                )
            ax.set_xlabel(name)
            ax.xaxis.set_major_locator(MaxNLocator(5))
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    axes[0].legend(loc="lower right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def sweep(points: dict[str, list[dict]], path: str | Path, title: str = "") -> Path:
    """For each labelled sweep (result dicts, one per rate): output tok/s, p99 TTFT, p99
    TPOT and SLO attainment against the request rate."""
    plt = _pyplot()
    panels = [
        ("output_throughput", "output tokens/s"),
        ("p99_ttft_ms", "p99 TTFT (ms)"),
        ("p99_tpot_ms", "p99 TPOT (ms)"),
        ("attainment", "SLO attainment"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 3.8))
    for label, results in points.items():
        results = [r for r in results if r["request_rate"] != "inf"]
        rates = [r["request_rate"] for r in results]
        for ax, (key, name) in zip(axes, panels):
            if key == "attainment":
                ys = [
                    (r.get("slo_attainment") or {}).get("all", {}).get("attainment")
                    for r in results
                ]
            else:
                ys = [r.get(key) for r in results]
            if any(y is not None for y in ys):
                ax.plot(rates, ys, marker="o", label=label)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
    axes[-1].set_ylim(0, 1.05)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
