"""A simulation's result under `tandem bench`'s JSON keys (TTFT, TPOT, ITL, E2EL, goodput),
plus what only a simulation knows: cost per million output tokens and each group's
utilisation."""

from __future__ import annotations

from tandem.bench import metrics
from tandem.bench.client import RequestResult
from tandem.sim.simulator import Record, Simulation


def to_results(records: list[Record]) -> list[RequestResult]:
    results = []
    for r in records:
        ok = not r.error and r.first_token is not None and r.finished is not None
        start = r.request.arrival
        times = [start, *r.token_times]
        results.append(
            RequestResult(
                cls=r.request.cls,
                success=ok,
                error=r.error,
                prompt_len=len(r.request.prompt),
                output_len=len(r.token_times),
                ttft=(r.first_token - start) if ok else 0.0,
                itl=[b - a for a, b in zip(times[1:], times[2:])],
                latency=(r.finished - start) if ok else 0.0,
                start_time=start,
            )
        )
    return results


def summarize(sim: Simulation, records: list[Record], percentiles=(90, 99),
              goodput: dict[str, float] | None = None) -> dict:  # fmt: skip
    results = to_results(records)
    end = max((r.finished for r in records if r.finished is not None), default=0.0)
    start = min((r.request.arrival for r in records), default=0.0)
    duration = max(end - start, 1e-9)
    summary = metrics.summarize(results, duration, percentiles, goodput)
    class_slos = {r.request.cls: r.request.slo for r in records if r.request.slo}
    if goodput or class_slos:  # per class where classes carry SLOs, else --goodput's
        summary["slo_attainment"] = metrics.attainment(results, class_slos, goodput)
    dollars = sum(i.group.price_per_hour for i in sim.instances) * duration / 3600
    out_tokens = summary["total_output_tokens"]
    groups = {}
    for g in sim.cluster.groups:
        members = [i for i in sim.instances if i.group is g]
        busy = sum(i.runner.busy_seconds for i in members)
        groups[g.name] = {
            "instances": len(members),
            "hardware": g.hardware,
            "tp": g.tp,
            "pp": g.pp,
            "utilization": busy / (duration * len(members)),
            "busy_seconds": busy,  # its instances' steps, host costs included
            "kv_tokens_per_instance": g.kv_tokens,
        }
        tiers = [i.tiers for i in members if i.tiers is not None]
        if tiers:  # prompt tokens its instances loaded from KV tiers instead of computing
            groups[g.name]["kv_loaded_tokens"] = sum(t.stats.loaded_tokens for t in tiers)
            groups[g.name]["kv_load_timeouts"] = sum(t.stats.timeouts for t in tiers)
    handed = [r for r in records if r.prefilled is not None and r.first_token is not None]
    if handed:  # disaggregated: where TTFT went, as the proxy's pd_handoff_stage_seconds
        stages = {"reserve": [r.reserved - r.request.arrival for r in handed],
                  "prefill": [r.prefilled - r.reserved for r in handed],
                  "first_byte": [r.first_token - r.prefilled for r in handed]}  # fmt: skip
        summary["pd_handoff_stage_ms"] = {k: 1e3 * sum(v) / len(v) for k, v in stages.items()}
    return summary | {
        "simulated": True,
        "simulated_seconds": duration,
        "num_steps": sim.num_steps,
        "cost_dollars": dollars,
        "kv_transfer_bytes": sum(r.kv_bytes for r in records),  # disaggregated clusters
        "cost_per_million_output_tokens": dollars / out_tokens * 1e6 if out_tokens else None,
        "groups": groups,
    }


def simulate(
    cluster, requests, goodput: dict[str, float] | None = None, processes: int = 1
) -> dict:
    """Run `requests` on `cluster` (stepped by up to `processes` processes: shards.py) and
    summarize them."""
    sim = Simulation(cluster, requests, processes)
    return summarize(sim, sim.run(), goodput=goodput)


def attained(result: dict) -> float:
    """The fraction of requests that met their SLOs (1.0 when none were set)."""
    return (result.get("slo_attainment") or {}).get("all", {}).get("attainment", 1.0)
