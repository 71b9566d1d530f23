"""Prometheus metrics under vLLM's names with the prefix `tandem:` instead of `vllm:`, so an
existing vLLM dashboard works after a search-and-replace of the prefix.

Fed by AsyncLLM (as its observer): engine stats after every step, and each step's outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

if TYPE_CHECKING:
    from tandem.core.slo import SLOClass
    from tandem.engine.messages import EngineStats
    from tandem.engine.outputs import RequestOutput

# vLLM's buckets, so histograms line up with its dashboards
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
_LABELS = ["model_name", "engine"]
# TierStats field -> (metric name, help): each a counter with a `tier` label
_TIER_COUNTERS = [
    ("hits", "hits", "Blocks read back from a KV tier"),
    ("misses", "misses", "Blocks asked of a KV tier and not read (absent, corrupt, unreachable)"),
    ("bytes_loaded", "loaded_bytes", "KV bytes read back from a tier"),
    ("bytes_stored", "stored_bytes", "KV bytes written to a tier"),
    ("evictions", "evictions", "Blocks a tier dropped for room"),
    ("load_seconds", "tier_load_seconds", "Seconds spent reading a tier"),
    ("errors", "errors", "A tier's failed calls (a dead Redis, an unreadable file)"),
]


class Metrics:
    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no *_created series, as vLLM
        self.registry = CollectorRegistry()
        self._labels = (model_name, "0")
        self.running = self._gauge("num_requests_running", "Requests in the running batch")
        self.waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = self._gauge("kv_cache_usage_perc", "KV cache usage: 1 means 100 percent")
        self.pinned_blocks = self._gauge(
            "kv_pinned_blocks", "KV blocks agent sessions hold pinned between their turns"
        )
        self.prefix_queries = self._counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = self._counter("prefix_cache_hits", "Prompt tokens found in the cache")
        self.preemptions = self._counter("num_preemptions", "Cumulative number of preemptions")
        self.prompt_tokens = self._counter("prompt_tokens", "Prefill tokens processed")
        self.generation_tokens = self._counter("generation_tokens", "Generation tokens processed")
        self.success = Counter(
            "tandem:request_success",
            "Finished requests, by finish reason",
            [*_LABELS, "finished_reason"],
            registry=self.registry,
        )
        self.ttft = self._histogram(
            "time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds", "Inter-token latency", _ITL_BUCKETS
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_BUCKETS
        )
        self.queue_time = self._histogram(
            "request_queue_time_seconds",
            "Time spent waiting before first scheduled",
            _LATENCY_BUCKETS,
        )
        # SLO classes: attainment of each target, and requests shed, by class
        self.slo_requests = self._by_class("slo_requests", "Finished requests, by SLO class")
        self.slo_ttft_met = self._by_class("slo_ttft_met", "Requests that met their TTFT target")
        self.slo_tpot_met = self._by_class("slo_tpot_met", "Requests that met their TPOT target")
        self.slo_met = self._by_class("slo_met", "Requests that met all their targets (goodput)")
        self.shed = self._by_class("requests_shed", "Requests shed: their SLO could not be met")
        self.step_time = self._gauge("step_time_seconds", "The last engine step's execute time")
        self.steps = self._counter("engine_steps", "Engine steps that ran the model")
        self.execute_seconds = self._counter(
            "engine_execute_seconds", "Seconds the engine spent running the model (busy time)"
        )
        self.execute_cpu_seconds = self._counter(
            "engine_execute_cpu_seconds", "CPU seconds the engine-core process spent running it"
        )
        self.step_predicted = self._gauge(
            "step_time_predicted_seconds", "What the cost model predicted for the last step"
        )
        # prefill/decode disaggregation (zero on a colocated instance)
        self.kv_sent = self._counter("kv_transfer_sent_bytes", "KV bytes sent to decode instances")
        self.kv_received = self._counter(
            "kv_transfer_received_bytes", "KV bytes received from prefill instances"
        )
        self.kv_cached = self._counter(
            "kv_transfer_cached_prompt_tokens",
            "Prompt tokens a reservation found in this decode instance's cache (not sent)",
        )
        self.kv_failures = self._counter(
            "kv_transfer_failures", "Reservations given up: timed out, or KV sent wrong"
        )
        self.kv_seconds = self._histogram(
            "kv_transfer_seconds", "Seconds from a reservation to its commit", _TTFT_BUCKETS
        )
        # speculative decoding (zero without it), as vLLM's spec_decode_* counters
        self.spec_drafts = self._counter("spec_decode_num_drafts", "Rows verified with drafts")
        self.spec_draft_tokens = self._counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified"
        )
        self.spec_accepted = self._counter(
            "spec_decode_num_accepted_tokens", "Draft tokens the target model accepted"
        )
        self.spec_per_pos = Counter(
            "tandem:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens, by position in the draft",
            [*_LABELS, "position"],
            registry=self.registry,
        )
        self._spec_per_pos: list[int] = []
        # KV tiers (zero without them): per tier, and over the loads
        self._tier_counters = {
            field: Counter(f"tandem:kv_offload_{name}", doc, [*_LABELS, "tier"], registry=self.registry)
            for field, name, doc in _TIER_COUNTERS
        }  # fmt: skip
        self._tier_totals: dict[tuple[str, str], float] = {}
        # a mixture of experts (none for a dense model): what shows the experts' imbalance
        self.expert_tokens = Counter(
            "tandem:moe_expert_tokens",
            "Tokens routed to each expert, summed over the MoE layers (top-k: k per token per layer)",
            [*_LABELS, "expert"],
            registry=self.registry,
        )
        self._expert_tokens: list[int] = []
        self.role_switches = Counter(
            "tandem:role_switches",
            "Times POST /role switched this instance, by the role it took (prefill, decode)",
            [*_LABELS, "role"],
            registry=self.registry,
        )
        self.kv_lookups = self._counter(
            "kv_offload_lookups", "Admissions that asked the KV tiers for a prefix"
        )
        self.kv_lookup_hits = self._counter(
            "kv_offload_lookup_hits", "Admissions that found a prefix worth loading in a tier"
        )
        self.kv_loaded_tokens = self._counter(
            "kv_offload_loaded_tokens", "Prompt tokens loaded from the KV tiers, not computed"
        )
        self.kv_load_timeouts = self._counter(
            "kv_offload_load_timeouts", "Loads given up past --kv-offload-load-timeout"
        )
        self.kv_load_seconds = self._histogram(
            "kv_offload_load_seconds", "Seconds a prefix load took", _TTFT_BUCKETS
        )
        self._load_totals = (0, 0, 0, 0)
        self._slo: dict[str, SLOClass] = {}
        self._last_token_time: dict[str, float] = {}
        self._engine_totals = (0,) * 13  # the core's cumulative counters seen so far

    def _gauge(self, name: str, doc: str):
        return Gauge(f"tandem:{name}", doc, _LABELS, registry=self.registry).labels(*self._labels)

    def _counter(self, name: str, doc: str):
        return Counter(f"tandem:{name}", doc, _LABELS, registry=self.registry).labels(*self._labels)

    def _by_class(self, name: str, doc: str):
        return Counter(f"tandem:{name}", doc, [*_LABELS, "class"], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: list[float]):
        return Histogram(
            f"tandem:{name}", doc, _LABELS, buckets=buckets, registry=self.registry
        ).labels(*self._labels)

    # ---- AsyncLLM observer ---------------------------------------------------------
    def on_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.pinned_blocks.set(stats.num_pinned_blocks)
        totals = (
            stats.prefix_cache_queries,
            stats.prefix_cache_hits,
            stats.num_preemptions,
            stats.kv_bytes_sent,
            stats.kv_bytes_received,
            stats.kv_cached_tokens,
            stats.kv_transfer_failures,
            *_spec_totals(stats),
            stats.num_steps,
            stats.execute_seconds,
            stats.execute_cpu_seconds,
        )
        counters = (
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions,
            self.kv_sent,
            self.kv_received,
            self.kv_cached,
            self.kv_failures,
            self.spec_drafts,
            self.spec_draft_tokens,
            self.spec_accepted,
            self.steps,
            self.execute_seconds,
            self.execute_cpu_seconds,
        )
        for counter, new, old in zip(counters, totals, self._engine_totals):
            if new > old:
                counter.inc(new - old)
        self._engine_totals = totals
        per_pos = stats.spec_decode.accepted_per_pos if stats.spec_decode else []
        for pos, new in enumerate(per_pos):
            old = self._spec_per_pos[pos] if pos < len(self._spec_per_pos) else 0
            self.spec_per_pos.labels(*self._labels, str(pos)).inc(max(0, new - old))
        self._spec_per_pos = list(per_pos)
        for seconds in stats.kv_transfer_seconds:
            self.kv_seconds.observe(seconds)
        self._on_tier_stats(stats)
        for expert, new in enumerate(stats.expert_tokens):
            old = self._expert_tokens[expert] if expert < len(self._expert_tokens) else 0
            if new > old:
                self.expert_tokens.labels(*self._labels, str(expert)).inc(new - old)
        self._expert_tokens = list(stats.expert_tokens)
        self.step_time.set(stats.step_seconds)
        if stats.predicted_step_seconds is not None:
            self.step_predicted.set(stats.predicted_step_seconds)

    def _on_tier_stats(self, stats: EngineStats) -> None:
        for tier in stats.kv_tiers:
            for field, counter in self._tier_counters.items():
                new, key = getattr(tier, field), (tier.name, field)
                old = self._tier_totals.get(key, 0)
                if new > old:
                    counter.labels(*self._labels, tier.name).inc(new - old)
                self._tier_totals[key] = new
        loads = stats.kv_tier_loads
        if loads is not None:
            totals = (loads.lookups, loads.lookup_hits, loads.loaded_tokens, loads.timeouts)
            counters = (self.kv_lookups, self.kv_lookup_hits, self.kv_loaded_tokens,
                        self.kv_load_timeouts)  # fmt: skip
            for counter, new, old in zip(counters, totals, self._load_totals):
                if new > old:
                    counter.inc(new - old)
            self._load_totals = totals
        for seconds in stats.kv_load_seconds:
            self.kv_load_seconds.observe(seconds)

    def on_add(self, request_id: str, slo: SLOClass) -> None:
        self._slo[request_id] = slo

    def on_role_switch(self, role: str) -> None:
        self.role_switches.labels(*self._labels, role).inc()

    def on_shed(self, request_id: str) -> None:
        slo = self._slo.pop(request_id, None)
        if slo is not None:
            self.shed.labels(*self._labels, slo.name).inc()

    def _record_slo(self, out: RequestOutput, now: float) -> None:
        slo = self._slo.pop(out.request_id, None)
        if slo is None:
            return
        m, labels = out.metrics, (*self._labels, slo.name)
        first = m.first_token_time if m.first_token_time is not None else now
        tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        tpot = (now - first) / (tokens - 1) if tokens > 1 else 0.0
        ttft_ok = slo.ttft_ms is None or (first - m.arrival_time) * 1000 <= slo.ttft_ms
        tpot_ok = slo.tpot_ms is None or tpot * 1000 <= slo.tpot_ms
        self.slo_requests.labels(*labels).inc()
        for counter, ok in ((self.slo_ttft_met, ttft_ok), (self.slo_tpot_met, tpot_ok),
                            (self.slo_met, ttft_ok and tpot_ok)):  # fmt: skip
            counter.labels(*labels).inc(ok)

    def on_outputs(self, outputs: list[RequestOutput], num_new_tokens: int, now: float) -> None:
        self.generation_tokens.inc(num_new_tokens)
        for out in outputs:
            m = out.metrics
            last = self._last_token_time.get(out.request_id)
            if last is None:
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.ttft.observe(now - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            else:
                self.itl.observe(now - last)
            if out.finished:
                self._last_token_time.pop(out.request_id, None)
                self.e2e.observe(now - m.arrival_time)
                reason = out.outputs[0].finish_reason or "stop"
                self.success.labels(*self._labels, reason).inc()
                self._record_slo(out, now)
            else:
                self._last_token_time[out.request_id] = now

    def on_abort(self, request_id: str) -> None:
        self._last_token_time.pop(request_id, None)
        self._slo.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _spec_totals(stats: EngineStats) -> tuple[int, int, int]:
    spec = stats.spec_decode
    if spec is None:
        return (0, 0, 0)
    return (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
